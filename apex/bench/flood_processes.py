"""The processes of `apex bench flood` (``apex.bench.flood``): which CPUs they are pinned to,
starting them, reading the learner's metrics.jsonl, the flooder's start and stop, waiting
for a flood's leftovers to be refused, and timing the learner's exit on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# `python -c PIN CPU ARGS...`: pins itself to CPU, then becomes `python ARGS...` (same pid).
PIN = (
    "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); "
    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])"
)


def pick_cpus() -> tuple[tuple[int, int] | None, str]:
    """(CPU for learner and actor, CPU for the flooders), or None; and the pinning in words."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None, "none: this platform cannot pin processes to CPUs"
    if len(allowed) < 2:
        return None, f"none: only {len(allowed)} CPU, so flooders compete with the learner and the actor for it"
    return (allowed[0], allowed[1]), f"learner and actor on CPU {allowed[0]}, flooders on CPU {allowed[1]}"


def spawn(args: list[str], log: Path, cpu: int | None, stdout: int | None = None) -> subprocess.Popen[bytes]:
    """``python ARGS...`` pinned to ``cpu`` before it starts (every thread it starts inherits
    that), its stderr (and stdout unless given) to ``log``: a pipe that nobody reads would
    block a learner that logs refused messages. (A small Python pins itself and execs the
    command: preexec_fn is unsafe in a process with threads, as this one may have.)"""
    if cpu is not None:
        args = ["-c", PIN, str(cpu), *args]
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, *args], stdout=stdout or f, stderr=f)


def _rows(logdir: Path) -> list[dict[str, Any]]:
    try:
        lines = (logdir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return rows


def last_row(logdir: Path) -> dict[str, Any]:
    rows = _rows(logdir)
    return rows[-1] if rows else {}


def tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_for_replay(learner: subprocess.Popen[bytes], logdir: Path, log: Path, capacity: int, timeout: float) -> None:
    """Waits until the learner trains with a full replay."""
    deadline = time.monotonic() + timeout
    while (row := last_row(logdir)).get("learner_updates", 0) == 0 or row.get("replay_size", 0) < capacity:
        if learner.poll() is not None:
            raise RuntimeError(f"the learner exited with {learner.returncode} before training: {tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the learner did not train with a full replay ({capacity}) within {timeout:g} s: {row}; {tail(log)}"
            )
        time.sleep(0.2)


def start_flooder(port: int, kinds: tuple[str, ...], cpu: int | None, workdir: Path) -> subprocess.Popen[bytes]:
    """The flooders of a phase, one process; returns once it has called connect() on every
    socket (ZeroMQ connects in the background)."""
    proc = spawn(["-m", "apex.bench.flooder", str(port), *kinds], workdir / "flooder.log", cpu, stdout=subprocess.PIPE)
    line = proc.stdout.readline() if proc.stdout is not None else b""  # (a pipe: stdout=PIPE)
    if not line.startswith(b"ready"):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the flooder did not start: {tail(workdir / 'flooder.log')}")
    return proc


def stop_flooder(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
    """Stops a flooder; returns what it sent (its last line on stdout)."""
    proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {}
    try:
        sent: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}
    return sent


def drain(logdir: Path, last: dict[str, Any], interval: float, timeout: float = 60.0) -> tuple[float, int]:
    """Waits until the learner has refused the last of a flood whose senders are gone (what
    they queued in the kernel's socket buffers still arrives) before the next phase starts:
    until ``rejected_messages`` has not grown for a second. ``interval``: how often the
    learner writes a metrics row. Returns the seconds that took and the messages refused
    meanwhile."""
    start = time.monotonic()
    count, still = last_row(logdir).get("rejected_messages", 0), time.monotonic()
    while time.monotonic() - still < 1.0 + interval and time.monotonic() - start < timeout:
        time.sleep(interval / 2)
        now = last_row(logdir).get("rejected_messages", 0)
        if now != count:
            count, still = now, time.monotonic()
    return round(still - start, 1), count - last.get("rejected_messages", 0)


def time_sigterm(
    learner: subprocess.Popen[bytes], actor: subprocess.Popen[bytes], logdir: Path
) -> dict[str, float | None]:
    """Sends the learner SIGTERM; seconds until it wrote summary.json (it has stopped
    training, told its actors and written its final checkpoint), until it exited, and until
    the honest actor (told to stop by it) exited; None for what did not happen in 60 s."""
    summary = logdir / "summary.json"
    learner.send_signal(signal.SIGTERM)
    start = time.monotonic()
    times: dict[str, float | None] = {"summary": None, "learner": None, "actor": None}
    while None in times.values() and time.monotonic() - start < 60:
        elapsed = time.monotonic() - start
        for key, done in (
            ("summary", summary.exists),
            ("learner", lambda: learner.poll() is not None),
            ("actor", lambda: actor.poll() is not None),
        ):
            if times[key] is None and done():
                times[key] = round(elapsed, 2)
        time.sleep(0.01)
    return times
