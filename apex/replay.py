"""Prioritized experience replay (Schaul et al. 2016) over the native sum tree.

Storage is one preallocated NumPy array per named field, used as a ring buffer: once full,
each new item evicts the oldest (FIFO, as in Ape-X). Items are addressed by their
*insertion index*, a counter that only grows: item ``i`` lives in slot ``i % capacity``
until item ``i + capacity`` overwrites it. ``sample`` returns insertion indices, so a
priority update that arrives after its item was overwritten is recognised and ignored
instead of landing on the newcomer in that slot (the bug RLlib had, ray#6534).

Priorities follow the paper: a raw priority ``p`` (for DQN, ``|TD error|``) is stored as
``(p + eps) ** alpha``; item ``i`` is sampled with ``P(i) = p_i / sum_k p_k`` and weighted
by ``w_i = (N * P(i)) ** -beta / max_j w_j``, where the max runs over the whole buffer, so
``w_i = (p_i / min_k p_k) ** -beta``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from apex.native import SumTree
from apex.protocol import Compressed


def _committed(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
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
    def of(cls, value: Field | tuple) -> Field:
        """Accepts a Field or a ``(shape, dtype)`` pair."""
        if isinstance(value, Field):
            return value
        shape, dtype = value
        return cls(tuple(int(d) for d in shape), np.dtype(dtype))


Spec = Mapping[str, "Field | tuple"]


class PrioritizedReplay:
    """A bounded, prioritized FIFO of transitions described by a spec of named fields.

    Thread-safe: the learner's ingest thread may ``add`` while its train loop samples.
    """

    def __init__(
        self,
        spec: Spec,
        capacity: int,
        *,
        alpha: float = 0.6,
        eps: float = 1e-6,
        seed: int | None = None,
    ) -> None:
        if not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise ValueError(f"replay capacity must be a positive integer, got {capacity!r}")
        if not alpha >= 0:
            raise ValueError(f"replay alpha must be >= 0, got {alpha!r}")
        if not eps > 0:
            raise ValueError(f"replay eps must be > 0 (it keeps every item sampleable), got {eps!r}")
        if not spec:
            raise ValueError("replay spec must name at least one field")
        self.spec = {name: Field.of(field) for name, field in spec.items()}
        self.capacity = int(capacity)
        self.alpha = float(alpha)
        self.eps = float(eps)
        self._storage = {name: _committed((self.capacity, *field.shape), field.dtype) for name, field in self.spec.items()}
        self._tree = SumTree(self.capacity)
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._added = 0  # insertion index of the next item
        self._evicted_until = 0  # items below this insertion index were evicted early
        self.stale_priority_updates = 0  # updates ignored because their item was evicted

    def __len__(self) -> int:
        return self._added - self._oldest_live

    @property
    def _oldest_live(self) -> int:
        return max(self._added - self.capacity, self._evicted_until)

    @property
    def total_added(self) -> int:
        """Items added since creation, evicted ones included."""
        return self._added

    @property
    def sampleable(self) -> bool:
        """Whether some item has a priority (all may have been dropped)."""
        return self._tree.total > 0

    @property
    def nbytes(self) -> int:
        """Bytes of storage and sum tree: the replay's whole footprint, fixed at creation."""
        return sum(a.nbytes for a in self._storage.values()) + self._tree.nbytes

    def add(self, batch: Mapping[str, np.ndarray], priorities: np.ndarray) -> np.ndarray:
        """Appends a batch (one array per spec field, leading dimension n) with raw priorities.

        Returns the items' insertion indices; the oldest items are evicted when full.
        """
        priorities = self._transform(priorities)
        n = len(priorities)
        if n > self.capacity:
            raise ValueError(
                f"cannot add {n} items to a replay of capacity {self.capacity}: "
                "add smaller batches or raise replay.capacity"
            )
        return self._write(self._check_batch(batch, n), priorities)

    def _write(self, arrays: Mapping[str, np.ndarray], priorities: np.ndarray) -> np.ndarray:
        """``add`` after validation: arrays match the spec, priorities are transformed."""
        n = len(priorities)
        with self._lock:
            start = self._added
            slot = start % self.capacity
            head = min(n, self.capacity - slot)  # items before the ring wraps
            for name, array in arrays.items():
                storage = self._storage[name]
                if head == n:  # the common case: no wrap (an empty slice still costs)
                    storage[slot : slot + n] = array
                else:
                    storage[slot : slot + head] = array[:head]
                    storage[: n - head] = array[head:]
            indices = np.arange(start, start + n, dtype=np.int64)
            self._tree.update(indices - (start - slot) if head == n else indices % self.capacity, priorities)
            self._added = start + n
        return indices

    def sample(
        self, batch_size: int, beta: float
    ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """Draws ``batch_size`` items by priority (stratified, with replacement).

        Returns ``(batch, indices, weights)``: the fields gathered into new arrays, the
        items' insertion indices (for ``update_priorities``), and float32 importance weights
        normalised so that the largest possible weight is 1.
        """
        if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got {beta!r}")
        with self._lock:
            if len(self) == 0:
                raise ValueError("cannot sample from an empty replay: add transitions first")
            slots, priorities = self._tree.sample(int(batch_size), self._rng)
            min_priority = self._tree.min
            # np.take: several times faster than fancy indexing for rows of 2-D+ arrays.
            batch = {name: np.take(storage, slots, axis=0) for name, storage in self._storage.items()}
            # The newest item held by each slot.
            last = self._added - 1
            indices = slots + self.capacity * ((last - slots) // self.capacity)
        weights = (priorities / min_priority) ** -beta
        return batch, indices, weights.astype(np.float32)

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> int:
        """Sets new raw priorities for sampled items; items evicted since are skipped.

        Returns how many priorities were applied.
        """
        indices = np.asarray(indices)
        if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
            raise ValueError(
                f"indices must be a 1-D integer array, got shape {indices.shape} of {indices.dtype}"
            )
        indices = indices.astype(np.int64, copy=False)
        priorities = self._transform(priorities)
        if len(indices) != len(priorities):
            raise ValueError(
                f"indices and priorities must have the same length, "
                f"got {len(indices)} and {len(priorities)}"
            )
        with self._lock:
            if indices.size and (indices.min() < 0 or indices.max() >= self._added):
                raise IndexError(
                    f"indices must be insertion indices returned by add/sample, "
                    f"in [0, {self._added}); got values in [{indices.min()}, {indices.max()}]"
                )
            live = indices >= self._oldest_live
            applied = int(np.count_nonzero(live))
            self.stale_priority_updates += len(indices) - applied
            if applied == len(indices):
                self._tree.update(indices % self.capacity, priorities)
            else:
                self._tree.update(indices[live] % self.capacity, priorities[live])
        return applied

    def drop(self, indices: np.ndarray) -> int:
        """Never samples these items again (those still live): for transitions found to
        poison training. Returns how many were dropped."""
        indices = np.asarray(indices, dtype=np.int64)
        with self._lock:
            live = indices[(indices >= self._oldest_live) & (indices < self._added)]
            if live.size:
                self._tree.clear(live % self.capacity)
        return int(live.size)

    def evict_until(self, index: int) -> None:
        """Evicts every item with an insertion index below ``index`` now, oldest first."""
        with self._lock:
            start, stop = self._oldest_live, min(int(index), self._added)
            if stop > start:
                self._tree.clear(np.arange(start, stop, dtype=np.int64) % self.capacity)
                self._evicted_until = stop

    def priorities(self, indices: np.ndarray) -> np.ndarray:
        """Stored (transformed) priorities of live items, by insertion index."""
        indices = np.asarray(indices, dtype=np.int64)
        with self._lock:
            if indices.size and (indices.min() < self._oldest_live or indices.max() >= self._added):
                raise IndexError("indices must refer to items still in the replay")
            return self._tree.get(indices % self.capacity)

    def _transform(self, priorities: np.ndarray, checked: bool = False) -> np.ndarray:
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

    def _check_batch(self, batch: Mapping[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
        missing = self.spec.keys() - batch.keys()
        extra = batch.keys() - self.spec.keys()
        if missing or extra:
            raise ValueError(
                f"batch fields must match the replay spec {sorted(self.spec)}: "
                f"missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        arrays = {}
        for name, field in self.spec.items():
            array = np.asarray(batch[name])
            if array.shape != (n, *field.shape):
                raise ValueError(
                    f"field {name!r} must have shape {(n, *field.shape)} "
                    f"(n={n} from priorities), got {array.shape}"
                )
            if not np.can_cast(array.dtype, field.dtype, casting="same_kind"):
                raise ValueError(
                    f"field {name!r} of dtype {array.dtype} cannot be stored as {field.dtype}"
                )
            arrays[name] = array
        return arrays


class RateLimiter:
    """Keeps sampled/inserted transitions near ``samples_per_insert`` once ``min_size``
    transitions are in (Reverb's SampleToInsertRatio): either side may run ``slack``
    samples ahead, then waits for the other. So the learner neither starves nor trains
    the same few transitions to death, and on a small machine actors that cannot be
    served yet sleep instead of taking the learner's CPU."""

    def __init__(self, samples_per_insert: float, min_size: int, slack: int) -> None:
        self.samples_per_insert = samples_per_insert
        self.min_size = min_size
        self.slack = slack
        self.inserts = 0
        self.samples = 0
        self._cond = threading.Condition()

    def _lead(self) -> float:
        """How many samples the inserts allow beyond those already drawn."""
        return (self.inserts - self.min_size) * self.samples_per_insert - self.samples

    def can_insert(self) -> bool:
        return self.inserts < self.min_size or self._lead() <= self.slack

    def can_sample(self, n: int) -> bool:
        return self.inserts >= self.min_size and self._lead() - n >= -self.slack

    def inserted(self, n: int) -> None:
        with self._cond:
            self.inserts += n
            self._cond.notify_all()

    def sampled(self, n: int) -> None:
        with self._cond:
            self.samples += n
            self._cond.notify_all()

    def wait_to_insert(self, timeout: float) -> bool:
        if self.can_insert():  # the common case, without taking the lock
            return True
        with self._cond:
            return self._cond.wait_for(self.can_insert, timeout)

    def wait_to_sample(self, n: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.can_sample(n), timeout)


class UnrollQueue:
    """A bounded FIFO of unrolls between the ingest thread and the train loop (IMPALA).

    When full it either makes inserters wait (``block``: actors are pushed back through the
    transport) or drops the oldest unrolls, counting them.
    """

    def __init__(self, capacity: int, block: bool) -> None:
        if capacity < 1:
            raise ValueError(f"queue capacity must be a positive integer, got {capacity}")
        self.capacity = capacity
        self.block = block
        self._items: deque = deque()
        self._cond = threading.Condition()
        self.inserted = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def wait_for_room(self, timeout: float) -> bool:
        if not self.block:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: len(self._items) < self.capacity, timeout)

    def put(self, items: list) -> None:
        """Appends items; when blocking, call after ``wait_for_room`` (a batch of items may
        then overshoot the capacity by less than its own size)."""
        with self._cond:
            self._items.extend(items)
            self.inserted += len(items)
            while not self.block and len(self._items) > self.capacity:
                self._items.popleft()
                self.dropped += 1
            self._cond.notify_all()

    def wait_for(self, n: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self._items) >= n, timeout)

    def take(self, n: int) -> list:
        """The n oldest items (fewer if there are not that many)."""
        with self._cond:
            items = [self._items.popleft() for _ in range(min(n, len(self._items)))]
            self._cond.notify_all()
        return items


def _slot_runs(first: int, last: int, capacity: int) -> list[tuple[int, int]]:
    """The contiguous slot ranges of a ring holding ids ``first..last-1`` (at most two)."""
    if last <= first:
        return []
    a, n = first % capacity, last - first
    if a + n <= capacity:
        return [(a, a + n)]
    return [(a, capacity), (0, a + n - capacity)]


def _write_all(f: BinaryIO, arrays: list[np.ndarray]) -> None:
    for array in arrays:
        f.write(memoryview(np.ascontiguousarray(array)).cast("B"))


class _RingCopier:
    """Copies a ring to a file piece by piece, oldest first, while an inserter overwrites
    it from the oldest end, and tracks what was copied intact.

    Each piece is copied under the lock and written after releasing it (a write may wait
    for the disk), unless the inserter could reach the next pieces during that write, going
    by the most it got during one piece so far: then the write happens under the lock and
    ingest waits for the disk rather than overtake the copy.
    """

    def __init__(self, f: BinaryIO, lock, overwritten_below, start: int) -> None:
        self.f, self.lock, self.overwritten_below = f, lock, overwritten_below
        self.valid_from = start  # ids below it may have been overwritten before they were copied
        self._below: int | None = None
        self._advance = 0  # most ids the inserter wrote during one piece so far

    def piece(self, first: int, last: int, copy) -> None:
        with self.lock:
            below = self.overwritten_below()
            if self._below is not None:  # the most it ever got during one piece: disks stall in bursts
                self._advance = max(self._advance, below - self._below)
            self._below = below
            arrays = copy()
            locked = last - below < 2 * (last - first) + 2 * self._advance
            if locked:
                _write_all(self.f, arrays)
        if not locked:
            _write_all(self.f, arrays)
        if below > first:  # the inserter got into this piece before it was copied
            self.valid_from = max(self.valid_from, min(last, below))


def _read_into(f: BinaryIO, array: np.ndarray) -> None:
    view = memoryview(array).cast("B")
    while view.nbytes:
        n = f.readinto(view)
        if not n:
            raise ValueError("the saved replay ends early: the file is truncated")
        view = view[n:]


class FrameRing:
    """A ring of frames addressed by ever-growing frame ids (id ``i`` in slot ``i % capacity``)."""

    def __init__(self, capacity: int, frame_shape: tuple[int, ...], dtype: np.dtype) -> None:
        if capacity < 1:
            raise ValueError(f"frame capacity must be a positive integer, got {capacity}")
        self.capacity = int(capacity)
        self.storage = _committed((self.capacity, *frame_shape), dtype)
        self.added = 0

    @property
    def oldest(self) -> int:
        """Id of the oldest frame still held."""
        return max(0, self.added - self.capacity)

    def add(self, frames: np.ndarray | Compressed) -> int:
        """Stores frames (at most ``capacity``); returns the id of the first.

        Compressed frames are decompressed straight into their slots (no intermediate
        copy). If that fails the slots are consumed all the same, holding garbage that no
        transition refers to, and the ProtocolError propagates.
        """
        n, first = len(frames), self.added
        slot = first % self.capacity
        head = min(n, self.capacity - slot)
        self.added += n  # before writing: whatever happens, these slots now hold new frames
        if isinstance(frames, Compressed):
            if head == n:
                frames.decompress_into(self.storage[slot : slot + n])
                return first
            frames = frames.decompress()  # the rare batch that wraps around the ring
        self.storage[slot : slot + head] = frames[:head]
        self.storage[: n - head] = frames[head:]
        return first

    def gather(self, ids: np.ndarray) -> np.ndarray:
        return np.take(self.storage, ids % self.capacity, axis=0)


class StackedReplay:
    """Prioritized transitions whose observations are stacks of frames stored once each.

    Actors send chunks: consecutive ``frames`` of one episode, and per transition the index
    in the chunk of the first frame of its observation stack and of its bootstrap
    (next) stack, its action, n-step return, discount and initial priority. Each frame is
    stored once; ``sample`` rebuilds the stacks. When the frame ring overwrites frames that
    older transitions still refer to, those transitions are evicted first, so a sampled
    transition's frames are always valid. With vector observations ``stack`` is 1 and a
    "frame" is the observation itself (still stored once rather than as obs and next_obs).
    """

    def __init__(
        self,
        frame_shape: tuple[int, ...],
        frame_dtype: np.dtype,
        stack: int,
        capacity: int,
        frame_capacity: int,
        *,
        alpha: float = 0.6,
        eps: float = 1e-6,
        seed: int | None = None,
    ) -> None:
        self.stack = int(stack)
        self.frame_shape = tuple(frame_shape)
        self.frame_dtype = np.dtype(frame_dtype)
        self.frames = FrameRing(frame_capacity, self.frame_shape, self.frame_dtype)
        self.transitions = PrioritizedReplay(
            {
                "obs_frame": ((), np.int64),
                "next_obs_frame": ((), np.int64),
                "action": ((), np.int64),
                "reward": ((), np.float32),
                "discount": ((), np.float32),
            },
            capacity,
            alpha=alpha,
            eps=eps,
            seed=seed,
        )
        self._lock = threading.Lock()
        self._chunks: deque[tuple[int, int]] = deque()  # (end insertion index, first frame id)
        self._offsets = np.arange(self.stack, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.transitions)

    @property
    def capacity(self) -> int:
        return self.transitions.capacity

    @property
    def total_added(self) -> int:
        return self.transitions.total_added

    @property
    def nbytes(self) -> int:
        return self.frames.storage.nbytes + self.transitions.nbytes

    @property
    def bytes_per_transition(self) -> float:
        """Replay memory per stored transition at capacity (a naive 4-stack Atari replay: 56,448)."""
        return self.nbytes / self.capacity

    def add(self, chunk: Mapping[str, np.ndarray]) -> np.ndarray:
        """Stores one chunk (see the class docstring) that the Ape-X batch schema validated
        (apex.schema: the learner's one check of what actors send): its indices within its
        frames, at most ``capacity`` transitions and ``frames.capacity`` frames."""
        frames = chunk["frames"]
        priorities = self.transitions._transform(chunk["priority"], checked=True)
        with self._lock:
            try:
                first = self.frames.add(frames)
            finally:
                # Transitions whose frames were just overwritten go first, chunk by chunk
                # (transitions and frames are both added in order, so they are the oldest);
                # also when decompressing failed half way through their slots.
                evict_to = None
                while self._chunks and self._chunks[0][1] < self.frames.oldest:
                    evict_to = self._chunks.popleft()[0]
                if evict_to is not None:
                    self.transitions.evict_until(evict_to)
            # Already checked field by field above: skip the generic re-validation.
            indices = self.transitions._write(
                {
                    "obs_frame": chunk["obs_frame"].astype(np.int64) + first,  # ids outgrow int32
                    "next_obs_frame": chunk["next_obs_frame"].astype(np.int64) + first,
                    "action": chunk["action"],
                    "reward": chunk["reward"],
                    "discount": chunk["discount"],
                },
                priorities,
            )
            end = self.transitions.total_added
            self._chunks.append((end, first))
            while self._chunks and self._chunks[0][0] <= end - self.capacity:
                self._chunks.popleft()  # already evicted by the transition ring itself
        return indices

    def sample(self, batch_size: int, beta: float) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """(batch with obs and next_obs stacks, insertion indices, importance weights)."""
        with self._lock:
            batch, indices, weights = self.transitions.sample(batch_size, beta)
            obs = self.frames.gather(batch.pop("obs_frame")[:, None] + self._offsets)
            next_obs = self.frames.gather(batch.pop("next_obs_frame")[:, None] + self._offsets)
        batch["obs"], batch["next_obs"] = obs, next_obs
        return batch, indices, weights

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray) -> int:
        return self.transitions.update_priorities(indices, priorities)

    def drop(self, indices: np.ndarray) -> int:
        return self.transitions.drop(indices)

    def priority_stats(self) -> dict[str, float]:
        """Mean and min of the stored (transformed) priorities: how surprising the replay is."""
        t = self.transitions
        with t._lock:
            n = len(t)
            return {"priority_mean": t._tree.total / n, "priority_min": t._tree.min} if n else {}

    # -- snapshots (checkpoints)

    def save(self, f: BinaryIO, lock_bytes: int = 16 << 20) -> dict:
        """Writes the replay's contents and priorities to ``f``; returns the header that
        ``load`` needs with them.

        Ingest and sampling go on meanwhile: the lock is held only to copy one piece of at
        most ``lock_bytes`` into memory (oldest items first), never while writing it out
        (measured: a write held under the lock stalled inserts for 1.6 s while the kernel
        throttled 2 GB of dirty pages). An item overwritten before its piece was copied
        (the writer chases the copy from the oldest end) cannot be told apart from its
        successor, so every item up to the highest one that might have been is left out:
        the snapshot is the replay as it was when saving began, less that oldest margin (in
        practice nothing: copying runs far faster than actors fill the ring).
        """
        transitions, frames = self.transitions, self.frames
        with self._lock:
            frames_end, items_end = frames.added, transitions._added
            frames_start, items_start = frames.oldest, transitions._oldest_live
            chunks = [list(c) for c in self._chunks]
        # Items first: they are small (one piece), and the frames copy that follows is
        # what a fast ingest could overtake; items whose frames it did are dropped on load.
        fields = transitions.spec
        item_bytes = sum(int(np.prod(fd.shape, dtype=np.int64)) * fd.dtype.itemsize for fd in fields.values()) + 8
        items_step = max(1, lock_bytes // item_bytes)
        item_copier = _RingCopier(f, self._lock, lambda: transitions._added - transitions.capacity, items_start)

        def copy_items(runs):
            with transitions._lock:
                pieces = [transitions._storage[name][a:b].copy() for name in fields for a, b in runs]
                return pieces + [transitions._tree.get(np.arange(a, b, dtype=np.int64)) for a, b in runs]

        for first in range(items_start, items_end, items_step):
            last = min(items_end, first + items_step)
            item_copier.piece(first, last, lambda runs=_slot_runs(first, last, transitions.capacity): copy_items(runs))
        frame_bytes = max(1, frames.storage[0].nbytes)
        frames_step = max(1, lock_bytes // frame_bytes)
        frame_copier = _RingCopier(f, self._lock, lambda: frames.added - frames.capacity, frames_start)
        for first in range(frames_start, frames_end, frames_step):
            last = min(frames_end, first + frames_step)
            frame_copier.piece(first, last, lambda runs=_slot_runs(first, last, frames.capacity): [
                frames.storage[a:b].copy() for a, b in runs])
        return {
            "frame_shape": list(self.frame_shape), "frame_dtype": self.frame_dtype.str, "stack": self.stack,
            "capacity": self.capacity, "frame_capacity": frames.capacity, "chunk_items": items_step,
            "frames": [frames_start, frame_copier.valid_from, frames_end],
            "items": [items_start, item_copier.valid_from, items_end],
            "chunks": chunks,
        }

    def shape_mismatch(self, header: dict) -> str | None:
        """How a saved replay's header (``save``'s) differs in shape from this replay, or None."""
        ours = {"frame_shape": list(self.frame_shape), "frame_dtype": self.frame_dtype.str,
                "stack": self.stack, "capacity": self.capacity, "frame_capacity": self.frames.capacity}
        for key, value in ours.items():
            if header[key] != value:
                return f"the saved replay has {key} {header[key]}, this run's has {value}"
        return None

    def load(self, f: BinaryIO, header: dict) -> None:
        """Restores what ``save`` wrote into this (new, empty) replay of the same shape."""
        if (mismatch := self.shape_mismatch(header)) is not None:
            raise ValueError(f"{mismatch}: resume with the configuration the checkpoint was made with")
        transitions, frames = self.transitions, self.frames
        frames_start, frames_valid, frames_end = header["frames"]
        items_start, items_valid, items_end = header["items"]
        priorities = np.zeros(transitions.capacity, np.float64)
        step = header["chunk_items"]
        for first in range(items_start, items_end, step):
            runs = _slot_runs(first, min(items_end, first + step), transitions.capacity)
            for name in transitions.spec:
                for a, b in runs:
                    _read_into(f, transitions._storage[name][a:b])
            for a, b in runs:
                _read_into(f, priorities[a:b])
        for a, b in _slot_runs(frames_start, frames_end, frames.capacity):
            _read_into(f, frames.storage[a:b])
        # Items overwritten while saving are gone, and so are those whose frames were.
        live = np.arange(items_valid, items_end, dtype=np.int64)
        slots = live % transitions.capacity
        storage = transitions._storage
        first_frame = np.minimum(storage["obs_frame"][slots], storage["next_obs_frame"][slots])
        keep = first_frame >= frames_valid  # frame ids only grow with insertion: a suffix
        live, slots = live[keep], slots[keep]
        kept_from = int(live[0]) if len(live) else items_end
        with self._lock, transitions._lock:
            frames.added = frames_end
            transitions._added = items_end
            transitions._evicted_until = kept_from
            transitions._tree.update(slots, priorities[slots])
            self._chunks = deque((end, first) for end, first in header["chunks"] if end > kept_from)
