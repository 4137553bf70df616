"""The checks of a multi-agent request to `apex serve` (``apex.serve.teams``): each episode's
maps by agent id against the run's agents and each agent's spaces, before anything moves."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import numpy as np

from apex.core.episode import Episode
from apex.envs.policy_map import MultiAgentSpec
from apex.serve.request_checks import RequestError, SpaceChecks
from apex.wire.schema import UNKNOWN_STEP_LIMIT

MAX_AGENT_ID_CHARS = 64
ALL_AGENTS = "*"  # end's flags given as one for every agent


@dataclass
class Turn:
    """One team's part of a request, checked: what changes once the whole request is."""

    team: Episode
    frames: dict[str, np.ndarray]
    rewards: dict[str, float]
    ending: dict[str, tuple[bool, bool]]  # agent -> (terminated, truncated)
    acting: list[str]
    masks: dict[str, np.ndarray]
    chosen: dict[str, np.ndarray]


class TeamChecks:
    """Each agent's ``SpaceChecks`` (its own observation, as the environment gives it), and the
    checks of the maps a request carries."""

    def __init__(self, spec: MultiAgentSpec, max_abs_obs: float | None, max_abs_reward: float) -> None:
        self.max_abs_reward = max_abs_reward
        self.agents = {
            agent: SpaceChecks(view.spec, view.low, view.high, max_abs_obs, max_abs_reward)
            for agent, view in spec.views.items()
        }
        limits = [view.spec.max_episode_steps for view in spec.views.values() if view.spec.max_episode_steps]
        self.step_limit = min(limits) if limits else UNKNOWN_STEP_LIMIT

    def turn(
        self,
        team: Episode,
        playing: dict[str, Episode],
        finished: Collection[str],
        observations: dict[str, Any],
        rewards: dict[str, Any],
        terminated: dict[str, Any],
        truncated: dict[str, Any],
        masks: dict[str, Any],
        actions: dict[str, Any],
    ) -> Turn:
        """``team``'s part of an action request (``playing``: its agents playing now,
        ``finished``: those that ended in it, which neither act nor end again)."""
        if not observations:
            raise RequestError(400, "fields", f"episode {team.id}: observations must name at least one agent")
        for agent in observations:
            if agent in finished:
                raise RequestError(
                    409,
                    "order",
                    f"episode {team.id}: agent {agent!r} has ended in it (terminated or truncated) and cannot act "
                    "or end again; leave it out of this episode's maps",
                )
        frames = {agent: self.frame(agent, obs) for agent, obs in observations.items()}
        for name, flags in (("terminated", terminated), ("truncated", truncated)):
            for agent, flag in flags.items():
                if not isinstance(flag, bool):
                    raise RequestError(400, "fields", f"{name} of agent {agent!r} must be true or false")
                if agent not in observations:
                    raise RequestError(
                        400, "fields", f"agent {agent!r} is {name}: its final observation must be in observations"
                    )
        done = {agent for agent in observations if terminated.get(agent) or truncated.get(agent)}
        # an agent that ends at its first observation has no step to finish
        ending = {a: (bool(terminated.get(a)), bool(truncated.get(a))) for a in done if a in playing}
        acting = [agent for agent in observations if agent not in done]
        for agent in acting:
            episode = playing.get(agent)
            if episode is not None and episode.length + 1 >= self.step_limit:
                raise RequestError(
                    409,
                    "step_limit",
                    f"episode {team.id}: agent {agent!r} has played {episode.length + 1} steps, the run's time "
                    "limit (env.max_episode_steps): mark it truncated",
                )
        checked_masks = {agent: self.mask(agent, mask) for agent, mask in masks.items()}
        if set(checked_masks) - set(acting):
            raise RequestError(400, "fields", "action_masks are for agents that act in this request")
        chosen: dict[str, np.ndarray] = {}
        if actions:
            if set(actions) != set(acting):
                raise RequestError(400, "fields", f"episode {team.id}: actions must name exactly the agents that act")
            chosen = {agent: self.agents[agent].actions(action, 1)[0] for agent, action in actions.items()}
        return Turn(team, frames, self.rewards(team, playing, rewards), ending, acting, checked_masks, chosen)

    def maps(self, values: Any, count: int, name: str) -> list[dict[str, Any]]:
        """``count`` maps from agent id (one of this run's) to a value: one an episode."""
        if isinstance(values, dict) and count == 1:
            values = [values]
        if not isinstance(values, list | tuple) or len(values) != count:
            raise RequestError(400, "fields", f"{name} must be a list of {count} maps from agent id (one an episode)")
        for value in values:
            if not isinstance(value, dict):
                raise RequestError(400, "fields", f"{name}: each episode's must be a map from agent id to its value")
            for agent in value:
                if agent not in self.agents and not (name in ("terminated", "truncated") and agent == ALL_AGENTS):
                    shown = repr(agent)[:MAX_AGENT_ID_CHARS]
                    raise RequestError(
                        400, "agent", f"{name}: no agent {shown} in this run (its agents: {', '.join(self.agents)})"
                    )
        return list(values)

    def optional_maps(self, values: Any, count: int, name: str) -> list[dict[str, Any]]:
        return [{} for _ in range(count)] if values is None else self.maps(values, count, name)

    def flag_maps(self, values: Any, count: int, name: str) -> list[dict[str, Any]]:
        """``end``'s flags: true/false for every agent, one per episode, or a map per episode."""
        if isinstance(values, bool):
            return [{ALL_AGENTS: values} for _ in range(count)]
        if isinstance(values, list | tuple) and len(values) == count and all(isinstance(v, bool) for v in values):
            return [{ALL_AGENTS: v} for v in values]
        maps = self.maps(values, count, name)
        if not all(isinstance(flag, bool) for m in maps for flag in m.values()):
            raise RequestError(400, "fields", f"{name} must be true or false for each agent")
        return maps

    def frame(self, agent: str, observation: Any) -> np.ndarray:
        try:
            frame: np.ndarray = self.agents[agent].frames(observation, 1)[0]
            return frame
        except RequestError as e:
            raise RequestError(e.status, e.reason, f"agent {agent!r}: {e}") from None

    def mask(self, agent: str, mask: Any) -> np.ndarray:
        spec = self.agents[agent].spec
        values = np.asarray(mask) if isinstance(mask, list | tuple) else np.asarray(None)
        if (
            spec.continuous
            or spec.action_nvec is not None
            or values.shape != (spec.num_actions,)
            or values.dtype.kind not in "biu"
            or not np.isin(values, (0, 1)).all()
            or not values.any()
        ):
            raise RequestError(
                400,
                "action_mask",
                f"agent {agent!r}: an action mask is {spec.num_actions} values of 0 or 1, at least one 1, "
                "for an agent of Discrete actions",
            )
        legal: np.ndarray = values.astype(bool)
        return legal

    def rewards(self, team: Episode, playing: dict[str, Episode], rewards: dict[str, Any]) -> dict[str, float]:
        checked = {}
        for agent, reward in rewards.items():
            value = float(self.agents[agent].rewards(reward, 1)[0])
            episode = playing.get(agent)
            if episode is None and value != 0:
                raise RequestError(
                    409, "order", f"episode {team.id}: a reward for agent {agent!r}, which has no action out"
                )
            if episode is not None and abs(episode.reward + value) > self.max_abs_reward:
                raise RequestError(
                    400,
                    "reward",
                    f"episode {team.id}: agent {agent!r}'s reward this step exceeds transport.max_abs_reward "
                    f"({self.max_abs_reward:g})",
                )
            checked[agent] = value
        return checked
