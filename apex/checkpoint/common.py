"""What every part of the checkpoint code shares: the format, the errors, small checks."""

from __future__ import annotations

import math
import reprlib
from typing import Any

from apex.errors import ApexError

FORMAT = 1
MANIFESTS = "ckpt-*.json"  # one per complete checkpoint
ORDERS = ("best", "newest")  # the ways of choosing among a run's checkpoints


class CorruptCheckpoint(ApexError):
    """A checkpoint's manifest is malformed, its files do not match it, or they do not hold
    what an apex checkpoint holds: set it aside and use the one before."""


class IncompatibleCheckpoint(ApexError):
    """A sound checkpoint that this run cannot use (e.g. a replay of another shape): every
    checkpoint of the run would say the same, so falling back to an older one does not help."""


def is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def show(value: Any) -> str:
    """A short repr: a forged manifest may hold anything, of any size."""
    return reprlib.repr(value)


def finite_or_none(value: Any) -> float | None:
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def score_of(manifest: dict) -> float | None:
    return finite_or_none(manifest.get("return_mean_100"))
