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

import functools
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from apex.core import EpisodeRecord
from apex.errors import RejectedMessage
from apex.wire.compression import Compressed


@dataclass(frozen=True)
class Range:
    """The values an array may hold: ``low <= v <= high`` (NaN never is), where ``high`` may
    be relative to one of the message's sizes (``high_size``): ``sizes[high_size] + high``,
    e.g. the last stack start within its frames; or bounds per index of the array's
    flattened trailing values (tuples: the components of a MultiDiscrete action, the values
    of an observation)."""

    low: float | tuple[float, ...]
    high: float | tuple[float, ...]
    high_size: str | None = None

    @functools.cached_property
    def per_component(self) -> tuple[np.ndarray, np.ndarray, bool]:
        """(low, high) as arrays, one entry per component (tuple bounds only), and whether
        low == -high: made once, not per batch."""
        high = np.asarray(self.high, np.float64)
        low = np.broadcast_to(np.asarray(self.low, np.float64), high.shape).copy()
        return low, high, bool((low == -high).all())

    def bounds(self, sizes: Mapping[str, int]) -> tuple[float | tuple[float, ...], float | tuple[float, ...]]:
        if self.high_size is None or isinstance(self.high, tuple):  # a size-relative bound is one number
            return self.low, self.high
        return self.low, sizes[self.high_size] + self.high


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
    values: Range | None = None
    exact: bool = False
    """The wire dtype must be ``store`` itself (data that a cast would change, e.g. pixels)."""
    some_nonzero: bool = False
    """Each row (along the last axis) holds a nonzero value: an action mask allows some action."""

    @property
    def may_stay_compressed(self) -> bool:
        """Whether a consumer may decompress it straight into its storage: no value to check."""
        return self.values is None and self.exact


# The fast finiteness test overflows on purpose for huge values; it is not a problem to report.
warnings.filterwarnings("ignore", "overflow encountered in dot", RuntimeWarning, __name__)

LAYOUT_CACHE_SIZE = 256

# -- value rules (for the stored dtype)

FLOAT32_MAX = float(np.finfo(np.float32).max)
FINITE = Range(-FLOAT32_MAX, FLOAT32_MAX)  # for float32: finite, NaN and infinities refused


def _surely_finite(array: np.ndarray) -> bool:
    """A fast sufficient test: the sum of squares is finite only if every value is (it can
    also overflow for finite values beyond ~1e19, which then take the exact min/max test).
    One BLAS dot instead of two reductions: 0.6 against 3 us for a CartPole batch's frames."""
    flat = array.reshape(-1)
    return math.isfinite(flat.dot(flat))


def below(bound: int | str, offset: int = 0) -> Range:
    """Integers in [0, bound + offset), where ``bound`` is a number or one of the message's
    sizes: actions, or stack starts within the message's frames."""
    if isinstance(bound, str):
        return Range(0, offset - 1, bound)
    return Range(0, bound + offset - 1)


def below_each(nvec: tuple[int, ...]) -> Range:
    """Integers in [0, nvec[i]) for component i (the last axis): MultiDiscrete actions."""
    return Range(0, tuple(float(n - 1) for n in nvec))


DEFAULT_MAX_ABS_OBS = 1e6  # observation values where the space sets no finite bound
# A continuous action's largest magnitude (IMPALA's Gaussian sample: beyond, its log-density
# could overflow float32; apex serve holds a client's own actions to it too).
MAX_ABS_CONTINUOUS_ACTION = 1e6


def observation_bound(space_bound: tuple[float, ...], max_abs_obs: float | None) -> np.ndarray:
    """The largest magnitude each observation value may have (one per value of a vector
    frame, or one for all of an image's: ``space_bound``'s length, where () is one): the
    observation space's own bound where it is finite, DEFAULT_MAX_ABS_OBS where it is not;
    ``max_abs_obs`` (transport.max_abs_obs) for every value where it is set. Finite floats
    alone are no defence: 1e30 in CartPole's unbounded velocities is finite and makes most
    updates non-finite."""
    if max_abs_obs is not None:
        return np.full(max(len(space_bound), 1), max_abs_obs)
    bound = np.asarray(space_bound or (np.inf,), np.float64)
    return np.where(np.isfinite(bound), bound, DEFAULT_MAX_ABS_OBS)


def frame_rule(frame_shape: tuple[int, ...], frame_dtype: np.dtype, bound: np.ndarray | None = None) -> ArrayRule:
    """Frames as the run stores them: images exactly as sent (uint8), float frames finite
    and, with ``bound`` (``observation_bound``), at most that in magnitude."""
    if frame_dtype.kind == "f":
        values = FINITE if bound is None else Range(tuple(-bound), tuple(bound))
        return ArrayRule("frames", "f", frame_dtype, ("frames", *frame_shape), values)
    return ArrayRule("frames", frame_dtype.kind, frame_dtype, ("frames", *frame_shape), exact=True)


def mask_rule(name: str, shape: tuple[int | str, ...]) -> ArrayRule:
    """An action mask: 0 or 1 a value, at least one 1 a row."""
    return ArrayRule(name, "iub", np.dtype(np.uint8), shape, Range(0, 1), some_nonzero=True)


# -- the schema


class BatchSchema:
    """The arrays of one algorithm's batches; ``validate`` checks a message against them."""

    def __init__(self, rules: tuple[ArrayRule, ...]) -> None:
        self.rules = rules
        self.names = frozenset(rule.name for rule in rules)
        self._by_name = {rule.name: rule for rule in rules}
        # What _check_layout found for a layout blob: its sizes, or its rejection. Actors send
        # the same few layouts again and again; checking one costs a sixth of a CartPole
        # batch's validation. Bounded like the codec's own cache of parsed layouts.
        self._layouts: dict[bytes, dict[str, int] | tuple[str, str]] = {}  # sizes, or (reason, message)

    def max_bytes(self, limits: Mapping[str, int]) -> int:
        """Bytes of the largest batch within ``limits``, as stored."""
        total = 0
        for rule in self.rules:
            count = 1
            for d in rule.shape:
                count *= limits[d] if isinstance(d, str) else d
            total += count * rule.store.itemsize
        return total

    def validate(
        self, arrays: Mapping[str, Any], limits: Mapping[str, int], layout: bytes = b""
    ) -> tuple[dict[str, Any], dict[str, int]]:
        """Checks a (lazily decoded) batch; returns (arrays cast to their stored dtypes,
        the message's sizes). Arrays that may stay compressed are returned as they came.
        ``layout``: the message's layout blob (``Message.layout``), whose check is then
        remembered. Raises RejectedMessage."""
        sizes = self._layouts.get(layout) if layout else None
        if sizes is None:
            try:
                sizes = self._check_layout(arrays)
            except RejectedMessage as e:
                sizes = (e.reason, str(e))  # not the exception: its traceback holds the arrays
            if layout:
                if len(self._layouts) >= LAYOUT_CACHE_SIZE:
                    self._layouts.clear()
                self._layouts[layout] = sizes
        if isinstance(sizes, tuple):
            raise RejectedMessage(*sizes)
        for name, size in sizes.items():
            if size > limits[name]:
                raise RejectedMessage(
                    "too_large", f"{size} {name} in one batch, over this actor's limit of {limits[name]}"
                )
        out: dict[str, Any] = {}
        for rule in self.rules:
            array = arrays[rule.name]
            if isinstance(array, Compressed):
                if rule.may_stay_compressed:
                    out[rule.name] = array
                    continue
                array = array.decompress()
            if array.dtype.kind == "f":  # cast, then check: a float64 1e300 is inf as float32
                if array.dtype != rule.store:
                    with np.errstate(over="ignore", invalid="ignore"):
                        array = array.astype(rule.store)
                if not (rule.values is FINITE and _surely_finite(array)):
                    _check_range(rule, array, sizes)
            else:  # check, then cast: a narrowing cast could wrap a value into range
                _check_range(rule, array, sizes)
                if array.dtype != rule.store:
                    array = array.astype(rule.store)
                if rule.some_nonzero and not array.reshape(-1, array.shape[-1]).any(axis=1).all():
                    raise RejectedMessage("empty_mask", f"{rule.name} has a row that allows no action")
            out[rule.name] = array
        return out, sizes

    def check_values(self, name: str, array: np.ndarray) -> None:
        """``array`` (stored values, e.g. a saved replay's) against array ``name``'s value rule,
        where it has one that does not depend on a message's sizes; RejectedMessage."""
        rule = self._by_name.get(name)
        if rule is not None and rule.values is not None and rule.values.high_size is None and array.size:
            _check_range(rule, array, {})

    def _check_layout(self, arrays: Mapping[str, Any]) -> dict[str, int]:
        """Names, dtypes and shapes from what the layout declares; returns the sizes."""
        if arrays.keys() != self.names:
            missing, extra = sorted(self.names - arrays.keys()), sorted(arrays.keys() - self.names)
            raise RejectedMessage("fields", f"batch arrays: missing {missing}, unexpected {extra}")
        sizes: dict[str, int] = {}
        for rule in self.rules:
            array = arrays[rule.name]
            dtype, shape = array.dtype, array.shape
            if dtype.kind not in rule.kinds or (rule.exact and dtype != rule.store):
                wanted = rule.store if rule.exact else f"kind {rule.kinds!r}"
                raise RejectedMessage("dtype", f"{rule.name} has dtype {dtype}, expected {wanted}")
            if len(shape) != len(rule.shape):
                raise RejectedMessage("shape", f"{rule.name} has shape {list(shape)}, expected {list(rule.shape)}")
            for got, want in zip(shape, rule.shape):
                if want.__class__ is str:
                    want = sizes.setdefault(want, got)
                if got != want:
                    raise RejectedMessage(
                        "shape",
                        f"{rule.name} has shape {list(shape)}, expected "
                        f"{[sizes.get(d, d) if isinstance(d, str) else d for d in rule.shape]}",
                    )
        for name, size in sizes.items():
            if size < 1:
                raise RejectedMessage("shape", f"a batch holds at least one of {name}, got 0")
        return sizes


def _check_range(rule: ArrayRule, array: np.ndarray, sizes: Mapping[str, int]) -> None:
    if rule.values is None:
        return
    low, high = rule.values.bounds(sizes)
    if isinstance(high, tuple):  # per component, or per value of a frame: each one's own bound
        rows = array.reshape(-1, len(high))
        lows, highs, symmetric = rule.values.per_component
        # |v| <= bound, for an observation's symmetric bounds: 5 us for a CartPole batch's frames,
        # where NumPy's reductions along the rows of a narrow array take 30. NaN is refused too.
        if symmetric and (np.abs(rows) <= highs).all():
            return
        # written to refuse NaN too: NaN >= x and NaN <= x are both false
        bad = ~(rows.min(axis=0) >= lows) | ~(rows.max(axis=0) <= highs)
        if bad.any():
            finite = array.dtype.kind != "f" or bool(np.isfinite(rows).all())
            i = int(np.argmax(bad if finite else ~np.isfinite(rows).all(axis=0)))
            raise RejectedMessage(
                "out_of_range" if finite else "nonfinite",
                f"{rule.name} component {i} holds {'values outside' if finite else 'NaN or infinity, not in'} "
                f"[{lows[i]:g}, {high[i]:g}] (min {rows[:, i].min()}, max {rows[:, i].max()})",
            )
        return
    # min and max: NaN fails both comparisons, infinities are out of every range
    if not (array.min() >= low and array.max() <= high):
        finite = array.dtype.kind != "f" or bool(np.isfinite(array).all())
        raise RejectedMessage(
            "out_of_range" if finite else "nonfinite",
            f"{rule.name} holds {'values outside' if finite else 'NaN or infinity, not in'} "
            f"[{low:g}, {high:g}] (min {array.min()}, max {array.max()})",
        )


UNKNOWN_STEP_LIMIT = 100_000  # episode length bound for environments without a time limit


def possible_return(episode_return: float, steps: int, max_abs_reward: float) -> bool:
    """Whether an episode of ``steps`` steps could have returned ``episode_return``: at most
    ``max_abs_reward`` (finite) a step, so not NaN nor infinite; an int of any size compares."""
    return abs(episode_return) <= max_abs_reward * steps


def check_episodes(
    info: Any, *, max_episodes: int, step_limit: int, max_abs_reward: float, step_budget: int
) -> tuple[list[tuple[float, int, bool]], int]:
    """The episode records of a batch's ``info`` ({"episodes": [[return, length, is_eval],
    ...]}): at most ``max_episodes`` (one per transition of the batch), each 1..``step_limit``
    steps long with a finite return of at most ``max_abs_reward`` per step, and together
    no longer than ``step_budget`` (the env steps the session has sent, plus the episodes
    its environments had under way when it began). Returns (records, steps they used)."""
    if not isinstance(info, dict) or not info.keys() <= {"episodes"}:
        raise RejectedMessage("info", 'batch info must be {"episodes": [[return, length, is_eval], ...]}')
    episodes = info.get("episodes", [])
    if not isinstance(episodes, list) or len(episodes) > max_episodes:
        count = len(episodes) if isinstance(episodes, list) else type(episodes).__name__
        raise RejectedMessage(
            "episodes", f"info.episodes must be a list of at most {max_episodes} records, got {count}"
        )
    records, used = [], 0
    for record in episodes:
        if not (
            isinstance(record, list)
            and len(record) == 3
            and type(record[0]) in (int, float)
            and type(record[1]) is int
            and type(record[2]) is bool
        ):
            raise RejectedMessage("episodes", "each of info.episodes must be [return, length, is_eval]")
        episode_return, length, is_eval = record
        if not 1 <= length <= step_limit:
            raise RejectedMessage("episodes", f"an episode of {length} steps, outside 1..{step_limit}")
        if not possible_return(episode_return, length, max_abs_reward):
            raise RejectedMessage("episodes", f"an episode return of {episode_return} over {length} steps")
        used += length
        records.append((float(episode_return), length, is_eval))
    if used > step_budget:
        raise RejectedMessage(
            "episodes", f"episodes of {used} steps in all, more than this actor has played ({step_budget})"
        )
    return records, used


class FinishedEpisode(Protocol):
    """An episode at its final step, as an actor core or apex serve holds it."""

    episode_return: float  # before the final step's reward
    reward: float  # the final step's
    length: int  # steps before the final one


def episode_record(episode: FinishedEpisode, is_eval: bool) -> EpisodeRecord:
    """[return, length, is_eval] of an episode whose final step's reward is ``episode.reward``,
    as actors report finished episodes to the learner."""
    return [float(episode.episode_return + episode.reward), episode.length + 1, bool(is_eval)]
