"""`apex bench flood`: a real learner and one honest actor under hostile floods (issue 12).

A real `apex learner` (the embedded CartPole Ape-X run, every environment exploring with
epsilon 1: see ``OVERRIDES``) and one `apex actor` run, from the moment the replay is full,
through phases of ``seconds`` each: unloaded, one phase per attack, unloaded again, and
every attack at once:

    hello flood          2 DEALER peers on the control port sending well-formed hellos as
                         fast as non-blocking sends allow, reading every reply
    control garbage      2 DEALER peers on the control port sending random frames, frames
                         that start like a header, and hellos with out-of-range fields
    trajectory garbage   10 PUSH peers on the trajectory port sending random frames and
                         well-formed batches with made-up session tokens
    all at once          the 14 peers above together; at its end the learner gets SIGTERM

On a machine with two or more CPUs the learner and the actor share the first allowed CPU and
all the flooders of a phase (one process, a loop over their sockets) the second one, in every
phase, the unloaded ones included: otherwise the flooders would take CPU time from the
learner and the actor, and the figures would measure the OS scheduler rather than apex.
With one CPU nothing is pinned (the output says so) and the figures mean less.

Each phase is measured from the learner's metrics.jsonl (a row every 0.5 s) after its first
``SKIP_S`` seconds: updates/s and env steps/s (the honest actor is the only sender whose
batches count) as the change of their counters over the time between two rows, and their
ratio to the baseline, the mean of the two unloaded phases (on a 2-core VM two unloaded
phases of one run differed by up to 18%: one alone is a noisy yardstick); refused messages by reason over
the whole phase; the learner's RSS; the CPU time of learner, actor and flooders. After a
flood's senders are gone, what they left in the kernel's socket buffers still arrives: the
next phase starts once the learner has refused the last of it (``refused after``, with the
seconds that took). It fails (exit 2) when an attack phase keeps less than ``MIN_RATIO`` of
the unloaded updates/s or env steps/s, when the learner takes more than ``SIGTERM_LIMIT_S``
from SIGTERM to its exit under the full flood (its final checkpoint included), when it does
not exit 0, or when a flood was not refused at all (it never reached the learner: a broken
benchmark).

``apex.bench.flood_processes`` starts, pins and stops the processes and reads the learner's
metrics; ``apex.bench.flood_report`` turns the phases into figures and the verdict.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from apex import config as config_module
from apex.bench.e2e import cpu_seconds, memory_mb
from apex.bench.flood_processes import (
    drain,
    last_row,
    pick_cpus,
    spawn,
    start_flooder,
    stop_flooder,
    tail,
    time_sigterm,
    wait_for_replay,
)
from apex.bench.flood_report import phase_row, report
from apex.bench.flooder import CONTROL_GARBAGE, HELLO, TRAJECTORY_GARBAGE
from apex.bench.transport import free_base_port

SKIP_S = 2.0  # start of each phase left out of its rates (flooders connecting, queues filling or draining)
METRICS_INTERVAL_S = 0.5
# Every environment explores with epsilon 1 (and none is set aside for evaluation), so that the
# workload does not change as the agent learns: with the default ladder an unloaded run's
# updates/s went from 110 to 175 and back to 140 within 100 s as CartPole's episodes grew
# from ~20 to 500 steps (fewer resets) and shrank again, more than any flood moved them.
OVERRIDES = (f"learner.metrics_interval_s={METRICS_INTERVAL_S}", "apex_dqn.eps_base=1.0", "apex_dqn.eval_envs=0")

PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("unloaded", ()),
    ("hello flood", (HELLO,)),
    ("control garbage", (CONTROL_GARBAGE,)),
    ("trajectory garbage", (TRAJECTORY_GARBAGE,)),
    ("unloaded again", ()),
    ("all at once", (HELLO, CONTROL_GARBAGE, TRAJECTORY_GARBAGE)),
)


def run(seconds: float = 15.0) -> dict[str, Any]:
    """Runs every phase for ``seconds``; returns the figures and the verdict."""
    seconds = max(seconds, SKIP_S + 2.0)
    cpus, pinning = pick_cpus()
    with tempfile.TemporaryDirectory(prefix="apex-flood-") as tmp:
        bench = _FloodRun(Path(tmp), cpus, seconds)
        try:
            # Measured from a full replay on: until then the learner's memory grows anyway.
            capacity = config_module.load(None, []).apex_dqn.replay.capacity
            wait_for_replay(bench.learner, bench.logdir, bench.workdir / "learner.log", capacity, timeout=180)
            for name, kinds in PHASES:
                bench.phase(name, kinds)
        finally:
            bench.kill()
    return report(bench.rows, seconds, pinning, bench.sigterm, bench.learner.returncode, SKIP_S, OVERRIDES)


class _FloodRun:
    """The learner, the honest actor and a phase's flooder, and what the phases measured."""

    def __init__(self, workdir: Path, cpus: tuple[int, int] | None, seconds: float) -> None:
        """Starts the learner and the actor."""
        self.workdir = workdir
        self.logdir = workdir / "run"
        self.seconds = seconds
        self.port = free_base_port()
        self.apex_cpu: int | None = cpus[0] if cpus else None
        self.flood_cpu: int | None = cpus[1] if cpus else None
        self.rows: list[dict[str, Any]] = []
        self.sigterm: dict[str, float | None] = {}
        self.flooder: subprocess.Popen[bytes] | None = None
        budget = len(PHASES) * seconds + 180  # --stop-seconds: a learner this bench lost stops by itself
        sets = [arg for item in OVERRIDES for arg in ("--set", item)]
        self.learner = spawn(
            [
                "-m",
                "apex",
                "learner",
                "--logdir",
                str(self.logdir),
                "--port",
                str(self.port),
                "--stop-seconds",
                str(budget),
                *sets,
            ],
            workdir / "learner.log",
            self.apex_cpu,
        )
        self.actor = spawn(
            ["-m", "apex", "actor", "--learner", f"127.0.0.1:{self.port}", "--actor-index", "0"],
            workdir / "actor.log",
            self.apex_cpu,
        )

    def phase(self, name: str, kinds: tuple[str, ...]) -> None:
        """One phase with the flooders of ``kinds``: measured after its first ``SKIP_S``; the
        last one ends with SIGTERM to the learner."""
        self.flooder = start_flooder(self.port, kinds, self.flood_cpu, self.workdir) if kinds else None
        before = last_row(self.logdir)
        pids = [self.learner.pid, self.actor.pid] + ([self.flooder.pid] if self.flooder else [])
        cpu0, t0 = [cpu_seconds(p) for p in pids], time.monotonic()
        time.sleep(SKIP_S)
        first = last_row(self.logdir)
        time.sleep(self.seconds - SKIP_S)
        last = last_row(self.logdir)
        cpu = [100 * (cpu_seconds(p) - c) / (time.monotonic() - t0) for p, c in zip(pids, cpu0)]
        rss = memory_mb(self.learner.pid, "VmRSS")
        if name == PHASES[-1][0]:  # under the full flood: how long from SIGTERM to exit
            self.sigterm = time_sigterm(self.learner, self.actor, self.logdir)
        sent = stop_flooder(self.flooder) if self.flooder else None
        self.flooder = None
        row = phase_row(name, kinds, before, first, last, cpu, rss, sent)
        if kinds and not self.sigterm:
            row["drain_s"], row["refused_after_flood"] = drain(self.logdir, last, METRICS_INTERVAL_S)
        self.rows.append(row)
        for proc, what in ((self.learner, "learner"), (self.actor, "actor")):
            if proc.poll() is not None and not self.sigterm:
                raise RuntimeError(
                    f"the {what} exited with {proc.returncode} during the {name!r} phase: "
                    f"{tail(self.workdir / f'{what}.log')}"
                )

    def kill(self) -> None:
        """Kills what is still running."""
        for p in [self.flooder, self.actor, self.learner]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
