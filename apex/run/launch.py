"""`apex run`: a learner and N actors as separate OS processes on this machine, supervised.

Actors that die are restarted (with a growing delay if they keep dying). A learner that dies
is restarted from its newest checkpoint (replay included) while the actors keep their
environments and reconnect; when the learner stops for good (a stop condition, Ctrl-C, a
configuration error, or too many restarts) the actors are stopped and `apex run` exits with
the learner's code. Children get their own session, so Ctrl-C reaches only this process,
which then stops the learner cleanly; and they are told by the kernel to terminate should
this process die, so that nothing is left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from apex.checkpoint import has_checkpoint
from apex.config import Config, StopConditions, port_problem
from apex.errors import ApexError
from apex.system.parent import child_environment
from apex.system.signals import StopSignals
from apex.transport import DEFAULT_PORT

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
# Learner exits that are not restarted: done (0), a usage or configuration error (2, it would
# fail again), interrupted by the user (130).
_FINAL_EXITS = (0, 2, 130)
_HEALTHY_S = 300.0  # a learner that ran this long before dying starts a fresh count of restarts
_SUPERVISE_S = 0.2  # how often `apex run` looks at its processes
# Restarts wait FIRST * 2**n seconds (the n-th restart), at most _RESTART_MAX_S.
_LEARNER_RESTART_FIRST_S = 2.0
_ACTOR_RESTART_FIRST_S = 0.5
_RESTART_MAX_S = 30.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "apex", *args],
        env=child_environment(),
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
    )


def default_logdir(config: Config) -> Path:
    """runs/<time>-<env>, for a run not given a --logdir (or logdir=)."""
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{config.env.id.replace('/', '-').replace(':', '-')}"


def stop_args(stop: StopConditions) -> list[str]:
    args = []
    if stop.return_mean is not None:
        args += ["--stop-return", str(stop.return_mean)]
    if stop.seconds is not None:
        args += ["--stop-seconds", str(stop.seconds)]
    if stop.env_steps is not None:
        args += ["--stop-env-steps", str(stop.env_steps)]
    return args


def check_ports_free(port: int, ranks: int = 1) -> None:
    """Fails at once, not after the learner's start-up, if its ports are taken (a group of
    ``ranks`` learners: P+3 .. P+2+ranks too)."""
    for p in range(port, port + 3 + (ranks if ranks > 1 else 0)):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ binds
            try:
                probe.bind(("127.0.0.1", p))
            except OSError as e:
                raise ApexError(
                    f"port {p} on 127.0.0.1 is taken ({e.strerror}): is another learner using ports "
                    f"{port}-{port + 2}{' or its ranks' if ranks > 1 else ''}? pick another with --port"
                ) from None


def run(
    config: Config,
    actors: int,
    logdir: Path,
    stop: StopConditions,
    port: int,
    *,
    resume: bool = False,
    learner_restarts: int = 10,
    on_tick: Callable[[], None] | None = None,
    ranks: int = 1,
) -> int:
    """Runs learner + actors until the learner exits for good; returns its exit code.

    A learner that dies (a non-zero exit other than a usage error or an interrupt) is
    started again, from its newest checkpoint when there is one, up to ``learner_restarts``
    times in a row (a learner that ran for 5 minutes starts the count afresh); the actors stay
    up meanwhile and reconnect by themselves.
    """
    check_ports_free(port, ranks)
    logdir.mkdir(parents=True, exist_ok=True)
    config_file = logdir / "config.yaml"
    config.save(config_file)
    learner_args = _learner_args(config_file, logdir, port, stop, actors, learner_restarts, ranks)
    # The run's config file is each actor's own: it may import what that names, and nothing
    # else a welcome may name (whoever holds the port answers their hellos: apex.config.trust).
    actor_args = [
        ["actor", "--learner", f"127.0.0.1:{port}", "--actor-index", str(i), "--config", str(config_file)]
        for i in range(actors)
    ]
    supervisor = _Supervisor(learner_args, actor_args, logdir, resume, learner_restarts)
    with StopSignals() as signals:
        try:
            while (code := supervisor.tick(signals)) is None:
                if on_tick is not None:
                    on_tick()
                time.sleep(_SUPERVISE_S)
            return code
        finally:
            supervisor.stop()


def _learner_args(
    config_file: Path, logdir: Path, port: int, stop: StopConditions, actors: int, learner_restarts: int, ranks: int
) -> list[str]:
    """`apex learner`'s arguments, with the command that resumes the whole run."""
    resume_command = shlex.join(
        [
            "apex",
            "run",
            "--resume",
            str(logdir),
            "--actors",
            str(actors),
            *(["--port", str(port)] if port != DEFAULT_PORT else []),
            *stop_args(stop),
            *(["--learner-restarts", str(learner_restarts)] if learner_restarts != 10 else []),
            *(["--ranks", str(ranks)] if ranks > 1 else []),
        ]
    )
    return [
        "learner",
        "--config",
        str(config_file),
        "--logdir",
        str(logdir),
        "--bind-host",
        "127.0.0.1",
        "--port",
        str(port),
        *stop_args(stop),
        "--resume-command",
        resume_command,
        *(["--ranks", str(ranks)] if ranks > 1 else []),
    ]


class _Supervisor:
    """The learner and the actors of a run: restarts those that die (after a delay that grows
    while they keep dying) and passes signals on to the learner."""

    def __init__(
        self, learner_args: list[str], actor_args: list[list[str]], logdir: Path, resume: bool, learner_restarts: int
    ) -> None:
        """Starts the learner and the actors."""
        self.learner_args = learner_args
        self.actor_args = actor_args
        self.logdir = logdir
        self.resume = resume
        self.learner_restarts = learner_restarts  # the most in a row
        self.learner = self._start_learner()
        self.learner_started = time.monotonic()
        # Actors start with the learner, not once it listens: they import and make their
        # environments while it imports torch (vector actors never do), and their hellos wait
        # in ZeroMQ's queue. Configuration errors were caught before this (the parent checks the
        # environment and the ports), so a learner that fails now is rare and stops them all.
        self.actors = [_spawn(args) for args in actor_args]
        self.actor_restarts = [0] * len(actor_args)
        self.actor_restart_at = [0.0] * len(actor_args)
        self.learner_restarted = 0
        self.learner_restart_at = 0.0
        self.forwarded = False  # a signal was passed on to the learner: its exit is the run's end

    def _resumable(self) -> bool:
        return self.resume or has_checkpoint(self.logdir)

    def _start_learner(self) -> subprocess.Popen[bytes]:
        return _spawn([*self.learner_args, *(["--resume", str(self.logdir)] if self._resumable() else [])])

    def tick(self, signals: StopSignals) -> int | None:
        """Looks at every process once; the run's exit code once the learner has stopped for good."""
        now = time.monotonic()
        code = self._watch_learner(signals, now)
        if code is None:
            self._watch_actors(now)
        return code

    def _watch_learner(self, signals: StopSignals, now: float) -> int | None:
        """Passes a signal on to the learner; restarts it once a delay after it died, or returns
        its exit code when it stopped for good."""
        if self.learner_restart_at == 0.0 and (signum := signals.take()) is not None:
            self.learner.send_signal(signum)  # the learner stops its actors and exits
            self.forwarded = True
        if self.learner_restart_at == 0.0 and self.learner.poll() is not None:
            code = self.learner.returncode
            if now - self.learner_started > _HEALTHY_S:
                self.learner_restarted = 0  # a crash hours into a run is not a crash loop
            if code in _FINAL_EXITS or self.forwarded or self.learner_restarted >= self.learner_restarts:
                return code
            delay = min(_RESTART_MAX_S, _LEARNER_RESTART_FIRST_S * 2**self.learner_restarted)
            log.warning(
                "learner exited with %s; restarting it%s in %.0fs (restart %d of at most %d)",
                code,
                " from its newest checkpoint" if self._resumable() else "",
                delay,
                self.learner_restarted + 1,
                self.learner_restarts,
            )
            self.learner_restart_at = now + delay
        elif self.learner_restart_at and (now >= self.learner_restart_at or signals.received):
            if signals.received:  # interrupted while the learner was down
                return signals.exit_code()
            self.learner = self._start_learner()
            self.learner_started = time.monotonic()
            self.learner_restarted += 1
            self.learner_restart_at = 0.0
        return None

    def _watch_actors(self, now: float) -> None:
        """Restarts each actor that died, once its own delay is over."""
        for i, proc in enumerate(self.actors):
            if proc.poll() is None or proc.returncode == 0:  # 0: it was told to stop
                continue
            if self.actor_restart_at[i] == 0.0:
                delay = min(_RESTART_MAX_S, _ACTOR_RESTART_FIRST_S * 2 ** self.actor_restarts[i])
                log.warning("actor %d exited with %s; restarting in %.1fs", i, proc.returncode, delay)
                self.actor_restart_at[i] = now + delay
            elif now >= self.actor_restart_at[i]:
                self.actors[i] = _spawn(self.actor_args[i])
                self.actor_restarts[i] += 1
                self.actor_restart_at[i] = 0.0

    def stop(self) -> None:
        """Terminates what still runs; kills what has not exited 30 s later."""
        for proc in [self.learner, *self.actors]:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 30  # a learner writes its last checkpoint (with the replay)
        for proc in [self.learner, *self.actors]:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# A learner group's ranks that outlive a rank that died get this long to stop by themselves
# (their next collective fails at once) before they are killed.
_RANK_STOP_S = 15.0


def _without_ranks_flag(argv: list[str]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--ranks":
            skip = True
        elif not arg.startswith("--ranks="):
            out.append(arg)
    return out


def run_ranks(argv: list[str], ranks: int, port: int) -> int:
    """`apex learner --ranks N`: N learner processes on this host as one group, rank r with
    ``--rank r --world-size N --master 127.0.0.1:P+2+N``. Signals go to every rank; when a
    rank exits with an error, the others are stopped and this returns its code; otherwise
    rank 0's (the others stop when rank 0 does)."""
    if (problem := port_problem(port + 2 + ranks)) is not None:
        raise ApexError(f"--port {port} leaves no room for {ranks} ranks: {problem}")
    master = f"127.0.0.1:{port + 2 + ranks}"
    base = _without_ranks_flag(argv)
    # The group's own traffic stays on this host: gloo would listen on the host name's interface.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [_spawn([*base, "--rank", str(r), "--world-size", str(ranks), "--master", master]) for r in range(ranks)]
    failed: list[tuple[int, int]] = []
    try:
        with StopSignals() as signals:
            forwarded = False
            while True:
                codes = [p.poll() for p in procs]  # every process polled, each time
                failed = [(r, code) for r, code in enumerate(codes) if code not in (None, 0)]
                if failed or all(code is not None for code in codes):
                    break
                if signals.received and not forwarded:
                    for p in procs:
                        with contextlib.suppress(ProcessLookupError):
                            p.send_signal(signal.SIGTERM)
                    forwarded = True
                time.sleep(0.2)
            if failed and not forwarded:  # (after a signal, ranks exit 130 by design)
                log.error(
                    "learner %s: stopping the group", ", ".join(f"rank {r} exited with {code}" for r, code in failed)
                )
            if failed:
                _stop_all(procs, _RANK_STOP_S)
    finally:
        _stop_all(procs, 0.0)
    if failed:
        code = failed[0][1]
        return code if code > 0 else 1
    return procs[0].returncode


def _stop_all(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Waits up to ``grace_s`` for the processes to exit by themselves, then SIGTERM, then
    30 s (a learner writes its last checkpoint), then SIGKILL."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + 30
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
