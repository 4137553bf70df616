"""The one validation of a received batch: each algorithm declares its batch schema once
(array names, dtypes, shapes in terms of the run's spec, value rules) and the learner checks
every message against it here, before it stores or trains on anything.

Order matters, because a message is cheap to send and may be expensive to accept:

1. names, dtypes and declared shapes, from the layout alone (nothing decompressed yet);
2. the message's sizes (frames, transitions, unrolls) against limits derived from the
   sending actor's session (its number of environments) and the run's spec;
3. only then is anything decompressed, cast to the dtype it is stored in, and checked for
   values: every float finite *after* the cast (a float64 1e300 is inf as float32), actions
   integer and in range, indices within the message's frames, rewards bounded, discounts in
   [0, 1].

``check_episodes`` bounds the episode records a batch reports (how many, how long, their
returns); env steps are never taken from the sender but derived from the batch.

Every refusal is a ``RejectedMessage`` whose ``reason`` is a short key counted in
metrics.jsonl's ``rejected_by_reason``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from apex.errors import RejectedMessage
from apex.protocol import Compressed

# A value rule looks at the cast array and the message's bound sizes; it returns a problem or None.
ValueRule = Callable[[np.ndarray, Mapping[str, int]], "str | None"]


@dataclass(frozen=True)
class ArrayRule:
    """One array of a batch."""

    name: str
    kinds: str
    """NumPy dtype kinds accepted on the wire: ``f`` float, ``iu`` integer."""
    store: np.dtype
    """The dtype it is cast to, checked in and stored as."""
    shape: tuple[int | str, ...]
    """Fixed sizes, or names of sizes bound per message (``frames``, ``transitions``, ...)."""
    values: ValueRule | None = None
    exact: bool = False
    """The wire dtype must be ``store`` itself (data that a cast would change, e.g. pixels)."""

    @property
    def may_stay_compressed(self) -> bool:
        """Whether a consumer may decompress it straight into its storage: no value to check."""
        return self.values is None and self.exact


# -- value rules


def finite(array: np.ndarray, _sizes: Mapping[str, int]) -> str | None:
    # min and max propagate NaN and show infinities, without a temporary the size of the array
    if array.size and not (math.isfinite(array.min()) and math.isfinite(array.max())):
        return "holds NaN or infinity"
    return None


def within(low: float, high: float) -> ValueRule:
    """Every value in [low, high] (NaN never is)."""

    def rule(array: np.ndarray, _sizes: Mapping[str, int]) -> str | None:
        if array.size and not (array.min() >= low and array.max() <= high):
            return f"holds values outside [{low:g}, {high:g}] (min {array.min()}, max {array.max()})"
        return None

    return rule


def below(bound: Callable[[Mapping[str, int]], int]) -> ValueRule:
    """Integers in [0, bound(sizes)): e.g. actions, or stack starts within the message's frames."""

    def rule(array: np.ndarray, sizes: Mapping[str, int]) -> str | None:
        high = bound(sizes)
        if array.size and not (array.min() >= 0 and array.max() < high):
            return f"holds values outside [0, {high}) (min {array.min()}, max {array.max()})"
        return None

    return rule


def frame_rule(frame_shape: tuple[int, ...], frame_dtype: np.dtype) -> ArrayRule:
    """Frames as the run stores them: images exactly as sent (uint8), vectors finite floats."""
    if frame_dtype.kind == "f":
        return ArrayRule("frames", "f", frame_dtype, ("frames", *frame_shape), finite)
    return ArrayRule("frames", frame_dtype.kind, frame_dtype, ("frames", *frame_shape), exact=True)


# -- the schema


class BatchSchema:
    """The arrays of one algorithm's batches; ``validate`` checks a message against them."""

    def __init__(self, rules: tuple[ArrayRule, ...]) -> None:
        self.rules = rules
        self.names = frozenset(rule.name for rule in rules)

    def max_bytes(self, limits: Mapping[str, int]) -> int:
        """Bytes of the largest batch within ``limits``, as stored."""
        total = 0
        for rule in self.rules:
            count = 1
            for d in rule.shape:
                count *= limits[d] if isinstance(d, str) else d
            total += count * rule.store.itemsize
        return total

    def validate(self, arrays: Mapping[str, Any], limits: Mapping[str, int]) -> tuple[dict[str, Any], dict[str, int]]:
        """Checks a (lazily decoded) batch; returns (arrays cast to their stored dtypes,
        the message's sizes). Arrays that may stay compressed are returned as they came.
        Raises RejectedMessage."""
        sizes = self._check_layout(arrays, limits)
        out: dict[str, Any] = {}
        for rule in self.rules:
            array = arrays[rule.name]
            if isinstance(array, Compressed):
                if rule.may_stay_compressed:
                    out[rule.name] = array
                    continue
                array = array.decompress()
            with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is what we look for
                array = array.astype(rule.store, copy=False)
            if rule.values is not None and (problem := rule.values(array, sizes)) is not None:
                reason = "out_of_range" if _all_finite(array) else "nonfinite"
                raise RejectedMessage(reason, f"{rule.name} {problem}")
            out[rule.name] = array
        return out, sizes

    def _check_layout(self, arrays: Mapping[str, Any], limits: Mapping[str, int]) -> dict[str, int]:
        """Names, dtypes, shapes and sizes, from what the layout declares."""
        if arrays.keys() != self.names:
            missing, extra = sorted(self.names - arrays.keys()), sorted(arrays.keys() - self.names)
            raise RejectedMessage("fields", f"batch arrays: missing {missing}, unexpected {extra}")
        sizes: dict[str, int] = {}
        for rule in self.rules:
            array = arrays[rule.name]
            dtype, shape = array.dtype, tuple(array.shape)
            if dtype.kind not in rule.kinds or (rule.exact and dtype != rule.store):
                wanted = rule.store if rule.exact else f"kind {rule.kinds!r}"
                raise RejectedMessage("dtype", f"{rule.name} has dtype {dtype}, expected {wanted}")
            if len(shape) != len(rule.shape):
                raise RejectedMessage("shape", f"{rule.name} has shape {list(shape)}, expected {list(rule.shape)}")
            for got, want in zip(shape, rule.shape):
                if isinstance(want, str):
                    want = sizes.setdefault(want, got)
                if got != want:
                    raise RejectedMessage("shape", f"{rule.name} has shape {list(shape)}, expected "
                                          f"{[sizes.get(d, d) if isinstance(d, str) else d for d in rule.shape]}")
        for name, size in sizes.items():
            if size < 1:
                raise RejectedMessage("shape", f"a batch holds at least one of {name}, got 0")
            if size > limits[name]:
                raise RejectedMessage("too_large", f"{size} {name} in one batch, over this actor's limit of {limits[name]}")
        return sizes


def _all_finite(array: np.ndarray) -> bool:
    return array.dtype.kind != "f" or finite(array, {}) is None


def check_episodes(info: Any, *, max_episodes: int, step_limit: int, max_abs_reward: float,
                   step_budget: int) -> tuple[list[tuple[float, int, bool]], int]:
    """The episode records of a batch's ``info`` ({"episodes": [[return, length, is_eval],
    ...]}): at most ``max_episodes`` (one per transition of the batch), each 1..``step_limit``
    steps long with a finite return of at most ``max_abs_reward`` per step, and together
    no longer than ``step_budget`` (the env steps the session has sent, plus the episodes
    its environments had under way when it began). Returns (records, steps they used)."""
    if not isinstance(info, dict) or not info.keys() <= {"episodes"}:
        raise RejectedMessage("info", "batch info must be {\"episodes\": [[return, length, is_eval], ...]}")
    episodes = info.get("episodes", [])
    if not isinstance(episodes, list) or len(episodes) > max_episodes:
        count = len(episodes) if isinstance(episodes, list) else type(episodes).__name__
        raise RejectedMessage("episodes", f"info.episodes must be a list of at most {max_episodes} records, got {count}")
    records, used = [], 0
    for record in episodes:
        if not (isinstance(record, list) and len(record) == 3 and type(record[0]) in (int, float)
                and type(record[1]) is int and type(record[2]) is bool):
            raise RejectedMessage("episodes", "each of info.episodes must be [return, length, is_eval]")
        episode_return, length, is_eval = record
        if not 1 <= length <= step_limit:
            raise RejectedMessage("episodes", f"an episode of {length} steps, outside 1..{step_limit}")
        if not (math.isfinite(episode_return) and abs(episode_return) <= max_abs_reward * length):
            raise RejectedMessage("episodes", f"an episode return of {episode_return} over {length} steps")
        used += length
        records.append((float(episode_return), length, is_eval))
    if used > step_budget:
        raise RejectedMessage("episodes", f"episodes of {used} steps in all, more than this actor has played ({step_budget})")
    return records, used
