"""SIGTERM and SIGINT as every apex process takes them (learner, actor, `apex serve`,
`apex run`): recorded, never raised, so that each loop stops at a point of its own choosing
(a checkpoint written, actors told, sockets closed) and exits 0, or 130 after Ctrl-C."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import TypeAlias

    # What signal.signal takes and returns.
    Handler: TypeAlias = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """A context that records SIGTERM and SIGINT while it is open (handlers restored after).

    ``then`` runs in the handler too (e.g. setting an Event that threads wait on). Outside
    the main thread no handler can be set (apex.train in a notebook's worker thread): Ctrl-C
    is then not ours to catch, and nothing is recorded.
    """

    def __init__(self, then: Callable[[], None] | None = None) -> None:
        self.signum: int | None = None
        self._then = then
        self._previous: dict[int, Handler] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._record) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _record(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = signum
        if self._then is not None:
            self._then()

    @property
    def received(self) -> bool:
        return self.signum is not None

    def take(self) -> int | None:
        """The signal received (None if none), forgotten: the next one is recorded anew."""
        signum, self.signum = self.signum, None
        return signum

    def reason(self) -> str:
        """e.g. "signal SIGTERM" (the stop reason that run output reports)."""
        return f"signal {signal.Signals(self.signum).name}" if self.signum is not None else "no signal"

    def exit_code(self) -> int:
        return 130 if self.signum == signal.SIGINT else 0
