"""Native data structures (C++, native/sum_tree.hpp)."""

import numpy as np
import numpy.typing as npt

class SumTree:
    """Sum tree and min tree over ``capacity`` non-negative priorities.

    All batched calls validate their whole input first (raising ValueError, IndexError or
    TypeError and leaving the tree unchanged), then run with the GIL released. A leaf never
    given a priority holds 0 and is never found or sampled.
    """

    def __init__(self, capacity: int) -> None: ...
    def update(self, idx: npt.ArrayLike, prio: npt.ArrayLike) -> None:
        """Set leaf ``idx[i]`` to ``prio[i]`` (finite, >= 0); for a repeated index the last wins."""
    def clear(self, idx: npt.ArrayLike) -> None:
        """Return leaves to their never-set state: priority 0, not part of ``min``."""
    def find_prefixsum(self, values: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """For each v in [0, total], the leaf i with cumsum[i-1] <= v < cumsum[i]."""
    def sample(self, n: int, rng: np.random.Generator) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
        """Stratified sample: one leaf from each of n equal slices of [0, total).

        Returns (indices, priorities); indices come out in increasing order.
        """
    def get(self, idx: npt.ArrayLike) -> npt.NDArray[np.float64]:
        """Priorities of the given leaves (0 for a leaf never set)."""
    @property
    def total(self) -> float:
        """Sum of all priorities."""
    @property
    def min(self) -> float:
        """Smallest priority over the leaves given one; +inf before any."""
    @property
    def capacity(self) -> int: ...
    @property
    def nbytes(self) -> int:
        """Bytes held by the sum and min trees."""
    def __len__(self) -> int: ...
