"""RateLimiter: the sample-to-insert ratio between an Ape-X learner and its actors."""

from __future__ import annotations

import threading


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
