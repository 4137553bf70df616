"""The prioritized ring under both replays (Schaul et al. 2016, over the native sum tree).

Storage is one preallocated NumPy array per named field, used as a ring buffer: once full,
each new item evicts the oldest (FIFO, as in Ape-X). Items are addressed by their
*insertion index*, a counter that only grows: item ``i`` lives in slot ``i % capacity``
until item ``i + capacity`` overwrites it. Sampling returns insertion indices, so a
priority update that arrives after its item was overwritten is recognised and ignored
instead of landing on the newcomer in that slot (the bug RLlib had, ray#6534).

Priorities follow the paper: a raw priority ``p`` (for DQN, ``|TD error|``) is stored as
``(p + eps) ** alpha``; item ``i`` is sampled with ``P(i) = p_i / sum_k p_k`` and weighted
by ``w_i = (N * P(i)) ** -beta / max_j w_j``, where the max runs over the whole buffer, so
``w_i = (p_i / min_k p_k) ** -beta``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from apex.native import SumTree


def committed(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed array whose every page is touched now, not on first write.

    np.zeros maps lazily; on this machine's VM the first write to each fresh page then cost
    the ingest thread of an Atari replay (822 MB of frames) more than a third of its
    throughput while the ring filled. Touching it once at start-up moves that cost out of the
    run and keeps the resident size flat from the start.
    """
    array = np.empty(shape, dtype)
    array.fill(0)
    return array


@dataclass(frozen=True)
class Field:
    """Shape (per item, without the batch dimension) and dtype of one stored field."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @classmethod
    def of(cls, value: Field | tuple[Sequence[int], DTypeLike]) -> Field:
        """Accepts a Field or a ``(shape, dtype)`` pair."""
        if isinstance(value, Field):
            return value
        shape, dtype = value
        return cls(tuple(int(d) for d in shape), np.dtype(dtype))


Fields = Mapping[
    str, "Field | tuple[Sequence[int], DTypeLike]"
]  # a replay's named fields, each a Field or (shape, dtype)


def importance_weights(priorities: np.ndarray, min_priority: float, beta: float) -> np.ndarray:
    """float32 weights ``(p_i / min_k p_k) ** -beta``: the largest possible weight is 1."""
    return ((priorities / min_priority) ** -beta).astype(np.float32)


class PriorityRing:
    """Items of named fields in a ring, with their priorities in a sum tree.

    Not thread-safe: its owner (``PrioritizedReplay``, ``StackedReplay``) holds one lock
    around every call, and may hold it across several (a sample and its frames).
    ``storage``, ``tree``, ``added`` and ``evicted_until`` are public for the snapshot
    code, which copies and restores them under that lock.
    """

    def __init__(
        self, fields: Fields, capacity: int, *, alpha: float = 0.6, eps: float = 1e-6, seed: int | None = None
    ) -> None:
        if not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"replay capacity must be a positive integer, got {capacity!r}")
        if not alpha >= 0:
            raise ValueError(f"replay alpha must be >= 0, got {alpha!r}")
        if not eps > 0:
            raise ValueError(f"replay eps must be > 0 (it keeps every item sampleable), got {eps!r}")
        if not fields:
            raise ValueError("a replay needs at least one field")
        self.fields = {name: Field.of(field) for name, field in fields.items()}
        self.capacity = int(capacity)
        self.alpha = float(alpha)
        self.eps = float(eps)
        self.storage = {
            name: committed((self.capacity, *field.shape), field.dtype) for name, field in self.fields.items()
        }
        self.tree = SumTree(self.capacity)
        self.rng = np.random.default_rng(seed)
        self.added = 0  # insertion index of the next item
        self.evicted_until = 0  # items below this insertion index were evicted early
        self.stale_priority_updates = 0  # updates ignored because their item was evicted

    def __len__(self) -> int:
        return self.added - self.oldest_live

    @property
    def oldest_live(self) -> int:
        return max(self.added - self.capacity, self.evicted_until)

    @property
    def sampleable(self) -> bool:
        """Whether some item has a priority (all may have been dropped)."""
        return self.tree.total > 0

    @property
    def nbytes(self) -> int:
        """Bytes of storage and sum tree: the whole footprint, fixed at creation."""
        return sum(a.nbytes for a in self.storage.values()) + self.tree.nbytes

    def transform(self, priorities: np.ndarray, checked: bool = False) -> np.ndarray:
        """(p + eps) ** alpha; ``checked``: the caller validated them (finite, >= 0, 1-D)."""
        priorities = np.asarray(priorities, dtype=np.float64)
        if checked:
            return (priorities + self.eps) ** self.alpha
        if priorities.ndim != 1:
            raise ValueError(f"priorities must be a 1-D array, got shape {priorities.shape}")
        if not ((priorities >= 0).all() and (priorities < np.inf).all()):  # NaN fails the first
            bad = priorities[~(np.isfinite(priorities) & (priorities >= 0))][0]
            raise ValueError(f"priorities must be finite and >= 0, got {bad}")
        return (priorities + self.eps) ** self.alpha

    def check_batch(self, batch: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        """The batch's arrays, after checking that they match the fields with ``n`` items."""
        missing = self.fields.keys() - batch.keys()
        extra = batch.keys() - self.fields.keys()
        if missing or extra:
            raise ValueError(
                f"batch fields must match the replay's fields {sorted(self.fields)}: "
                f"missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        if n > self.capacity:
            raise ValueError(
                f"cannot add {n} items to a replay of capacity {self.capacity}: "
                "add smaller batches or raise apex_dqn.replay.capacity"
            )
        arrays = {}
        for name, field in self.fields.items():
            array = np.asarray(batch[name])
            if array.shape != (n, *field.shape):
                raise ValueError(
                    f"field {name!r} must have shape {(n, *field.shape)} (n={n} from priorities), got {array.shape}"
                )
            if not np.can_cast(array.dtype, field.dtype, casting="same_kind"):
                raise ValueError(f"field {name!r} of dtype {array.dtype} cannot be stored as {field.dtype}")
            arrays[name] = array
        return arrays

    def write(self, arrays: Mapping[str, np.ndarray], priorities: np.ndarray) -> np.ndarray:
        """Appends checked arrays with transformed priorities; returns their insertion
        indices (the oldest items are evicted when full)."""
        n = len(priorities)
        start = self.added
        slot = start % self.capacity
        head = min(n, self.capacity - slot)  # items before the ring wraps
        for name, array in arrays.items():
            storage = self.storage[name]
            if head == n:  # the common case: no wrap (an empty slice still costs)
                storage[slot : slot + n] = array
            else:
                storage[slot : slot + head] = array[:head]
                storage[: n - head] = array[head:]
        indices = np.arange(start, start + n, dtype=np.int64)
        self.tree.update(indices - (start - slot) if head == n else indices % self.capacity, priorities)
        self.added = start + n
        return indices

    def draw(self, batch_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """``batch_size`` items by priority (stratified, with replacement): (slots, their
        insertion indices, their priorities, the smallest priority held)."""
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if len(self) == 0:
            raise ValueError("cannot sample from an empty replay: add transitions first")
        slots, priorities = self.tree.sample(int(batch_size), self.rng)
        last = self.added - 1
        indices = slots + self.capacity * ((last - slots) // self.capacity)  # the newest item of each slot
        return slots, indices, priorities, self.tree.min

    def gather(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        # np.take: several times faster than fancy indexing for rows of 2-D+ arrays.
        return {name: np.take(storage, slots, axis=0) for name, storage in self.storage.items()}

    def check_update(self, indices: np.ndarray, priorities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(indices as int64, transformed priorities), after checking their forms."""
        indices = np.asarray(indices)
        if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
            raise ValueError(f"indices must be a 1-D integer array, got shape {indices.shape} of {indices.dtype}")
        indices = indices.astype(np.int64, copy=False)
        priorities = self.transform(priorities)
        if len(indices) != len(priorities):
            raise ValueError(
                f"indices and priorities must have the same length, got {len(indices)} and {len(priorities)}"
            )
        return indices, priorities

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> int:
        """Sets ``check_update``'s priorities; items evicted since they were drawn are
        skipped. Returns how many were applied."""
        if indices.size and (indices.min() < 0 or indices.max() >= self.added):
            raise IndexError(
                f"indices must be insertion indices returned by add/sample, "
                f"in [0, {self.added}); got values in [{indices.min()}, {indices.max()}]"
            )
        live = indices >= self.oldest_live
        applied = int(np.count_nonzero(live))
        self.stale_priority_updates += len(indices) - applied
        if applied == len(indices):
            self.tree.update(indices % self.capacity, priorities)
        else:
            self.tree.update(indices[live] % self.capacity, priorities[live])
        return applied

    def drop(self, indices: np.ndarray) -> int:
        """Never samples these items again (those still live). Returns how many."""
        indices = np.asarray(indices, dtype=np.int64)
        live = indices[(indices >= self.oldest_live) & (indices < self.added)]
        if live.size:
            self.tree.clear(live % self.capacity)
        return int(live.size)

    def evict_until(self, index: int) -> None:
        """Evicts every item with an insertion index below ``index`` now, oldest first."""
        start, stop = self.oldest_live, min(int(index), self.added)
        if stop > start:
            self.tree.clear(np.arange(start, stop, dtype=np.int64) % self.capacity)
            self.evicted_until = stop

    def priorities(self, indices: np.ndarray) -> np.ndarray:
        """Stored (transformed) priorities of live items, by insertion index."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < self.oldest_live or indices.max() >= self.added):
            raise IndexError("indices must refer to items still in the replay")
        return self.tree.get(indices % self.capacity)

    def priority_stats(self) -> dict[str, float]:
        """Mean and min of the stored priorities: how surprising the replay is."""
        n = len(self)
        return {"priority_mean": self.tree.total / n, "priority_min": self.tree.min} if n else {}


class LockedRing:
    """What both replays share: a ``PriorityRing`` behind one lock (``lock``), and the
    calls that only forward to it under that lock."""

    def __init__(self, ring: PriorityRing) -> None:
        self.ring = ring
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.ring)

    @property
    def capacity(self) -> int:
        return self.ring.capacity

    @property
    def total_added(self) -> int:
        """Items added since creation, evicted ones included."""
        return self.ring.added

    @property
    def sampleable(self) -> bool:
        """Whether some item has a priority (all may have been dropped as poison)."""
        return self.ring.sampleable

    @property
    def stale_priority_updates(self) -> int:
        """Priority updates ignored because their item was evicted since it was sampled."""
        return self.ring.stale_priority_updates

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> int:
        """Sets new raw priorities for sampled items; items evicted since are skipped.

        Returns how many priorities were applied.
        """
        indices, priorities = self.ring.check_update(indices, priorities)
        with self.lock:
            return self.ring.update_priorities(indices, priorities)

    def drop(self, indices: np.ndarray) -> int:
        """Never samples these items again (those still live): for transitions found to
        poison training. Returns how many were dropped."""
        with self.lock:
            return self.ring.drop(indices)

    def priorities(self, indices: np.ndarray) -> np.ndarray:
        """Stored (transformed) priorities of live items, by insertion index."""
        with self.lock:
            return self.ring.priorities(indices)

    def priority_stats(self) -> dict[str, float]:
        with self.lock:
            return self.ring.priority_stats()
