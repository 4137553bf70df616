"""A StackedReplay written to a checkpoint while ingest goes on, and read back.

The lock is held only to copy one piece of at most ``lock_bytes`` into memory (oldest
items first), never while writing it out (measured: a write held under the lock stalled
inserts for 1.6 s while the kernel throttled 2 GB of dirty pages). An item overwritten
before its piece was copied (the inserter chases the copy from the oldest end) cannot be
told apart from its successor, so every item up to the highest one that might have been is
left out: the snapshot is the replay as it was when saving began, less that oldest margin
(in practice nothing: copying runs far faster than actors fill the ring).
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from apex.replay.frames import StackedReplay
    from apex.wire.schema import BatchSchema


class WritableFile(Protocol):
    """Where ``save`` writes: a binary file, or a wrapper that counts what goes through."""

    def write(self, data: memoryview, /) -> object: ...


class ReadableFile(Protocol):
    """What ``load`` reads from: a binary file that reads into a buffer (io.BufferedIOBase)."""

    def readinto(self, buffer: memoryview, /) -> int | None: ...


def slot_runs(first: int, last: int, capacity: int) -> list[tuple[int, int]]:
    """The contiguous slot ranges of a ring holding ids ``first..last-1`` (at most two)."""
    if last <= first:
        return []
    a, n = first % capacity, last - first
    if a + n <= capacity:
        return [(a, a + n)]
    return [(a, capacity), (0, a + n - capacity)]


def _write_all(f: WritableFile, arrays: list[np.ndarray]) -> None:
    for array in arrays:
        f.write(np.ascontiguousarray(array).data.cast("B"))


def _read_into(f: ReadableFile, array: np.ndarray) -> None:
    view = array.data.cast("B")
    while view.nbytes:
        n = f.readinto(view)
        if not n:
            raise ValueError("the saved replay ends early: the file is truncated")
        view = view[n:]


class RingCopier:
    """Copies a ring to a file piece by piece, oldest first, while an inserter overwrites
    it from the oldest end, and tracks what was copied intact.

    Each piece is copied under the lock and written after releasing it (a write may wait
    for the disk), unless the inserter could reach the next pieces during that write, going
    by the most it got during one piece so far: then the write happens under the lock and
    ingest waits for the disk rather than overtake the copy.
    """

    def __init__(self, f: WritableFile, lock: threading.Lock, overwritten_below: Callable[[], int], start: int) -> None:
        self.f, self.lock, self.overwritten_below = f, lock, overwritten_below
        self.valid_from = start  # ids below it may have been overwritten before they were copied
        self._below: int | None = None
        self._advance = 0  # most ids the inserter wrote during one piece so far

    def piece(self, first: int, last: int, copy: Callable[[], list[np.ndarray]]) -> None:
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


def save(replay: StackedReplay, f: WritableFile, lock_bytes: int) -> dict[str, Any]:
    """Writes the replay's transitions, priorities and frames to ``f``; returns the header
    that ``load`` needs with them."""
    ring, frames = replay.ring, replay.frames
    with replay.lock:
        frames_end, items_end = frames.added, ring.added
        frames_start, items_start = frames.oldest, ring.oldest_live
        chunks = [list(c) for c in replay.chunks]
    # Items first: they are small (one piece), and the frames copy that follows is what a
    # fast ingest could overtake; items whose frames it did are dropped on load.
    fields = ring.fields
    item_bytes = sum(int(np.prod(fd.shape, dtype=np.int64)) * fd.dtype.itemsize for fd in fields.values()) + 8
    items_step = max(1, lock_bytes // item_bytes)
    item_copier = RingCopier(f, replay.lock, lambda: ring.added - ring.capacity, items_start)

    def copy_items(runs: list[tuple[int, int]]) -> list[np.ndarray]:  # under the replay's lock (RingCopier.piece)
        pieces = [ring.storage[name][a:b].copy() for name in fields for a, b in runs]
        return pieces + [ring.tree.get(np.arange(a, b, dtype=np.int64)) for a, b in runs]

    for first in range(items_start, items_end, items_step):
        last = min(items_end, first + items_step)
        item_copier.piece(first, last, functools.partial(copy_items, slot_runs(first, last, ring.capacity)))
    frame_bytes = max(1, frames.storage[0].nbytes)
    frames_step = max(1, lock_bytes // frame_bytes)
    frame_copier = RingCopier(f, replay.lock, lambda: frames.added - frames.capacity, frames_start)

    def copy_frames(runs: list[tuple[int, int]]) -> list[np.ndarray]:  # under the replay's lock
        return [frames.storage[a:b].copy() for a, b in runs]

    for first in range(frames_start, frames_end, frames_step):
        last = min(frames_end, first + frames_step)
        frame_copier.piece(first, last, functools.partial(copy_frames, slot_runs(first, last, frames.capacity)))
    return {
        "frame_shape": list(replay.frame_shape),
        "frame_dtype": replay.frame_dtype.str,
        "stack": replay.stack,
        "capacity": replay.capacity,
        "frame_capacity": frames.capacity,
        "chunk_items": items_step,
        "frames": [frames_start, frame_copier.valid_from, frames_end],
        "items": [items_start, item_copier.valid_from, items_end],
        "chunks": chunks,
    }


def shape_mismatch(replay: StackedReplay, header: dict[str, Any]) -> str | None:
    """How a saved replay's header (``save``'s) differs in shape from ``replay``, or None."""
    ours = {
        "frame_shape": list(replay.frame_shape),
        "frame_dtype": replay.frame_dtype.str,
        "stack": replay.stack,
        "capacity": replay.capacity,
        "frame_capacity": replay.frames.capacity,
    }
    for key, value in ours.items():
        if header[key] != value:
            return f"the saved replay has {key} {header[key]}, this run's has {value}"
    return None


def load(replay: StackedReplay, f: ReadableFile, header: dict[str, Any], schema: BatchSchema | None = None) -> None:
    """Restores what ``save`` wrote into ``replay`` (new, empty, of the same shape). With
    ``schema`` (the algorithm's batch schema) the transitions and frames kept are held to the
    rules actors' batches are: a replay file is as untrusted as a message (ValueError; the
    replay stays empty)."""
    if (mismatch := shape_mismatch(replay, header)) is not None:
        raise ValueError(f"{mismatch}: resume with the configuration the checkpoint was made with")
    ring, frames = replay.ring, replay.frames
    frames_start, frames_valid, frames_end = header["frames"]
    items_start, items_valid, items_end = header["items"]
    priorities = np.zeros(ring.capacity, np.float64)
    step = header["chunk_items"]
    for first in range(items_start, items_end, step):
        runs = slot_runs(first, min(items_end, first + step), ring.capacity)
        for name in ring.fields:
            for a, b in runs:
                _read_into(f, ring.storage[name][a:b])
        for a, b in runs:
            _read_into(f, priorities[a:b])
    for a, b in slot_runs(frames_start, frames_end, frames.capacity):
        _read_into(f, frames.storage[a:b])
    # Items overwritten while saving are gone, and so are those whose frames were.
    live = np.arange(items_valid, items_end, dtype=np.int64)
    slots = live % ring.capacity
    first_frame = np.minimum(ring.storage["obs_frame"][slots], ring.storage["next_obs_frame"][slots])
    keep = first_frame >= frames_valid  # frame ids only grow with insertion: a suffix
    live, slots = live[keep], slots[keep]
    kept_from = int(live[0]) if len(live) else items_end
    if schema is not None:
        _check_values(replay, schema, slots, frames_valid, frames_end)
    with replay.lock:
        frames.added = frames_end
        ring.added = items_end
        ring.evicted_until = kept_from
        ring.tree.update(slots, priorities[slots])
        replay.chunks = deque((end, first) for end, first in header["chunks"] if end > kept_from)


def _check_values(
    replay: StackedReplay, schema: BatchSchema, slots: np.ndarray, frames_valid: int, frames_end: int
) -> None:
    """The kept transitions' fields and frame ids, and the frames they may refer to."""
    storage = replay.ring.storage
    if len(slots):
        last_frame = max(int(storage["obs_frame"][slots].max()), int(storage["next_obs_frame"][slots].max()))
        if last_frame + replay.stack > frames_end:
            raise ValueError(
                f"the saved replay's transitions refer to frame {last_frame}, beyond the {frames_end} it holds"
            )
    try:
        for name in replay.ring.fields:
            schema.check_values(name, storage[name][slots])
        for a, b in slot_runs(frames_valid, frames_end, replay.frames.capacity):
            schema.check_values("frames", replay.frames.storage[a:b])
    except ValueError as e:  # RejectedMessage: the same words as for a batch
        raise ValueError(f"the saved replay's {e}") from None
