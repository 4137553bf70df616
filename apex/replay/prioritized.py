"""PrioritizedReplay: a thread-safe prioritized FIFO of items of named fields (the ring of
``apex.replay.ring`` behind one lock)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from apex.replay.ring import Field, Fields, LockedRing, PriorityRing, importance_weights


class PrioritizedReplay(LockedRing):
    """A bounded, prioritized FIFO of transitions described by named fields.

    Thread-safe: the learner's ingest thread may ``add`` while its train loop samples.
    """

    def __init__(
        self, fields: Fields, capacity: int, *, alpha: float = 0.6, eps: float = 1e-6, seed: int | None = None
    ) -> None:
        super().__init__(PriorityRing(fields, capacity, alpha=alpha, eps=eps, seed=seed))

    @property
    def fields(self) -> dict[str, Field]:
        return self.ring.fields

    @property
    def storage(self) -> dict[str, np.ndarray]:
        """The arrays the items live in, slot by slot."""
        return self.ring.storage

    @property
    def nbytes(self) -> int:
        """Bytes of storage and sum tree: the replay's whole footprint, fixed at creation."""
        return self.ring.nbytes

    def add(self, batch: Mapping[str, np.ndarray], priorities: np.ndarray) -> np.ndarray:
        """Appends a batch (one array per field, leading dimension n) with raw priorities.

        Returns the items' insertion indices; the oldest items are evicted when full.
        """
        priorities = self.ring.transform(priorities)
        arrays = self.ring.check_batch(batch, len(priorities))
        with self.lock:
            return self.ring.write(arrays, priorities)

    def sample(self, batch_size: int, beta: float) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """Draws ``batch_size`` items by priority (stratified, with replacement).

        Returns ``(batch, indices, weights)``: the fields gathered into new arrays, the
        items' insertion indices (for ``update_priorities``), and float32 importance weights
        normalised so that the largest possible weight is 1.
        """
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got {beta!r}")
        with self.lock:
            slots, indices, priorities, min_priority = self.ring.draw(batch_size)
            batch = self.ring.gather(slots)
        return batch, indices, importance_weights(priorities, min_priority, beta)

    def evict_until(self, index: int) -> None:
        """Evicts every item with an insertion index below ``index`` now, oldest first."""
        with self.lock:
            self.ring.evict_until(index)
