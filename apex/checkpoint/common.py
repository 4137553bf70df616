"""What every part of the checkpoint code shares: the format, the errors, small checks."""

from __future__ import annotations

import math
import os
from typing import Any

from apex.errors import CorruptCheckpoint as CorruptCheckpoint
from apex.errors import IncompatibleCheckpoint as IncompatibleCheckpoint
from apex.errors import show as show

FORMAT = 1
MANIFESTS = "ckpt-*.json"  # one per complete checkpoint
ORDERS = ("best", "newest")  # the ways of choosing among a run's checkpoints
# A manifest lists its replay's chunks, a few tens of bytes each: 16 MiB hold some 600,000
# (a replay of 100,000 transitions has had a few thousand), and parse in under a second.
MAX_MANIFEST_BYTES = 16 << 20


def is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def memory_bytes() -> int:
    """This machine's memory: a checkpoint's files are loaded into it, so none can be larger
    (and reading one that claims more, a sparse file of a terabyte, would take minutes)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def finite_or_none(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def score_of(manifest: dict[str, Any]) -> float | None:
    return finite_or_none(manifest.get("return_mean_100"))
