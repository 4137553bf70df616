"""`apex bench e2e`: a real learner and real actor processes, for each actor count.

Each run starts `apex learner` and N `apex actor` processes on this machine, lets them run
for ``seconds``, and reports the second half of the run (after start-up): env steps/s,
learner updates/s and samples/s, policy lag from metrics.jsonl, and CPU use and peak RSS
per process kind from /proc. The table shows how throughput scales with actors.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import psutil

from apex import config as config_module
from apex.bench.timing import print_table
from apex.bench.transport import free_base_port

DEFAULT_ACTORS = (1, 2, 4)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def memory_mb(pid: int, key: str = "VmHWM") -> float | None:
    """A memory figure of a process (VmHWM: peak RSS; VmRSS: now), or None once it is gone.
    The peak comes from /proc/PID/status: psutil has no peak resident size on Linux."""
    try:
        if key == "VmRSS":
            return psutil.Process(pid).memory_info().rss / 2**20
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except (OSError, psutil.NoSuchProcess):
        return None
    return None


def spawn_apex(args: list[str], stderr: int | IO[Any] | None = subprocess.PIPE) -> subprocess.Popen[bytes]:
    """`apex ARGS...` as a child process with its output discarded and stderr to ``stderr``."""
    return subprocess.Popen([sys.executable, "-m", "apex", *args], stdout=subprocess.DEVNULL, stderr=stderr)


def run(
    seconds: float = 20.0,
    algo: str = "apex_dqn",
    env: str | None = None,
    actors: tuple[int, ...] = DEFAULT_ACTORS,
    plot: str | None = None,
) -> dict[str, Any]:
    seconds = max(seconds, 4.0)  # half of it is start-up; shorter runs measure nothing
    config = config_module.load(None, [f"algo={algo}"] + ([f"env.id={env}"] if env else []))
    rows = []
    with tempfile.TemporaryDirectory(prefix="apex-e2e-") as tmp:
        workdir = Path(tmp)
        for n in actors:
            config_file = workdir / f"config-{n}.yaml"
            config.save(config_file)
            rows.append(_measure_processes(config_file, n, seconds, workdir))
    print_table(
        f"e2e: {config.algo} on {config.env.id}, learner + N actor processes "
        f"({seconds:g} s each, second half measured)",
        [
            "actors",
            "env steps/s",
            "updates/s",
            "samples/s",
            "policy lag",
            "learner CPU %",
            "actor CPU % each",
            "learner peak MB",
            "actor peak MB",
        ],
        [
            [
                r["actors"],
                r["env_steps_per_s"],
                r["updates_per_s"],
                r["samples_per_s"],
                r["policy_lag_mean"],
                r["learner_cpu_percent"],
                r["actor_cpu_percent_each"],
                r["learner_peak_rss_mb"],
                r["actor_peak_rss_mb"],
            ]
            for r in rows
        ],
    )
    if plot:
        _plot(rows, plot, f"{config.algo} on {config.env.id}")
        print(f"wrote {plot}")
    return {
        "baseline": "the same run with one actor (the first row)",
        "algo": config.algo,
        "env": config.env.id,
        "seconds": seconds,
        "results": rows,
    }


def _measure_processes(config_file: Path, actors: int, seconds: float, workdir: Path) -> dict[str, Any]:
    """Runs learner + actors, sampling CPU time and peak RSS over the second half."""
    port = free_base_port()
    logdir = workdir / f"actors-{actors}"
    learner = spawn_apex(
        [
            "learner",
            "--config",
            str(config_file),
            "--logdir",
            str(logdir),
            "--bind-host",
            "127.0.0.1",
            "--port",
            str(port),
            "--stop-seconds",
            str(seconds),
            "--set",
            "learner.metrics_interval_s=1",
        ]
    )
    procs = [
        spawn_apex(["actor", "--learner", f"127.0.0.1:{port}", "--config", str(config_file)]) for _ in range(actors)
    ]
    try:
        time.sleep(seconds / 2)
        cpu0 = [cpu_seconds(p.pid) for p in [learner, *procs]]
        t0 = time.monotonic()
        time.sleep(max(seconds / 2 - 1, 1.0))
        cpu1 = [cpu_seconds(p.pid) for p in [learner, *procs]]
        peaks = [memory_mb(p.pid) or 0.0 for p in [learner, *procs]]
        elapsed = time.monotonic() - t0
        learner.wait(timeout=120)
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in [learner, *procs]:
            if p.poll() is None:
                p.kill()
                p.wait()
    if learner.returncode != 0:
        said = learner.stderr.read().decode()[-2000:] if learner.stderr is not None else ""
        raise RuntimeError(f"the learner exited with {learner.returncode}: {said}")
    cpu = [100 * (b - a) / elapsed for a, b in zip(cpu0, cpu1)]
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if seconds / 2 <= r["time"] <= seconds - 1] or rows[-2:-1]

    def mean(key: str) -> float:
        return sum(r[key] or 0 for r in steady) / len(steady)

    return {
        "actors": actors,
        "env_steps_per_s": round(mean("env_steps_per_s")),
        "updates_per_s": round(mean("updates_per_s"), 1),
        "samples_per_s": round(mean("samples_per_s")),
        "policy_lag_mean": round(mean("policy_lag_mean"), 1),
        "return_mean_100": json.loads((logdir / "summary.json").read_text())["return_mean_100"],
        "learner_cpu_percent": round(cpu[0]),
        "actor_cpu_percent_each": round(sum(cpu[1:]) / actors),
        "learner_peak_rss_mb": round(peaks[0]),
        "actor_peak_rss_mb": round(max(peaks[1:])),
    }


def _plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("apex bench e2e --plot needs matplotlib: pip install 'apex-rl[plot]'") from None
    actors = [r["actors"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(actors, [r["env_steps_per_s"] for r in rows], "o-")
    left.set(xlabel="actor processes", ylabel="env steps/s", title="actors")
    right.plot(actors, [r["samples_per_s"] for r in rows], "o-", color="tab:orange")
    right.set(xlabel="actor processes", ylabel="samples/s", title="learner")
    for axis in (left, right):
        axis.set_xticks(actors)
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
