"""apex processes started the way a user starts them, waited for, and cleaned up after."""

from __future__ import annotations

import subprocess
import sys
import time


def apex(*args: str, **kwargs) -> subprocess.Popen:
    options = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs}
    return subprocess.Popen([sys.executable, "-m", "apex", *args], **options)


def rss_mib(pid: int) -> float:
    """A process's resident memory, MiB (Linux)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def kill_leftovers(procs: list[subprocess.Popen]) -> None:
    """Kills and reaps the processes still running (when a test failed half way)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def processes_mentioning(text: str) -> list[str]:
    out = subprocess.run(["pgrep", "-af", text], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "pgrep" not in line]
