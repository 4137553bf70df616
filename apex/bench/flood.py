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
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from apex import config as config_module
from apex.bench.e2e import cpu_seconds, memory_mb
from apex.bench.flooder import CONTROL_GARBAGE, CONTROL_PEERS, HELLO, TRAJECTORY_GARBAGE, TRAJECTORY_PEERS
from apex.bench.timing import print_table
from apex.bench.transport import free_base_port

MIN_RATIO = 0.5
SIGTERM_LIMIT_S = 2.0  # "the learner acts on SIGTERM within 2 s under any flood"
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
# `python -c PIN CPU ARGS...`: pins itself to CPU, then becomes `python ARGS...` (same pid).
PIN = (
    "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); "
    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])"
)
PEERS = {
    HELLO: f"{CONTROL_PEERS} control",
    CONTROL_GARBAGE: f"{CONTROL_PEERS} control",
    TRAJECTORY_GARBAGE: f"{TRAJECTORY_PEERS} trajectory",
}


def run(seconds: float = 15.0) -> dict[str, Any]:
    """Runs every phase for ``seconds``; returns the figures and the verdict."""
    seconds = max(seconds, SKIP_S + 2.0)
    cpus, pinning = _pick_cpus()
    apex_cpu, flood_cpu = cpus if cpus else (None, None)
    rows: list[dict[str, Any]] = []
    sigterm: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="apex-flood-") as tmp:
        workdir = Path(tmp)
        logdir, port = workdir / "run", free_base_port()
        learner_log = workdir / "learner.log"
        budget = len(PHASES) * seconds + 180  # --stop-seconds: a learner this bench lost stops by itself
        sets = [arg for item in OVERRIDES for arg in ("--set", item)]
        learner = _spawn(
            [
                "-m",
                "apex",
                "learner",
                "--logdir",
                str(logdir),
                "--port",
                str(port),
                "--stop-seconds",
                str(budget),
                *sets,
            ],
            learner_log,
            apex_cpu,
        )
        actor = _spawn(
            ["-m", "apex", "actor", "--learner", f"127.0.0.1:{port}", "--actor-index", "0"],
            workdir / "actor.log",
            apex_cpu,
        )
        flooder: subprocess.Popen[bytes] | None = None
        try:
            # Measured from a full replay on: until then the learner's memory grows anyway.
            capacity = config_module.load(None, []).apex_dqn.replay.capacity
            _wait_for_replay(learner, logdir, learner_log, capacity, timeout=180)
            for name, kinds in PHASES:
                flooder = _start_flooder(port, kinds, flood_cpu, workdir) if kinds else None
                before = _last_row(logdir)
                pids = [learner.pid, actor.pid] + ([flooder.pid] if flooder else [])
                cpu0, t0 = [cpu_seconds(p) for p in pids], time.monotonic()
                time.sleep(SKIP_S)
                first = _last_row(logdir)
                time.sleep(seconds - SKIP_S)
                last = _last_row(logdir)
                cpu = [100 * (cpu_seconds(p) - c) / (time.monotonic() - t0) for p, c in zip(pids, cpu0)]
                rss = memory_mb(learner.pid, "VmRSS")
                if name == PHASES[-1][0]:  # under the full flood: how long from SIGTERM to exit
                    sigterm = _sigterm(learner, actor, logdir)
                sent = _stop_flooder(flooder) if flooder else None
                flooder = None
                row = _phase_row(name, kinds, before, first, last, cpu, rss, sent)
                if kinds and not sigterm:
                    row["drain_s"], row["refused_after_flood"] = _drain(logdir, last)
                rows.append(row)
                for proc, what in ((learner, "learner"), (actor, "actor")):
                    if proc.poll() is not None and not sigterm:
                        raise RuntimeError(
                            f"the {what} exited with {proc.returncode} during the {name!r} phase: "
                            f"{_tail(workdir / f'{what}.log')}"
                        )
        finally:
            for p in [flooder, actor, learner]:
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
    return _report(rows, seconds, pinning, sigterm, learner.returncode)


# -- the processes


def _pick_cpus() -> tuple[tuple[int, int] | None, str]:
    """(CPU for learner and actor, CPU for the flooders), or None; and the pinning in words."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None, "none: this platform cannot pin processes to CPUs"
    if len(allowed) < 2:
        return None, f"none: only {len(allowed)} CPU, so flooders compete with the learner and the actor for it"
    return (allowed[0], allowed[1]), f"learner and actor on CPU {allowed[0]}, flooders on CPU {allowed[1]}"


def _spawn(args: list[str], log: Path, cpu: int | None, stdout: int | None = None) -> subprocess.Popen[bytes]:
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


def _last_row(logdir: Path) -> dict[str, Any]:
    rows = _rows(logdir)
    return rows[-1] if rows else {}


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _wait_for_replay(learner: subprocess.Popen[bytes], logdir: Path, log: Path, capacity: int, timeout: float) -> None:
    """Waits until the learner trains with a full replay."""
    deadline = time.monotonic() + timeout
    while (row := _last_row(logdir)).get("learner_updates", 0) == 0 or row.get("replay_size", 0) < capacity:
        if learner.poll() is not None:
            raise RuntimeError(f"the learner exited with {learner.returncode} before training: {_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the learner did not train with a full replay ({capacity}) within {timeout:g} s: {row}; {_tail(log)}"
            )
        time.sleep(0.2)


def _start_flooder(port: int, kinds: tuple[str, ...], cpu: int | None, workdir: Path) -> subprocess.Popen[bytes]:
    """The flooders of a phase, one process; returns once it has called connect() on every
    socket (ZeroMQ connects in the background)."""
    proc = _spawn(["-m", "apex.bench.flooder", str(port), *kinds], workdir / "flooder.log", cpu, stdout=subprocess.PIPE)
    line = proc.stdout.readline() if proc.stdout is not None else b""  # (a pipe: stdout=PIPE)
    if not line.startswith(b"ready"):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the flooder did not start: {_tail(workdir / 'flooder.log')}")
    return proc


def _stop_flooder(proc: subprocess.Popen[bytes]) -> dict[str, Any]:
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


def _drain(logdir: Path, last: dict[str, Any], timeout: float = 60.0) -> tuple[float, int]:
    """Waits until the learner has refused the last of a flood whose senders are gone (what
    they queued in the kernel's socket buffers still arrives) before the next phase starts:
    until ``rejected_messages`` has not grown for a second. Returns the seconds that took
    and the messages refused meanwhile."""
    start = time.monotonic()
    count, still = _last_row(logdir).get("rejected_messages", 0), time.monotonic()
    while time.monotonic() - still < 1.0 + METRICS_INTERVAL_S and time.monotonic() - start < timeout:
        time.sleep(METRICS_INTERVAL_S / 2)
        now = _last_row(logdir).get("rejected_messages", 0)
        if now != count:
            count, still = now, time.monotonic()
    return round(still - start, 1), count - last.get("rejected_messages", 0)


def _sigterm(learner: subprocess.Popen[bytes], actor: subprocess.Popen[bytes], logdir: Path) -> dict[str, float | None]:
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


# -- the figures


def _rate(first: dict[str, Any], last: dict[str, Any], key: str) -> float | None:
    elapsed = last.get("time", 0) - first.get("time", 0)
    if elapsed <= 0:
        return None
    rate: float = (last.get(key, 0) - first.get(key, 0)) / elapsed
    return rate


def _phase_row(
    name: str,
    kinds: tuple[str, ...],
    before: dict[str, Any],
    first: dict[str, Any],
    last: dict[str, Any],
    cpu: list[float],
    rss: float | None,
    sent: dict[str, Any] | None,
) -> dict[str, Any]:
    reasons_before = before.get("rejected_by_reason", {})
    reasons = {
        reason: count - reasons_before.get(reason, 0)
        for reason, count in last.get("rejected_by_reason", {}).items()
        if count - reasons_before.get(reason, 0) > 0
    }
    updates, steps = _rate(first, last, "learner_updates"), _rate(first, last, "env_steps")
    flood_s = (sent or {}).get("seconds") or 0
    return {
        "phase": name,
        "flooders": ", ".join(f"{PEERS[k]} {k.replace('_', ' ')}" for k in kinds) or "none",
        "measured_s": round(last.get("time", 0) - first.get("time", 0), 2),
        "updates_per_s": None if updates is None else round(updates, 1),
        "env_steps_per_s": None if steps is None else round(steps, 1),
        "rejected_messages": last.get("rejected_messages", 0) - before.get("rejected_messages", 0),
        "rejected_by_reason": reasons,
        "flood_messages_sent": (sent or {}).get("sent", 0),
        "flood_msgs_per_s": round((sent or {}).get("sent", 0) / flood_s) if flood_s else 0,
        "flood_replies_received": (sent or {}).get("replies", 0),
        "learner_cpu_percent": round(cpu[0]),
        "actor_cpu_percent": round(cpu[1]),
        "flooder_cpu_percent": round(cpu[2]) if len(cpu) > 2 else 0,
        "learner_rss_mb": None if rss is None else round(rss, 1),
        "actors_connected": last.get("actors_connected"),
    }


def _report(
    rows: list[dict[str, Any]], seconds: float, pinning: str, sigterm: dict[str, Any], learner_exit: int | None
) -> dict[str, Any]:
    unloaded = [r for r in rows if r["flooders"] == "none"]
    base = {key: _mean([r[key] for r in unloaded]) for key in ("updates_per_s", "env_steps_per_s")}
    problems = []
    for row in rows:
        attacked = row["flooders"] != "none"
        for key, ratio_key in (("updates_per_s", "updates_ratio"), ("env_steps_per_s", "env_steps_ratio")):
            ok = bool(base[key]) and row[key] is not None
            row[ratio_key] = round(row[key] / base[key], 3) if ok else None
            if attacked and (row[ratio_key] is None or row[ratio_key] < MIN_RATIO):
                problems.append(
                    f"{row['phase']}: {key} {row[key]} is {_percent(row[ratio_key])} of the unloaded "
                    f"{base[key]:.1f} (at least {MIN_RATIO:.0%} required)"
                )
        if attacked and row["rejected_messages"] == 0:
            problems.append(f"{row['phase']}: no message refused; the flood did not reach the learner")
        row["passed"] = not attacked or not any(p.startswith(row["phase"] + ":") for p in problems)
    if not base["updates_per_s"] or not base["env_steps_per_s"]:
        problems.append("the unloaded run made no update or no env step: nothing to compare with")
    sigterm_exit_s = sigterm.get("learner")
    if sigterm_exit_s is None:
        problems.append("the learner did not exit within 60 s of SIGTERM under the full flood")
    elif sigterm_exit_s > SIGTERM_LIMIT_S:
        problems.append(
            f"the learner took {sigterm_exit_s:.2f} s from SIGTERM to its exit under the full flood "
            f"(at most {SIGTERM_LIMIT_S:g} s)"
        )
    if learner_exit not in (0, None):
        problems.append(f"the learner exited with {learner_exit} after SIGTERM")
    first, again = unloaded[0]["updates_per_s"], unloaded[-1]["updates_per_s"]
    drift = 100 * (again / first - 1) if len(unloaded) > 1 and first and again is not None else None
    print_table(
        f"flood: CartPole Ape-X learner + 1 honest actor (epsilon 1), {seconds:g} s per phase, first {SKIP_S:g} s "
        f"not measured; pinning: {pinning}",
        [
            "phase",
            "updates/s",
            "vs unloaded",
            "env steps/s",
            "vs unloaded",
            "refused",
            "refused by reason",
            "flood msgs/s",
            "refused after (s)",
            "learner / actor / flooder CPU %",
            "learner RSS MB",
            "ok",
        ],
        [
            [
                r["phase"],
                r["updates_per_s"],
                _percent(r["updates_ratio"]),
                r["env_steps_per_s"],
                _percent(r["env_steps_ratio"]),
                r["rejected_messages"],
                ", ".join(f"{k} {v:,}" for k, v in sorted(r["rejected_by_reason"].items(), key=lambda kv: -kv[1]))
                or "-",
                r["flood_msgs_per_s"],
                f"{r['refused_after_flood']:,} ({r['drain_s']:g})" if "drain_s" in r else "-",
                f"{r['learner_cpu_percent']} / {r['actor_cpu_percent']} / {r['flooder_cpu_percent']}",
                r["learner_rss_mb"],
                "-" if r["flooders"] == "none" else ("yes" if r["passed"] else "NO"),
            ]
            for r in rows
        ],
    )
    print(
        f"unloaded (the baseline, mean of the {len(unloaded)} unloaded phases): "
        f"{_number(base['updates_per_s'], '.1f')} updates/s, {_number(base['env_steps_per_s'], '.0f')} env steps/s; "
        "the second unloaded phase differs from the first by "
        f"{'-' if drift is None else f'{drift:+.0f}%'} in updates/s"
    )
    print(
        f"SIGTERM under the full flood: the learner wrote summary.json after {_seconds(sigterm.get('summary'))} and "
        f"exited after {_seconds(sigterm_exit_s)} (limit {SIGTERM_LIMIT_S:g} s; exit code {learner_exit}); "
        f"the honest actor exited after {_seconds(sigterm.get('actor'))}"
    )
    print("passed" if not problems else "FAILED: " + "; ".join(problems))
    return {
        "baseline": "the unloaded phases (mean of the one before and the one after the single attacks)",
        "seconds": seconds,
        "skip_s": SKIP_S,
        "pinning": pinning,
        "overrides": list(OVERRIDES),
        "min_ratio": MIN_RATIO,
        "unloaded_updates_per_s": None if base["updates_per_s"] is None else round(base["updates_per_s"], 1),
        "unloaded_env_steps_per_s": None if base["env_steps_per_s"] is None else round(base["env_steps_per_s"], 1),
        "unloaded_drift_percent": None if drift is None else round(drift, 1),
        "results": rows,
        "sigterm_exit_s": sigterm_exit_s,
        "sigterm_summary_s": sigterm.get("summary"),
        "sigterm_actor_exit_s": sigterm.get("actor"),
        "sigterm_limit_s": SIGTERM_LIMIT_S,
        "learner_exit": learner_exit,
        "passed": not problems,
        "problems": problems,
    }


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _percent(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.0%}"


# -- the flooder process: `python -m apex.bench.flood PORT KIND...`
