"""Replay for the learner: prioritized transitions (Ape-X) and the unroll queue (IMPALA).

- ``ring``: the prioritized ring of named fields over the native sum tree (not thread-safe);
- ``prioritized``: ``PrioritizedReplay``, that ring behind a lock, for any named fields;
- ``frames``: ``StackedReplay``, Ape-X's replay, whose observation stacks are frames stored once;
- ``snapshot``: a StackedReplay into a checkpoint while ingest goes on, and back;
- ``rate_limit``: ``RateLimiter``, the sample-to-insert ratio;
- ``unrolls``: ``UnrollQueue``, IMPALA's bounded FIFO of unrolls, and ``UnrollRing``, APPO's circular buffer.
"""

from apex.replay.frames import FrameRing, StackedReplay
from apex.replay.prioritized import PrioritizedReplay
from apex.replay.rate_limit import RateLimiter
from apex.replay.ring import Field, PriorityRing
from apex.replay.unrolls import UnrollQueue, UnrollRing

__all__ = [
    "Field",
    "FrameRing",
    "PrioritizedReplay",
    "PriorityRing",
    "RateLimiter",
    "StackedReplay",
    "UnrollQueue",
    "UnrollRing",
]
