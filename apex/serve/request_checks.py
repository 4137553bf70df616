"""What a request to `apex serve` may carry: ``RequestError``, the error every refusal raises;
the run's spaces as clients see them (``describe_spaces``, ``GET /v1/spaces``); and
``SpaceChecks``, the checks of a request's observations, actions, rewards and flags against
those spaces. Nothing here changes an episode: ``ExternalEpisodes`` checks a request whole
before it moves any.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from apex.envs.make import EnvSpec
from apex.errors import ApexError
from apex.wire.schema import MAX_ABS_CONTINUOUS_ACTION

# A request's actions: an array (one an episode), or a map by agent an episode (multi-agent)
Actions = np.ndarray | list[dict[str, Any]]


def actions_json(actions: Actions) -> list[Any]:
    """Actions as a reply carries them: an int or a list each; a map of them by agent."""
    if isinstance(actions, np.ndarray):
        listed: list[Any] = actions.tolist()
        return listed
    return [{agent: np.asarray(action).tolist() for agent, action in by_agent.items()} for by_agent in actions]


class RequestError(ApexError):
    """A client's request refused: ``status`` is its HTTP status (400 malformed, 404 unknown
    episode, 409 out of order, 429 too many episodes), ``reason`` a short key that metrics count."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


def known_fields(data: dict[str, Any], allowed: tuple[str, ...], where: str) -> None:
    """Refuses a field ``where`` (a request) does not take: a typo ("rewrad") would otherwise
    be dropped without a word."""
    unknown = [str(key)[:32] for key in data if key not in allowed]
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise RequestError(400, "fields", f"{where} takes {', '.join(allowed) or 'no fields'}; unknown: {shown}")


def describe_spaces(spec: EnvSpec, low: np.ndarray, high: np.ndarray) -> dict[str, Any]:
    """``GET /v1/spaces``: one observation (a frame) and one action as clients send and get them."""

    def bounds(values: np.ndarray) -> list[float | None] | float | None:
        values = np.asarray(values, np.float64)
        if not np.isfinite(values).any():
            return None
        if np.all(values == values.flat[0]):
            return float(values.flat[0])
        return [None if not math.isfinite(v) else float(v) for v in values.ravel()]

    action: dict[str, Any]
    if spec.continuous:
        action = {
            "type": "Box",
            "shape": [spec.num_actions],
            "low": bounds(np.asarray(spec.action_low)),
            "high": bounds(np.asarray(spec.action_high)),
        }
    elif spec.action_nvec is None:
        action = {"type": "Discrete", "n": spec.num_actions}
    else:
        action = {"type": "MultiDiscrete", "nvec": list(spec.action_nvec)}
    return {
        "observation": {
            "shape": list(spec.frame_shape),
            "dtype": np.dtype(spec.frame_dtype).name,
            "low": bounds(low),
            "high": bounds(high),
        },
        "action": action,
        "frame_stack": spec.stack,
    }


class SpaceChecks:
    """A request's values checked against the run's spaces, each as a NumPy array."""

    def __init__(
        self, spec: EnvSpec, low: np.ndarray, high: np.ndarray, max_abs_obs: float | None, max_abs_reward: float
    ) -> None:
        self.spec = spec
        self.max_abs_reward = max_abs_reward
        self._low = np.broadcast_to(np.asarray(low, np.float64), spec.frame_shape)
        self._high = np.broadcast_to(np.asarray(high, np.float64), spec.frame_shape)
        self._bounded = bool(np.isfinite(self._low).any() or np.isfinite(self._high).any())
        # What the learner's batch schema holds frames to (transport.max_abs_obs): a value the
        # learner would refuse is refused here, before it is queued with honest episodes' steps.
        self._max_abs = np.broadcast_to(spec.obs_bound(max_abs_obs), spec.frame_shape)

    def frames(self, observations: Any, count: int) -> np.ndarray:
        """``count`` observations as frames [count, *frame_shape], checked against the space:
        shape, finite numbers, bounds (transport.max_abs_obs too), and whole numbers in range
        for integer frames."""
        shape = (count, *self.spec.frame_shape)
        try:
            values = np.asarray(observations)
        except (ValueError, TypeError) as e:
            raise RequestError(400, "observation", f"observations are not an array of numbers: {e}") from None
        if values.shape == tuple(self.spec.frame_shape) and count == 1:
            values = values[None]
        if values.shape != shape:
            raise RequestError(
                400,
                "observation",
                f"observation shape {list(values.shape[1:]) if values.ndim else []} "
                f"does not match the run's {list(self.spec.frame_shape)} (GET /v1/spaces)",
            )
        if values.dtype.kind not in "biuf":
            raise RequestError(400, "observation", f"observations must be numbers, got {values.dtype}")
        wide = values.astype(np.float64, copy=False)
        if not np.isfinite(wide).all():
            raise RequestError(400, "observation", "observations must be finite numbers (no NaN or infinity)")
        target = np.dtype(self.spec.frame_dtype)
        if target.kind == "f" and (np.abs(wide) > np.finfo(target).max).any():
            # checked before the cast: a float64 1e300 is inf as float32, and the learner
            # would refuse the whole batch, honest episodes' steps with it
            raise RequestError(
                400,
                "observation",
                f"observations of this run are {target.name}: at most {np.finfo(target).max:g} in size",
            )
        if target.kind in "iu" and not (wide == np.round(wide)).all():
            raise RequestError(400, "observation", f"observations of this run are {target.name}: whole numbers")
        if self._bounded and ((wide < self._low).any() or (wide > self._high).any()):
            bad = np.argwhere((wide < self._low) | (wide > self._high))[0]
            raise RequestError(
                400,
                "observation",
                f"observation value {wide[tuple(bad)]:g} at {list(bad[1:])} is outside the "
                f"observation space [{self._low[tuple(bad[1:])]:g}, {self._high[tuple(bad[1:])]:g}]",
            )
        if (over := np.abs(wide) > self._max_abs).any():
            bad = np.argwhere(over)[0]
            raise RequestError(
                400,
                "observation",
                f"observation value {wide[tuple(bad)]:g} at {list(bad[1:])} is over "
                f"{self._max_abs[tuple(bad[1:])]:g} in size (transport.max_abs_obs: the space's own "
                "bounds, 1e6 where it has none)",
            )
        frames: np.ndarray = wide.astype(target, copy=False) if values.dtype != target else values
        return frames

    def actions(self, actions: Any, count: int) -> np.ndarray:
        spec = self.spec
        if spec.continuous:
            return self._continuous_actions(actions, count)
        try:
            values = np.asarray(actions)
        except (ValueError, TypeError) as e:
            raise RequestError(400, "action", f"actions are not integers: {e}") from None
        shape = (count, *spec.action_shape)
        if values.shape == tuple(spec.action_shape) and count == 1:
            values = values[None]
        if values.shape != shape or (
            values.dtype.kind not in "iu"
            and not (values.dtype.kind == "f" and np.isfinite(values).all() and (values == np.round(values)).all())
        ):
            raise RequestError(
                400,
                "action",
                f"actions must be integers of shape {list(shape[1:])} each "
                f"(GET /v1/spaces), got {values.dtype} {list(values.shape)}",
            )
        values = values.astype(np.int64)
        limit = np.asarray(spec.action_nvec if spec.action_nvec is not None else spec.num_actions)
        if (values < 0).any() or (values >= limit).any():
            raise RequestError(
                400, "action", f"actions must be in 0..{limit - 1} (GET /v1/spaces), got {values.tolist()}"[:200]
            )
        return values

    def _continuous_actions(self, actions: Any, count: int) -> np.ndarray:
        """A Box's actions: finite numbers of its shape within its bounds (and at most
        ``MAX_ABS_CONTINUOUS_ACTION`` in size where it sets none)."""
        try:
            values = np.asarray(actions, np.float64)
        except (ValueError, TypeError, OverflowError):
            raise RequestError(400, "action", f"actions must be numbers, got {str(actions)[:80]!r}") from None
        shape = (count, self.spec.num_actions)
        if values.shape == shape[1:] and count == 1:
            values = values[None]
        if values.shape != shape:
            wanted, got = list(shape[1:]), list(values.shape)
            raise RequestError(400, "action", f"actions must be {wanted} numbers each (GET /v1/spaces), got {got}")
        if not np.isfinite(values).all() or (np.abs(values) > MAX_ABS_CONTINUOUS_ACTION).any():
            limit = MAX_ABS_CONTINUOUS_ACTION
            raise RequestError(400, "action", f"actions must be finite and at most {limit:g} in size")
        low, high = np.asarray(self.spec.action_low, np.float64), np.asarray(self.spec.action_high, np.float64)
        if (outside := (values < low) | (values > high)).any():
            row, k = np.argwhere(outside)[0]
            raise RequestError(
                400,
                "action",
                f"action value {values[row, k]:g} at [{k}] is outside the action space "
                f"[{low[k]:g}, {high[k]:g}] (GET /v1/spaces)",
            )
        return values.astype(np.float32)

    def rewards(self, rewards: Any, count: int) -> np.ndarray:
        try:
            values = np.asarray(rewards, np.float64).reshape(-1)
        except (ValueError, TypeError, OverflowError):  # OverflowError: JSON's 1e400 written as an integer
            raise RequestError(400, "reward", f"rewards must be numbers, got {str(rewards)[:80]!r}") from None
        if values.shape != (count,):
            raise RequestError(400, "reward", f"{values.size} rewards for {count} episodes")
        if not np.isfinite(values).all() or (np.abs(values) > self.max_abs_reward).any():
            raise RequestError(
                400,
                "reward",
                f"rewards must be finite numbers of at most transport.max_abs_reward ({self.max_abs_reward:g}) in size",
            )
        return values

    @staticmethod
    def flags(flags: Any, count: int, name: str) -> np.ndarray:
        values = [flags] * count if isinstance(flags, bool) else flags
        if not isinstance(values, list | tuple) or len(values) != count or not all(isinstance(v, bool) for v in values):
            raise RequestError(400, "fields", f"{name} must be true or false (or a list of {count} of them)")
        return np.asarray(values, bool)
