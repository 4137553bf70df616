"""A vectorised NumPy sum tree: the baseline `apex bench sumtree` measures the native one against.

Written the way NumPy replay buffers such as Tianshou's write it: one implicit binary tree
in an array, every batched operation a loop over tree levels with fancy indexing over the
whole batch. It keeps a min tree as well so that it does the same work as apex.native.
It has no input validation: it exists to be timed.
"""

from __future__ import annotations

import numpy as np


class NumpySumTree:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._leaf_base = 1 << max(0, (capacity - 1).bit_length())
        self._sum = np.zeros(2 * self._leaf_base)
        self._min = np.full(2 * self._leaf_base, np.inf)

    @property
    def total(self) -> float:
        return float(self._sum[1])

    @property
    def min(self) -> float:
        return float(self._min[1])

    def update(self, idx: np.ndarray, prio: np.ndarray) -> None:
        node = idx + self._leaf_base
        self._sum[node] = prio
        self._min[node] = prio
        while node[0] > 1:  # all leaves sit at the same depth
            node = node >> 1
            left = 2 * node
            self._sum[node] = self._sum[left] + self._sum[left + 1]
            self._min[node] = np.minimum(self._min[left], self._min[left + 1])

    def find_prefixsum(self, values: np.ndarray) -> np.ndarray:
        remaining = np.array(values, dtype=np.float64)
        node = np.ones(len(remaining), dtype=np.int64)
        while node[0] < self._leaf_base:
            node = 2 * node
            left_sum = self._sum[node]
            go_right = remaining >= left_sum
            remaining -= left_sum * go_right
            node += go_right
        return node - self._leaf_base

    def sample(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        total = self._sum[1]
        values = np.minimum((np.arange(n) + rng.random(n)) * (total / n), total)
        idx = self.find_prefixsum(values)
        return idx, self._sum[idx + self._leaf_base]

    def get(self, idx: np.ndarray) -> np.ndarray:
        leaves: np.ndarray = self._sum[idx + self._leaf_base]
        return leaves
