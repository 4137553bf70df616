"""Unrolls between the ingest thread and the train loop: IMPALA's bounded FIFO (``UnrollQueue``)
and APPO's circular buffer, whose unrolls may be trained on a bounded number of times
(``UnrollRing``)."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

# One unroll: its named arrays (a row of an actor's batch).
Unroll = dict[str, np.ndarray]


def bytes_per_step(items: list[Unroll], steps_per_item: int) -> float:
    """Bytes of the items' arrays per step they hold (0 for none)."""
    if not items:
        return 0.0
    return sum(a.nbytes for item in items for a in item.values()) / (len(items) * steps_per_item)


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
        self._items: deque[Unroll] = deque()
        self._cond = threading.Condition()
        self.inserted = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def bytes_per_transition(self, steps_per_item: int) -> float:
        """Bytes of the queued items' arrays per step they hold (0 when empty)."""
        with self._cond:
            items = list(self._items)
        return bytes_per_step(items, steps_per_item)

    def wait_for_room(self, timeout: float) -> bool:
        if not self.block:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: len(self._items) < self.capacity, timeout)

    def put(self, items: list[Unroll]) -> None:
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

    def take(self, n: int) -> list[Unroll]:
        """The n oldest items (fewer if there are not that many)."""
        with self._cond:
            items = [self._items.popleft() for _ in range(min(n, len(self._items)))]
            self._cond.notify_all()
        return items


class UnrollRing:
    """A bounded buffer of unrolls each trained on at most ``max_uses`` times (APPO's
    ``replay_ratio``; RLlib's circular buffer): ``take`` gives the unrolls never trained on
    first, oldest first, and tops the batch up with unrolls drawn uniformly from those trained
    on fewer than ``max_uses`` times; an unroll leaves once used that often. Room for new
    unrolls is made by evicting the used ones, least recently used first, so that an unroll
    never trained on is only dropped where the policy says so (``block`` false: the oldest).
    With ``max_uses`` 1 it is ``UnrollQueue``."""

    def __init__(self, capacity: int, block: bool, max_uses: int, seed: int = 0) -> None:
        if capacity < 1 or max_uses < 1:
            raise ValueError(f"capacity and max_uses must be positive, got {capacity}, {max_uses}")
        self.capacity, self.block, self.max_uses = capacity, block, max_uses
        self._fresh: deque[Unroll] = deque()
        self._used: deque[tuple[Unroll, int]] = deque()  # (unroll, times used), least recently used first
        self._cond = threading.Condition()
        self._rng = np.random.default_rng(seed)
        self.inserted = 0
        self.dropped = 0  # never trained on
        self.reused = 0  # draws of an unroll trained on before
        self.retired = 0  # left after max_uses, or evicted to make room

    def __len__(self) -> int:
        return len(self._fresh) + len(self._used)

    def bytes_per_transition(self, steps_per_item: int) -> float:
        with self._cond:
            items = [*self._fresh, *(u for u, _ in self._used)]
        return bytes_per_step(items, steps_per_item)

    def wait_for_room(self, timeout: float) -> bool:
        """Room while fewer than ``capacity`` unrolls wait untrained (used ones make way)."""
        if not self.block:
            return True
        with self._cond:
            return self._cond.wait_for(lambda: len(self._fresh) < self.capacity, timeout)

    def put(self, items: list[Unroll]) -> None:
        with self._cond:
            self._fresh.extend(items)
            self.inserted += len(items)
            self._evict_used()
            while not self.block and len(self._fresh) > self.capacity:
                self._fresh.popleft()
                self.dropped += 1
            self._cond.notify_all()

    def _evict_used(self) -> None:
        """Used unrolls make way, least recently used first, while over capacity (call locked)."""
        while len(self) > self.capacity and self._used:
            self._used.popleft()
            self.retired += 1

    def wait_for(self, n: int, timeout: float) -> bool:
        """Whether a batch of ``n`` can be taken (within ``timeout``): at least one new unroll
        among ``n`` in all, so that the learner never goes over old data alone."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._fresh) and len(self) >= n, timeout)

    def take(self, n: int) -> list[Unroll]:
        """``n`` unrolls (fewer if there are not that many): new ones first, oldest first, the
        rest drawn uniformly without replacement from the used ones; each use counted."""
        with self._cond:
            taken = [(self._fresh.popleft(), 0) for _ in range(min(n, len(self._fresh)))]
            more = min(n - len(taken), len(self._used))
            if more:
                picks = set(self._rng.choice(len(self._used), size=more, replace=False).tolist())
                kept: deque[tuple[Unroll, int]] = deque()
                for i, item in enumerate(self._used):
                    (taken if i in picks else kept).append(item)
                self._used = kept
                self.reused += more
            for unroll, uses in taken:
                if uses + 1 < self.max_uses:
                    self._used.append((unroll, uses + 1))
                else:
                    self.retired += 1
            self._evict_used()
            self._cond.notify_all()
        return [unroll for unroll, _ in taken]
