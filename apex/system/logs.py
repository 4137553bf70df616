"""Logging that a flood of bad input or a full disk cannot turn into a flood of lines."""

from __future__ import annotations

import logging
import time
from typing import Any


class RateLimitedLog:
    """Logs at most one line every ``interval_s``, with a count of those it held back."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0) -> None:
        self._logger = logger
        self._interval = interval_s
        self._next = 0.0
        self._suppressed = 0

    def warning(self, fmt: str, *args: Any) -> None:
        self._log(logging.WARNING, fmt, args, exc_info=False)

    def exception(self, fmt: str, *args: Any) -> None:
        """An error with the traceback being handled (one every interval, like warnings)."""
        self._log(logging.ERROR, fmt, args, exc_info=True)

    def _log(self, level: int, fmt: str, args: tuple[Any, ...], exc_info: bool) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        if self._suppressed:
            fmt += f" (and {self._suppressed} more since the last report)"
        self._logger.log(level, fmt, *args, exc_info=exc_info)
        self._next = now + self._interval
        self._suppressed = 0
