"""UnrollQueue: IMPALA's bounded FIFO of unrolls between the ingest thread and the train loop."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

# One unroll: its named arrays (a row of an actor's batch).
Unroll = dict[str, np.ndarray]


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
        if not items:
            return 0.0
        return sum(a.nbytes for item in items for a in item.values()) / (len(items) * steps_per_item)

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
