"""`apex run`: a learner and N actors as separate OS processes on this machine, supervised.

Actors that die are restarted (with a growing delay if they keep dying); when the learner
exits, for a stop condition or otherwise, the actors are stopped and `apex run` exits with
the learner's code. Children get their own session, so Ctrl-C reaches only this process,
which then stops the learner cleanly; and they are told by the kernel to terminate should
this process die, so that nothing is left behind.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from apex.config import Config
from apex.learner import StopConditions

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "apex", *args],
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )


def stop_args(stop: StopConditions) -> list[str]:
    args = []
    if stop.return_mean is not None:
        args += ["--stop-return", str(stop.return_mean)]
    if stop.seconds is not None:
        args += ["--stop-seconds", str(stop.seconds)]
    if stop.env_steps is not None:
        args += ["--stop-env-steps", str(stop.env_steps)]
    return args


def run(config: Config, actors: int, logdir: Path, stop: StopConditions, port: int) -> int:
    """Runs learner + actors until the learner exits; returns the learner's exit code."""
    logdir.mkdir(parents=True, exist_ok=True)
    config_file = logdir / "config.yaml"
    config_file.write_text(yaml.safe_dump(config.to_dict(), sort_keys=False))
    learner = _spawn(["learner", "--config", str(config_file), "--logdir", str(logdir),
                      "--bind-host", "127.0.0.1", "--port", str(port), *stop_args(stop)])
    actor_args = [["actor", "--learner", f"127.0.0.1:{port}", "--actor-index", str(i), "--config", str(config_file)]
                  for i in range(actors)]
    procs = [_spawn(args) for args in actor_args]
    restarts = [0] * actors
    restart_at = [0.0] * actors
    interrupted = {"signal": None}

    def on_signal(signum, _frame):
        interrupted["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while learner.poll() is None:
            if interrupted["signal"] is not None:
                learner.send_signal(interrupted["signal"])  # the learner stops its actors and exits
                interrupted["signal"] = None
            now = time.monotonic()
            for i, proc in enumerate(procs):
                if proc.poll() is None or proc.returncode == 0:  # 0: it was told to stop
                    continue
                if restart_at[i] == 0.0:
                    delay = min(30.0, 0.5 * 2 ** restarts[i])
                    log.warning("actor %d exited with %s; restarting in %.1fs", i, proc.returncode, delay)
                    restart_at[i] = now + delay
                elif now >= restart_at[i]:
                    procs[i] = _spawn(actor_args[i])
                    restarts[i] += 1
                    restart_at[i] = 0.0
            time.sleep(0.2)
        return learner.returncode
    finally:
        for proc in [learner, *procs]:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in [learner, *procs]:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
