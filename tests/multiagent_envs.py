"""Small PettingZoo environments for the multi-agent tests, each learnable in seconds and each
failing a learner that lacks what it tests:

- ``meet``: two agents on a ring must meet; to move towards the other an agent must see where
  it is (a policy blind to its partner's position cannot do better than chance).
- ``speaker_listener``: agents with different spaces; the speaker sees a target and says a
  word, the listener hears it and must name the target (one shared policy cannot act for both).
- ``masked_choice``: the best-paying action is always illegal (masked); taking it writes a
  marker file. The legal optimum is 1.0.
- ``relay``: one agent leaves and another joins mid-episode.
- ``spread``: three agents with continuous actions in Box(0, 1, (5,)), as mpe2's
  simple_spread with continuous_actions (which the test extras do not install).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv

RING = 10
MEET_STEPS = 10
GAPS = (3, 4, 6, 7)  # not RING / 2: two agents alike, each going the short way, would chase each other


class Meet(ParallelEnv):  # type: ignore[misc]  # pettingzoo is untyped
    """Two agents on a ring of RING cells, GAPS apart: each step each moves left, stays or
    moves right, and both pay 0.1; when they share a cell (or pass each other) both get 1 and
    it ends (MEET_STEPS at most). Going towards each other gets 0.9; acting at random -0.4."""

    metadata: ClassVar[dict[str, Any]] = {"name": "meet_v0"}

    def __init__(self) -> None:
        self.possible_agents = ["a_0", "a_1"]
        self.agents: list[str] = []
        self._rng = np.random.default_rng()
        self.position = dict.fromkeys(self.possible_agents, 0)
        self.steps = 0

    def observation_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Box(0.0, 1.0, (2 * RING,), np.float32)

    def action_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Discrete(3)

    def _observe(self, agent: str) -> np.ndarray:
        other = "a_1" if agent == "a_0" else "a_0"
        obs = np.zeros(2 * RING, np.float32)
        obs[self.position[agent]] = 1.0
        obs[RING + self.position[other]] = 1.0
        return obs

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        first = int(self._rng.integers(RING))
        self.position = {"a_0": first, "a_1": (first + int(self._rng.choice(GAPS))) % RING}
        self.steps = 0
        return {a: self._observe(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        before = dict(self.position)
        for agent, action in actions.items():
            self.position[agent] = (self.position[agent] + int(action) - 1) % RING
        self.steps += 1
        crossed = self.position["a_0"] == before["a_1"] and self.position["a_1"] == before["a_0"]
        met = self.position["a_0"] == self.position["a_1"] or crossed
        reward = 1.0 if met else -0.1
        agents = self.agents
        observations = {a: self._observe(a) for a in agents}
        rewards = dict.fromkeys(agents, reward)
        terminations = dict.fromkeys(agents, met)
        truncations = dict.fromkeys(agents, not met and self.steps >= MEET_STEPS)
        if met or self.steps >= MEET_STEPS:
            self.agents = []
        return observations, rewards, terminations, truncations, {a: {} for a in agents}


def meet() -> Meet:
    return Meet()


TARGETS = 4


class SpeakerListener(ParallelEnv):  # type: ignore[misc]
    """Two steps. The speaker sees the target (one of TARGETS) and its action is a word; at
    the second step the listener hears the first step's word and names a target: both get 1
    if it is the speaker's. The two agents' observation spaces differ."""

    metadata: ClassVar[dict[str, Any]] = {"name": "speaker_listener_v0"}

    def __init__(self) -> None:
        self.possible_agents = ["speaker", "listener"]
        self.agents: list[str] = []
        self._rng = np.random.default_rng()
        self.target = 0
        self.word = 0
        self.steps = 0

    def observation_space(self, agent: str) -> spaces.Space[Any]:
        size = TARGETS if agent == "speaker" else TARGETS + 1
        return spaces.Box(0.0, 1.0, (size,), np.float32)

    def action_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Discrete(TARGETS)

    def _observations(self) -> dict[str, np.ndarray]:
        speaker = np.zeros(TARGETS, np.float32)
        speaker[self.target] = 1.0
        listener = np.zeros(TARGETS + 1, np.float32)
        if self.steps == 1:
            listener[self.word] = 1.0
            listener[TARGETS] = 1.0
        return {"speaker": speaker, "listener": listener}

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        self.agents = list(self.possible_agents)
        self.target = int(self._rng.integers(TARGETS))
        self.steps = 0
        return self._observations(), {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        agents = self.agents
        if self.steps == 0:
            self.word = int(actions["speaker"])
            self.steps = 1
            return (
                self._observations(),
                dict.fromkeys(agents, 0.0),
                dict.fromkeys(agents, False),
                dict.fromkeys(agents, False),
                {a: {} for a in agents},
            )
        reward = 1.0 if int(actions["listener"]) == self.target else 0.0
        self.steps = 2
        self.agents = []
        return (
            self._observations(),
            dict.fromkeys(agents, reward),
            dict.fromkeys(agents, True),
            dict.fromkeys(agents, False),
            {a: {} for a in agents},
        )


def speaker_listener() -> SpeakerListener:
    return SpeakerListener()


class MaskedChoice(ParallelEnv):  # type: ignore[misc]
    """One agent, two states. In each, action 0 would pay 10 but is always masked; in the
    first, action 1 leads on (0) and action 2 ends (0.2); in the second, action 1 pays 1 and
    action 2 pays 0, and it ends. Taking action 0 writes ``marker`` (and ends, paying 0)."""

    metadata: ClassVar[dict[str, Any]] = {"name": "masked_choice_v0"}

    def __init__(self, marker: str = "") -> None:
        self.possible_agents = ["player"]
        self.agents: list[str] = []
        self.marker = marker
        self.state = 0

    def observation_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Dict(
            {
                "observation": spaces.Box(0.0, 1.0, (2,), np.float32),
                "action_mask": spaces.Box(0, 1, (3,), np.int8),
            }
        )

    def action_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Discrete(3)

    def _observe(self) -> dict[str, dict[str, np.ndarray]]:
        obs = np.zeros(2, np.float32)
        obs[self.state] = 1.0
        return {"player": {"observation": obs, "action_mask": np.array([0, 1, 1], np.int8)}}

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        self.agents = ["player"]
        self.state = 0
        return self._observe(), {"player": {}}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        action = int(actions["player"])
        if action == 0:
            if self.marker:
                Path(self.marker).write_text("an illegal action was taken\n")
            reward, done = 0.0, True
        elif self.state == 0:
            reward, done = (0.0, False) if action == 1 else (0.2, True)
            self.state = 1
        else:
            reward, done = (1.0 if action == 1 else 0.0), True
        obs = self._observe()
        if done:
            self.agents = []
        return obs, {"player": reward}, {"player": done}, {"player": False}, {"player": {}}


def masked_choice(marker: str = "") -> MaskedChoice:
    return MaskedChoice(marker)


class Relay(ParallelEnv):  # type: ignore[misc]
    """Agent ``early`` acts in steps 1-3 and ends; agent ``late`` joins after step 2 and acts
    in steps 3-6: three transitions and four. Each step pays every agent that acts in it 1."""

    metadata: ClassVar[dict[str, Any]] = {"name": "relay_v0"}

    def __init__(self) -> None:
        self.possible_agents = ["early", "late"]
        self.agents: list[str] = []
        self.t = 0

    def observation_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Box(0.0, 10.0, (1,), np.float32)

    def action_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Discrete(2)

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        self.t = 0
        self.agents = ["early"]
        return {"early": np.zeros(1, np.float32)}, {"early": {}}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        assert set(actions) == set(self.agents), (actions, self.agents)  # only the agents playing act
        self.t += 1
        playing = list(self.agents)
        obs = {a: np.full(1, self.t, np.float32) for a in playing}
        done = {a: (a == "early" and self.t == 3) or (a == "late" and self.t == 6) for a in playing}
        rewards = dict.fromkeys(playing, 1.0)
        self.agents = [a for a in playing if not done[a]]
        if self.t == 2:  # joins: its first observation now, its first action next step
            self.agents.append("late")
            obs["late"] = np.full(1, self.t, np.float32)
        return obs, rewards, done, dict.fromkeys(obs, False), {a: {} for a in obs}


def relay() -> Relay:
    return Relay()


SPREAD_STEPS = 10


class Spread(ParallelEnv):  # type: ignore[misc]
    """Three agents, each acting a point in Box(0, 1, (5,)) and paid minus its mean distance
    from its observed target; SPREAD_STEPS steps."""

    metadata: ClassVar[dict[str, Any]] = {"name": "spread_v0"}

    def __init__(self) -> None:
        self.possible_agents = ["agent_0", "agent_1", "agent_2"]
        self.agents: list[str] = []
        self.t = 0
        self.rng = np.random.default_rng(0)
        self.targets: dict[str, np.ndarray] = {}

    def observation_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Box(0.0, 1.0, (5,), np.float32)

    def action_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Box(0.0, 1.0, (5,), np.float32)

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict, dict]:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        self.t = 0
        self.agents = list(self.possible_agents)
        self.targets = {a: self.rng.random(5, dtype=np.float32) for a in self.agents}
        return dict(self.targets), {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        for a, action in actions.items():
            assert self.action_space(a).contains(np.asarray(action, np.float32)), (a, action)
        self.t += 1
        rewards = {a: -float(np.abs(np.asarray(actions[a]) - self.targets[a]).mean()) for a in self.agents}
        self.targets = {a: self.rng.random(5, dtype=np.float32) for a in self.agents}
        over = self.t >= SPREAD_STEPS
        obs = dict(self.targets)
        if over:
            self.agents = []
        return obs, rewards, dict.fromkeys(obs, False), dict.fromkeys(obs, over), {a: {} for a in obs}


def spread() -> Spread:
    return Spread()
