"""StackedReplay: prioritized transitions whose observations are stacks of frames, each
frame stored once (Ape-X's replay for Atari and any image or vector observation)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import DTypeLike

from apex.replay import snapshot
from apex.replay.ring import LockedRing, PriorityRing, committed, importance_weights
from apex.wire.compression import Compressed

if TYPE_CHECKING:
    from apex.wire.schema import BatchSchema


class FrameRing:
    """A ring of frames addressed by ever-growing frame ids (id ``i`` in slot ``i % capacity``)."""

    def __init__(self, capacity: int, frame_shape: tuple[int, ...], dtype: np.dtype) -> None:
        if capacity < 1:
            raise ValueError(f"frame capacity must be a positive integer, got {capacity}")
        self.capacity = int(capacity)
        self.storage = committed((self.capacity, *frame_shape), dtype)
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


TRANSITION_FIELDS = {
    "obs_frame": ((), np.int64),  # frame ids outgrow int32
    "next_obs_frame": ((), np.int64),
    "action": ((), np.int64),
    "reward": ((), np.float32),
    "discount": ((), np.float32),
}


class StackedReplay(LockedRing):
    """Prioritized transitions whose observations are stacks of frames stored once each.

    Actors send chunks: consecutive ``frames`` of one episode, and per transition the index
    in the chunk of the first frame of its observation stack and of its bootstrap
    (next) stack, its action, n-step return, discount and initial priority. Each frame is
    stored once; ``sample`` rebuilds the stacks. When the frame ring overwrites frames that
    older transitions still refer to, those transitions are evicted first, so a sampled
    transition's frames are always valid. With vector observations ``stack`` is 1 and a
    "frame" is the observation itself (still stored once rather than as obs and next_obs).

    Thread-safe through one lock (``lock``) around the transitions' ring and the frames:
    the ingest thread adds while the train loop samples and a checkpoint is written.
    """

    def __init__(
        self,
        frame_shape: tuple[int, ...],
        frame_dtype: DTypeLike,
        stack: int,
        capacity: int,
        frame_capacity: int,
        *,
        alpha: float = 0.6,
        eps: float = 1e-6,
        seed: int | None = None,
        extra_fields: dict[str, tuple[tuple[int, ...], DTypeLike]] | None = None,
        action_field: tuple[tuple[int, ...], DTypeLike] = ((), np.int64),
    ) -> None:
        """``extra_fields``: per-transition arrays beside TRANSITION_FIELDS, stored as chunks
        give them and sampled with the rest (a masked policy's ``next_mask``);
        ``action_field``: one action's shape and dtype (an index by default; Ape-X DDPG's: a
        float32 vector)."""
        self.stack = int(stack)
        self.extra_fields = tuple(extra_fields or ())
        self.frame_shape = tuple(frame_shape)
        self.frame_dtype = np.dtype(frame_dtype)
        self.frames = FrameRing(frame_capacity, self.frame_shape, self.frame_dtype)
        fields = {**TRANSITION_FIELDS, "action": action_field, **(extra_fields or {})}
        super().__init__(PriorityRing(fields, capacity, alpha=alpha, eps=eps, seed=seed))
        # (end insertion index, first frame id) per chunk still held: which transitions go
        # when their frames are overwritten. Restored by the snapshot code.
        self.chunks: deque[tuple[int, int]] = deque()
        self._offsets = np.arange(self.stack, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return self.frames.storage.nbytes + self.ring.nbytes

    @property
    def bytes_per_transition(self) -> float:
        """Replay memory per stored transition at capacity (a naive 4-stack Atari replay: 56,448)."""
        return self.nbytes / self.capacity

    def add(self, chunk: Mapping[str, np.ndarray]) -> np.ndarray:
        """Stores one chunk (see the class docstring) that the Ape-X batch schema validated
        (apex.wire.schema: the learner's one check of what actors send): its indices within its
        frames, at most ``capacity`` transitions and ``frames.capacity`` frames."""
        frames = chunk["frames"]
        priorities = self.ring.transform(chunk["priority"], checked=True)
        with self.lock:
            try:
                first = self.frames.add(frames)
            finally:
                # Transitions whose frames were just overwritten go first, chunk by chunk
                # (transitions and frames are both added in order, so they are the oldest);
                # also when decompressing failed half way through their slots.
                evict_to = None
                while self.chunks and self.chunks[0][1] < self.frames.oldest:
                    evict_to = self.chunks.popleft()[0]
                if evict_to is not None:
                    self.ring.evict_until(evict_to)
            # Already checked field by field by the schema: no generic re-validation.
            indices = self.ring.write(
                {
                    "obs_frame": chunk["obs_frame"].astype(np.int64) + first,
                    "next_obs_frame": chunk["next_obs_frame"].astype(np.int64) + first,
                    "action": chunk["action"],
                    "reward": chunk["reward"],
                    "discount": chunk["discount"],
                    **{name: chunk[name] for name in self.extra_fields},
                },
                priorities,
            )
            end = self.ring.added
            self.chunks.append((end, first))
            while self.chunks and self.chunks[0][0] <= end - self.capacity:
                self.chunks.popleft()  # already evicted by the transition ring itself
        return indices

    def sample(
        self, batch_size: int, beta: float, batches: int = 1
    ) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """(batch with obs and next_obs stacks, insertion indices, importance weights). With
        ``batches`` > 1, that many batches of ``batch_size`` drawn together, one after the
        other in the arrays; each is spread over the whole replay (the draw's strata dealt
        out in turn), not a slice of it."""
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got {beta!r}")
        with self.lock:
            slots, indices, priorities, min_priority = self.ring.draw(batch_size * batches)
            if batches > 1:  # stratum j goes to batch j % batches (a strided copy, not a gather)
                slots, indices, priorities = (
                    np.ascontiguousarray(a.reshape(batch_size, batches).T).reshape(-1)
                    for a in (slots, indices, priorities)
                )
            batch = self.ring.gather(slots)
            obs = self.frames.gather(batch.pop("obs_frame")[:, None] + self._offsets)
            next_obs = self.frames.gather(batch.pop("next_obs_frame")[:, None] + self._offsets)
        batch["obs"], batch["next_obs"] = obs, next_obs
        return batch, indices, importance_weights(priorities, min_priority, beta)

    # -- snapshots (checkpoints): apex.replay.snapshot

    def save(self, f: snapshot.WritableFile, lock_bytes: int = 16 << 20) -> dict[str, Any]:
        """Writes the contents and priorities to ``f`` while ingest goes on; returns the
        header that ``load`` needs (``snapshot.save``)."""
        return snapshot.save(self, f, lock_bytes)

    def shape_mismatch(self, header: dict[str, Any]) -> str | None:
        return snapshot.shape_mismatch(self, header)

    def load(self, f: snapshot.ReadableFile, header: dict[str, Any], schema: BatchSchema | None = None) -> None:
        """Restores what ``save`` wrote into this (new, empty) replay of the same shape;
        ``schema``: the batch schema its contents are checked against (``snapshot.load``)."""
        snapshot.load(self, f, header, schema)
