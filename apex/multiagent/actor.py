"""The multi-agent actor core: K PettingZoo environments, each agent acting through its policy's
``EpisodeActorCore`` (the algorithm's, as `apex serve` uses it for episodes stepped
elsewhere): every agent's episode is an ``Episode`` on its own slot, so an agent that ends
early stops making transitions and one that joins later starts its own. One forward pass a
policy a step, over the agents of every environment that act now (all of a ParallelEnv's live
agents, an AECEnv's agent whose turn it is).

What ``act()`` gives the actor process is one policy's batch at a time, named by
``batch_info``, with the records of its agents' episodes; the team's records (the mean of an
episode's agents' returns) go with whichever batch is sent next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from apex import algos
from apex.config import Config
from apex.config.multi_agent import WEIGHT_SEPARATOR
from apex.core import EpisodeActorCore, EpisodeRecord
from apex.core.episode import Episode, stack_frames
from apex.envs.multi_agent import MultiAgentEnv, Outcome
from apex.envs.policy_map import MultiAgentSpec, multi_agent_spec
from apex.errors import ConfigError, ProtocolError
from apex.multiagent.selfplay import LATEST, RANDOM, SNAPSHOT_MARK, OpponentDraw, RandomPlayer, match_outcome
from apex.wire.protocol import Message

POLICY_SEED_FACTOR = 7919  # each player's sampling seed apart from the others'
SHARED = "shared"  # the one policy of a shared mapping: the one self-play trains
LATEST_PLAYER = "shared:latest"  # self-play opponents on the newest weights, whose experience is not sent
RANDOM_PLAYER = "random"


def per_agent_setup(setup: dict[str, Any], num_envs: int, seats: int) -> dict[str, Any]:
    """A policy's part of the welcome (for ``num_envs`` environments) as its episode core
    takes it for ``seats`` agents in each: every list of ``num_envs`` items (Ape-X's ladder)
    is per environment, each item repeated for each seat, so that the agents of one
    environment share its rung."""
    return {
        key: [item for item in value for _ in range(seats)]
        if isinstance(value, list) and len(value) == num_envs
        else value
        for key, value in setup.items()
    }


def setup_problem(
    setup: dict[str, Any], spec: MultiAgentSpec, policy_problem: Callable[[dict[str, Any]], str | None]
) -> str | None:
    """What is wrong with a multi-agent welcome's ``policies`` (each checked by its
    algorithm's ``policy_problem`` as a single-agent welcome would be), or None."""
    parts = setup.get("policies")
    if not isinstance(parts, dict) or sorted(parts) != sorted(spec.policies):
        return f"setup.policies must map each of this run's policies ({', '.join(spec.policies)}) to its part"
    for name, part in parts.items():
        if not isinstance(part, dict):
            return f"setup.policies.{name} must be a mapping"
        if (problem := policy_problem({**setup, **part})) is not None:
            return f"setup.policies.{name}: {problem}"
    return None


class MultiAgentActor:
    """K multi-agent environments; ``act()`` is one step of all of them (or a batch already made).

    Each agent's episode is played by a *player*: its policy's episode core, or in self-play
    the opponents' (the newest weights, a snapshot of the pool, the random player), drawn when
    the episode starts. Only the players of trained policies make batches."""

    def __init__(
        self,
        config: Config,
        setup: dict[str, Any],
        seed: int,
        tick: Callable[[], None] = lambda: None,
        spec: MultiAgentSpec | None = None,
    ) -> None:
        self.config = config
        self.spec = spec or multi_agent_spec(config)
        self._side = algos.get(config.algo).actor()
        k = setup["num_envs"]
        if (problem := setup_problem(setup, self.spec, self._side.setup_problem)) is not None:
            raise ProtocolError(f"the welcome's setup is malformed: {problem}")
        self._setups = {
            name: {**setup, **per_agent_setup(setup["policies"][name], k, len(p.agents)), "num_envs": k * len(p.agents)}
            for name, p in self.spec.policies.items()
        }
        self._seed = seed
        self.players: dict[str, EpisodeActorCore] = {name: self._core(name, name) for name in self.spec.policies}
        self.self_play = config.multi_agent.self_play if config.multi_agent.self_play.enabled else None
        self._draw = OpponentDraw(config.multi_agent.self_play, seed)
        if self.self_play is not None:
            shared = self.spec.policies[SHARED].spec
            self.players[RANDOM_PLAYER] = RandomPlayer(shared.num_actions, seed + 1)
            # Always there: it also finishes the episodes whose snapshot left the pool.
            self.players[LATEST_PLAYER] = self._core(SHARED, LATEST_PLAYER)
        # The Ape-X ladder's evaluation rungs are per environment (every agent of one on its rung).
        first = setup["policies"][next(iter(self.spec.policies))]
        self.eval_envs = [bool(e) for e in first.get("eval_envs", [True] * k)]
        self._yardstick: list[bool | None] = (
            [bool(e) for e in first["eval_envs"]] if "eval_envs" in first else [None] * k
        )
        self.envs: list[MultiAgentEnv] = []
        for _ in range(k):
            self.envs.append(self.spec.make(config))
            tick()
        self.steps = 0  # vector steps taken
        self.weights_version = -1
        self._episodes: list[dict[str, Episode]] = [{} for _ in range(k)]
        self._player_of: list[dict[str, str]] = [{} for _ in range(k)]  # agent -> its player this episode
        self._seating: list[tuple[str, int]] = [("", LATEST)] * k  # self-play: (learning seat, opponents)
        self._team_length = [0] * k
        self._team_returns: list[dict[str, float]] = [{} for _ in range(k)]
        self._next: list[Outcome] = []
        self._ready: deque[tuple[str, dict[str, np.ndarray], list[EpisodeRecord]]] = deque()
        self._teams: list[EpisodeRecord] = []
        self._matches: list[list[int]] = []
        self._sending: tuple[str, list[EpisodeRecord]] | None = None  # the policy and records of the batch out
        for i, env in enumerate(self.envs):
            self._next.append(self._started(i, env.reset(seed=seed + i)))
            tick()

    def _core(self, policy: str, player: str) -> EpisodeActorCore:
        """A new episode core of ``policy`` for ``player`` (its own seed)."""
        offset = POLICY_SEED_FACTOR * (1 + sum(map(ord, player)))
        return self._side.episode_core(
            self.config, self._setups[policy], self.spec.policies[policy].spec, self._seed + offset
        )

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    def set_weights(self, msg: Message) -> None:
        """One message holds every policy's weights (``<policy>/<array>``), and in self-play
        the pool's snapshots (``shared@<id>/<array>``); each player takes its own."""
        parts: dict[str, dict[str, np.ndarray]] = {name: {} for name in self.spec.policies}
        for key, array in msg.arrays.items():
            name, sep, rest = key.partition(WEIGHT_SEPARATOR)
            policy, mark, snapshot = name.partition(SNAPSHOT_MARK)
            if not sep or policy not in self.spec.policies or (mark and not self._snapshot_name(policy, snapshot)):
                raise ProtocolError(f"weights for an unknown policy: array {key!r}")
            parts.setdefault(name, {})[rest] = array
        if self.self_play is not None and len(parts) - len(self.spec.policies) > self.self_play.pool_size:
            raise ProtocolError(f"weights for more snapshots than the pool holds ({self.self_play.pool_size})")
        for name, arrays in parts.items():
            if name not in self.players:
                self.players[name] = self._core(SHARED, name)  # a snapshot the pool took since
            self.players[name].set_weights(Message(msg.type, msg.fields, arrays))
        if LATEST_PLAYER in self.players:
            self.players[LATEST_PLAYER].set_weights(Message(msg.type, msg.fields, parts[SHARED]))
        for gone in [n for n in self.players if SNAPSHOT_MARK in n and n not in parts]:
            self._hand_over(gone)
            del self.players[gone]
        self.weights_version = msg.fields["version"]

    def _hand_over(self, gone: str) -> None:
        """The episodes that snapshot ``gone`` (leaving the pool) plays, under way or not yet
        begun, finish with the newest weights; their matches count against the newest."""
        latest = self.players[LATEST_PLAYER]
        for k, players in enumerate(self._player_of):
            seated = [agent for agent, player in players.items() if player == gone]
            for agent in seated:
                players[agent] = LATEST_PLAYER
                episode = self._episodes[k].get(agent)
                if episode is None:
                    continue  # not begun: `_episode` begins it on its new player
                self.players[gone].abandon(episode)
                if episode.acted:  # the step under way ends here, as the next action would end it
                    episode.length += 1
                    episode.episode_return += episode.reward
                episode.acted, episode.reward = False, 0.0
                latest.begin(episode)
            if seated:
                self._seating[k] = (self._seating[k][0], LATEST)

    def _snapshot_name(self, policy: str, snapshot: str) -> bool:
        """Whether ``policy@snapshot`` can name a snapshot of this run's self-play pool."""
        return self.self_play is not None and policy == SHARED and snapshot.isdigit() and len(snapshot) <= 15

    @property
    def pool(self) -> list[int]:
        return sorted(int(name.partition(SNAPSHOT_MARK)[2]) for name in self.players if SNAPSHOT_MARK in name)

    def batch_info(self, episodes: list[EpisodeRecord]) -> dict[str, Any]:
        """The batch just given's policy and its agents' episode records, the team records
        ``episodes`` the actor process has gathered since it last sent, and in self-play the
        matches played since."""
        if self._sending is None:
            raise RuntimeError("batch_info before act() gave a batch")
        policy, records = self._sending
        info: dict[str, Any] = {"policy": policy, "episodes": records, "teams": episodes}
        if self.self_play is not None:
            info["matches"], self._matches = self._matches, []
        return info

    def act(self) -> tuple[dict[str, np.ndarray] | None, list[EpisodeRecord]]:
        """A batch made earlier, or one step of every environment: (a batch to send or None,
        the team records of the episodes that ended)."""
        if not self._ready:
            self._step_all()
        teams, self._teams = self._teams, []
        if not self._ready:
            return None, teams
        policy, batch, records = self._ready.popleft()
        self._sending = (policy, records)
        return batch, teams

    def _step_all(self) -> None:
        turns: dict[str, list[tuple[int, Episode, np.ndarray]]] = {}
        for k, outcome in enumerate(self._next):
            for turn in outcome.turns:
                episode = self._episode(k, turn.agent)
                episode.mask = turn.mask
                turns.setdefault(self._player_of[k][turn.agent], []).append((k, episode, turn.frame))
        actions: list[dict[str, Any]] = [{} for _ in self.envs]
        for player, acting in turns.items():
            episodes = [episode for _, episode, _ in acting]
            frames = np.stack([frame for _, _, frame in acting])
            chosen = self.players[player].act(episodes, self._stacked(acting[0][1].id, episodes, frames), None)
            for (k, episode, _), action in zip(acting, chosen):
                actions[k][episode.id] = action
                if episode.acted:
                    episode.length += 1
                    episode.episode_return += episode.reward
                episode.acted, episode.reward = True, 0.0
        for k, env in enumerate(self.envs):
            if actions[k]:
                self._team_length[k] += 1
                self._next[k] = self._outcome(k, env.step(actions[k]))
        self.steps += 1
        for name in self.spec.trained:
            for batch, records in self.players[name].take():
                self._ready.append((name, batch, records))
        for name in set(self.players) - set(self.spec.trained):
            self.players[name].take()  # acting only: what it makes is not sent

    def _stacked(self, agent: str, episodes: list[Episode], frames: np.ndarray) -> np.ndarray:
        policy = self.spec.policies[self.spec.policy_of[agent]].spec
        return stack_frames(episodes, frames, policy.stack, policy.frame_shape, policy.frame_dtype)

    def _started(self, k: int, outcome: Outcome) -> Outcome:
        """A new episode in environment k: its players drawn (self-play), then its first turns."""
        if self.self_play is not None:
            seat, opponent = self._draw.draw(list(self.spec.agents), self.pool, self._yardstick[k])
            self._seating[k] = (seat, opponent)
            other = {RANDOM: RANDOM_PLAYER, LATEST: SHARED if self.self_play.train_opponents else LATEST_PLAYER}
            opponents = other.get(opponent, f"{SHARED}{SNAPSHOT_MARK}{opponent}")
            self._player_of[k] = {agent: SHARED if agent == seat else opponents for agent in self.spec.agents}
        else:
            self._player_of[k] = dict(self.spec.policy_of)
        return outcome

    def _episode(self, k: int, agent: str) -> Episode:
        """Agent ``agent``'s episode in environment k, begun on its own slot at its first turn."""
        episode = self._episodes[k].get(agent)
        if episode is None:
            policy = self.spec.policies[self.spec.policy_of[agent]]
            slot = k * len(policy.agents) + policy.agents.index(agent)
            episode = Episode(agent, slot, 0.0)
            self.players[self._player_of[k][agent]].begin(episode)
            self._episodes[k][agent] = episode
        return episode

    def _outcome(self, k: int, outcome: Outcome) -> Outcome:
        """Takes in a step's rewards and ended agents; resets the environment when all ended."""
        episodes = self._episodes[k]
        for agent, reward in outcome.rewards.items():
            if agent in episodes:
                episodes[agent].reward += reward
        for ended in outcome.ended:
            episode = episodes.pop(ended.agent, None)
            if episode is None:
                continue
            if episode.acted:
                frames = self._stacked(ended.agent, [episode], ended.frame[None])
                player = self.players[self._player_of[k][ended.agent]]
                player.end([episode], frames, np.array([ended.terminated]), np.array([ended.truncated]))
            self._team_returns[k][ended.agent] = episode.episode_return + episode.reward
        if not outcome.done:
            return outcome
        for agent, episode in episodes.items():  # gone without an ending (an environment that drops agents)
            self.players[self._player_of[k][agent]].abandon(episode)
            self._team_returns[k][agent] = episode.episode_return + episode.reward
        episodes.clear()
        self._episode_over(k)
        outcome = self.envs[k].reset()
        if outcome.done:
            raise ConfigError(f"env.id {self.config.env.id!r} has no agent to act right after a reset")
        return self._outcome(k, self._started(k, outcome))

    def _episode_over(self, k: int) -> None:
        """The team's record, and in self-play the match's outcome for the learning seat."""
        returns = self._team_returns[k]
        if self.self_play is not None:  # the learning seat's return, evaluated against the random player
            seat, opponent = self._seating[k]
            if seat in returns and self._team_length[k]:
                self._teams.append([returns[seat], self._team_length[k], opponent == RANDOM])
                others = [r for agent, r in returns.items() if agent != seat]
                self._matches.append([opponent, match_outcome(returns[seat], others)])
        elif returns and self._team_length[k]:
            self._teams.append([float(np.mean(list(returns.values()))), self._team_length[k], self.eval_envs[k]])
        self._team_returns[k], self._team_length[k] = {}, 0

    def close(self) -> None:
        for env in self.envs:
            env.close()
