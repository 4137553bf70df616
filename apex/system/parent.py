"""The processes `apex run` starts (learner, ranks, actors) end with it, even when it is
killed with SIGKILL and cannot stop them. Each gets SIGTERM from the kernel when its parent
dies (PR_SET_PDEATHSIG, set by `apex run` between fork and exec) and stops as on any
SIGTERM. That alone has two gaps, which a watchdog thread on the parent's pid closes: a
parent killed before the child set the signal (it is then never sent), and a child whose
main thread is stuck in a call that does not return (a hung socket, a huge final checkpoint)
and so never reaches its stop. The watchdog sends SIGTERM itself, and ends the process
GRACE_S later if it still runs: the ports are free again, and the newest periodic checkpoint
is where the run resumes.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

PARENT_ENV = "APEX_PARENT_PID"
GRACE_S = 3.0
_POLL_S = 0.5


def child_environment() -> dict[str, str]:
    """The environment of a process this one starts and that ends with it (``watch_parent``)."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


def watch_parent() -> None:
    """If this process was started by ``child_environment``'s parent, a daemon thread that
    stops it once that parent is gone (see the module's doc)."""
    raw = os.environ.pop(PARENT_ENV, "")  # not passed on: a child of this one watches this one
    if not raw.isdigit():
        return
    parent = int(raw)
    threading.Thread(target=_watch, args=(parent,), name="apex-parent-watchdog", daemon=True).start()


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    log.warning("the apex process that started this one (pid %d) is gone: stopping", parent)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    os._exit(128 + signal.SIGTERM)
