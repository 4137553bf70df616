"""What both clients send and read: arrays, actions, rewards and done flags as the wire takes
them, one an episode or, for a multi-agent run, a map by agent id an episode."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PolicyServerError"]


class PolicyServerError(Exception):
    """A request `apex serve` refused: ``status`` is its HTTP-like code."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status


def wire_array(values: Any) -> dict[str, Any]:
    array = np.ascontiguousarray(values)
    if array.dtype.kind == "f" and array.dtype != np.float32:
        array = array.astype(np.float64)
    return {
        "dtype": array.dtype.name,
        "shape": list(array.shape),
        "data": array.astype(array.dtype.newbyteorder("<")).tobytes(),
    }


def by_agent(values: Any) -> bool:
    """Whether ``values`` are a multi-agent run's: a map by agent id an episode."""
    return isinstance(values, list | tuple) and bool(values) and isinstance(values[0], dict)


def reply_actions(values: Any) -> Any:
    """A reply's actions: indices as int64, a Box's values as float32 (a map of them by agent
    an episode, for a multi-agent run)."""
    if by_agent(values):
        return [{agent: reply_actions(action) for agent, action in team.items()} for team in values]
    actions = np.asarray(values)
    return actions.astype(np.float32) if actions.dtype.kind == "f" else actions.astype(np.int64)


def wire_observations(observations: Any, packed: bool = False) -> Any:
    """Observations as sent: all episodes' as one array (``packed``: msgpack's raw bytes), or
    a map by agent an episode."""
    if by_agent(observations):
        return [{agent: np.asarray(obs).tolist() for agent, obs in team.items()} for team in observations]
    return wire_array(observations) if packed else np.asarray(observations).tolist()


def wire_rewards(rewards: Any) -> dict[str, Any]:
    if rewards is None:
        return {}
    if by_agent(rewards):
        return {"rewards": [{agent: float(r) for agent, r in team.items()} for team in rewards]}
    return {"rewards": np.asarray(rewards, np.float64).tolist()}


def wire_flags(flags: Any) -> list[Any]:
    """Done flags: one an episode, or a map by agent an episode."""
    if by_agent(flags):
        return [{agent: bool(flag) for agent, flag in team.items()} for team in flags]
    return [bool(flag) for flag in flags]


def wire_per_agent(terminated: Any = None, truncated: Any = None, action_masks: Any = None) -> dict[str, Any]:
    """An action request's maps by agent (a multi-agent run's): agents that finish at this
    observation, and the legal actions of those that act."""
    fields = {"terminated": terminated, "truncated": truncated}
    out: dict[str, Any] = {name: wire_flags(value) for name, value in fields.items() if value is not None}
    if action_masks is not None:
        out["action_masks"] = [
            {agent: np.asarray(m).astype(int).tolist() for agent, m in t.items()} for t in action_masks
        ]
    return out


def of_one(terminated: Any, truncated: Any, action_mask: Any) -> dict[str, list[Any]]:
    """One episode's maps by agent as the batched calls take them (lists of one)."""
    given = {"terminated": terminated, "truncated": truncated, "action_masks": action_mask}
    return {name: [value] for name, value in given.items() if value is not None}


def one_action(value: Any) -> Any:
    """A single episode's action from a reply: an int or a list (a map of them by agent)."""
    if isinstance(value, dict):
        return {agent: one_action(action) for agent, action in value.items()}
    return value.tolist() if np.ndim(value) else int(value)


def wire_actions(actions: Any) -> list[Any]:
    """Client-chosen actions as sent: indices as integers, a Box's values as floats."""
    values = np.asarray(actions)
    wire: list[Any] = (values.astype(np.float64) if values.dtype.kind == "f" else values.astype(np.int64)).tolist()
    return wire
