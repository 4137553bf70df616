"""Slow, obviously correct NumPy references that the fast implementations are tested against."""

from __future__ import annotations

import numpy as np


class ReferenceSumTree:
    """A flat array of priorities; every query is a full scan or cumulative sum."""

    def __init__(self, capacity: int) -> None:
        self.prio = np.zeros(capacity)
        self.given = np.zeros(capacity, dtype=bool)

    def update(self, idx, prio) -> None:
        for i, p in zip(idx, prio):  # in order: the last write wins
            self.prio[i] = p
            self.given[i] = True

    @property
    def total(self) -> float:
        return float(self.prio.sum())

    @property
    def min(self) -> float:
        return float(self.prio[self.given].min()) if self.given.any() else float("inf")

    def find_prefixsum(self, values) -> np.ndarray:
        cumsum = np.cumsum(self.prio)
        found = np.searchsorted(cumsum, values, side="right")
        # v == total: the last leaf with a positive priority.
        last_positive = np.flatnonzero(self.prio > 0)[-1]
        return np.minimum(found, last_positive)
