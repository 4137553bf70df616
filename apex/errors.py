"""The error types apex raises for problems a user can fix.

Each message names the value, the rule it broke and what to do instead, e.g.
``apex_dqn.replay.capacity must be a positive integer, got -5``.
"""

import reprlib
from typing import Any


class ApexError(Exception):
    """Base class for every error apex raises on purpose."""


class ConfigError(ApexError, ValueError):
    """A configuration file or override is invalid."""


class ProtocolError(ApexError, ValueError):
    """A message on the wire is malformed, too large or of the wrong version."""


class CorruptCheckpoint(ApexError):
    """A checkpoint's manifest is malformed, its files do not match it, or they do not hold
    what an apex checkpoint holds: set it aside and use the one before."""


class IncompatibleCheckpoint(ApexError):
    """A sound checkpoint that this run cannot use (e.g. a replay of another shape): every
    checkpoint of the run would say the same, so falling back to an older one does not help."""


class RejectedMessage(ProtocolError):
    """A received message refused for a reason that metrics count: ``reason`` is its short
    key in ``rejected_by_reason`` (e.g. ``nonfinite``, ``too_large``, ``no_session``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def show(value: Any) -> str:
    """A short repr: a forged manifest or message may hold anything, of any size."""
    return reprlib.repr(value)
