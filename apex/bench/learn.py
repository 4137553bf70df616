"""`apex bench learn`: learning quality, measured: each task's preset trained as `apex run`
does (real processes, one run at a time) to the task's threshold, beside published figures.

For each (task, algorithm, seed) it records the wall time from the command's start to the
threshold (None if the time limit came first), the start-up (command to the learner's first
update), env steps at the stop, final and best return_mean_100, and env steps/s and
updates/s; it prints one table with the medians over seeds and the references, and can plot
return against wall time and against env steps with the threshold drawn.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from apex.bench.timing import print_table
from apex.bench.transport import free_base_port
from apex.errors import ApexError


@dataclass(frozen=True)
class Task:
    env_id: str
    threshold: float  # return_mean_100 that counts as learned
    reference: str  # a published figure to compare with, and its source


TASKS = {
    "cartpole": Task("CartPole-v1", 475.0,
                     "CleanRL DQN 488.7 at 500k steps (CleanRL benchmark, dqn.py on CartPole-v1)"),
    "acrobot": Task("Acrobot-v1", -75.0,
                    "CleanRL DQN -91.5 at 500k steps; rl-zoo DQN -76.6 at 100k"),
    "mountaincar": Task("MountainCar-v0", -110.0,
                        "CleanRL DQN -194.95 at 500k steps; rl-zoo DQN -101 at 120k"),
}
ALGOS = ("apex_dqn", "impala")
PRESET_SUFFIX = {"apex_dqn": "apex", "impala": "impala"}


def parse_list(text: str | None, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    if not text:
        return known
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    unknown = [item for item in items if item not in known]
    if unknown or not items:
        raise ApexError(f"--{what} takes a comma-separated list of {', '.join(known)}; got {text!r}")
    return items


def run(tasks: str | None = None, algos: str | None = None, seeds: int = 3, minutes: float = 5.0,
        plot: str | None = None, seconds: float | None = None) -> dict:
    """Runs every (task, algorithm, seed), prints the table, returns the figures (and draws
    the curves into ``plot``). ``seconds`` (apex bench's common flag) overrides ``minutes``."""
    names = parse_list(tasks, tuple(TASKS), "tasks")
    algo_names = parse_list(algos, ALGOS, "algos")
    if seeds < 1:
        raise ApexError(f"--seeds must be >= 1, got {seeds}")
    limit_s = seconds if seconds is not None else minutes * 60
    if limit_s <= 0:
        raise ApexError(f"--minutes must be positive, got {minutes}")
    runs = []
    with tempfile.TemporaryDirectory(prefix="apex-learn-") as tmp:
        for name in names:
            for algo in algo_names:
                for seed in range(seeds):
                    runs.append(_run_one(name, algo, seed, limit_s, Path(tmp) / f"{name}-{algo}-{seed}"))
                    print(f"  {name} {algo} seed {seed}: {_describe(runs[-1])}", flush=True)
    summary = _summarise(runs)
    print_table(
        f"learn: median over {seeds} seed(s), {limit_s:g} s at most per run, 2 actors, wall time from the command",
        ["task", "algo", "threshold", "reached", "time to threshold s", "start-up s", "env steps",
         "final return", "best return", "env steps/s", "updates/s", "reference"],
        [[s["task"], s["algo"], s["threshold"], f"{s['reached']}/{s['runs']}",
          *("-" if s[key] is None else s[key] for key in (
              "time_to_threshold_s", "startup_s", "env_steps", "final_return", "best_return", "env_steps_per_s",
              "updates_per_s")),
          TASKS[s["task"]].reference] for s in summary])
    if plot:
        _plot(runs, plot)
        print(f"wrote {plot}")
    return {"limit_s": limit_s, "seeds": seeds, "summary": summary, "runs": runs}


def _run_one(task: str, algo: str, seed: int, limit_s: float, logdir: Path) -> dict:
    """One `apex run` of a task's preset to its threshold or the time limit."""
    spec = TASKS[task]
    args = [sys.executable, "-m", "apex", "run", "--config", f"{task}_{PRESET_SUFFIX[algo]}", "--seed", str(seed),
            "--stop-return", str(spec.threshold), "--stop-seconds", str(limit_s), "--logdir", str(logdir),
            "--port", str(free_base_port())]
    started = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first_update = None
    metrics = logdir / "metrics.jsonl"
    while proc.poll() is None:
        if first_update is None and _has_an_update(metrics):
            first_update = time.monotonic() - started
        time.sleep(0.1)
    wall = time.monotonic() - started
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
        raise ApexError(f"bench learn: {task} {algo} seed {seed} failed: {last}")
    summary = json.loads((logdir / "summary.json").read_text())
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    reached = str(summary["stop_reason"]).startswith("return_mean_100")
    rates = [r for r in rows if r.get("env_steps_per_s")]
    return {
        "task": task, "algo": algo, "seed": seed, "threshold": spec.threshold,
        "reached": reached,
        "time_to_threshold_s": round(wall, 1) if reached else None,
        "wall_s": round(wall, 1),
        # the metrics row that first shows an update is written up to metrics_interval_s after it
        "startup_s": round(first_update, 1) if first_update is not None else None,
        "env_steps": summary["env_steps"],
        "final_return": summary["return_mean_100"],
        "best_return": summary["best_return_mean_100"],
        "env_steps_per_s": round(statistics.mean(r["env_steps_per_s"] for r in rates), 1) if rates else None,
        "updates_per_s": round(statistics.mean(r["updates_per_s"] for r in rates), 1) if rates else None,
        "curve": [[r["time"], r["env_steps"], r["return_mean_100"]] for r in rows if r.get("return_mean_100") is not None],
    }


def _has_an_update(metrics: Path) -> bool:
    try:
        return any(json.loads(line).get("learner_updates", 0) > 0
                   for line in metrics.read_text().splitlines() if line.strip())
    except (OSError, ValueError):  # not there yet, or a line being written
        return False


def _describe(run: dict) -> str:
    if run["reached"]:
        return f"{run['threshold']:g} in {run['time_to_threshold_s']:.1f} s ({run['env_steps']:,} env steps)"
    final = run["final_return"]
    return f"not reached in {run['wall_s']:.0f} s (final {'-' if final is None else f'{final:.1f}'})"


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None


def _summarise(runs: list[dict]) -> list[dict]:
    """Medians over seeds per (task, algo); time to threshold over the seeds that reached it."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["task"], r["algo"]), []).append(r)
    return [{
        "task": task, "algo": algo, "threshold": group[0]["threshold"], "runs": len(group),
        "reached": sum(r["reached"] for r in group),
        **{key: _median([r[key] for r in group]) for key in (
            "time_to_threshold_s", "startup_s", "env_steps", "final_return", "best_return",
            "env_steps_per_s", "updates_per_s")},
    } for (task, algo), group in groups.items()]


def _plot(runs: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter

        from apex.plot import si
    except ImportError:
        raise ApexError("apex bench learn --plot needs matplotlib: pip install 'apex-rl[plot]'") from None
    tasks = list(dict.fromkeys(r["task"] for r in runs))
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.2 * len(tasks)), squeeze=False)
    colors = {"apex_dqn": "tab:blue", "impala": "tab:orange"}
    for row, task in enumerate(tasks):
        for col, (x, label) in enumerate(((0, "wall time of the run (s)"), (1, "env steps"))):
            ax = axes[row][col]
            for r in (r for r in runs if r["task"] == task):
                if r["curve"]:
                    ax.plot([p[x] for p in r["curve"]], [p[2] for p in r["curve"]], color=colors[r["algo"]],
                            alpha=0.8, label=f"{r['algo']} seed {r['seed']}")
            ax.axhline(TASKS[task].threshold, color="gray", linestyle="--", label=f"threshold {TASKS[task].threshold:g}")
            ax.set_title(f"{TASKS[task].env_id}: return_mean_100")
            ax.set_xlabel(label)
            if x == 1:
                ax.xaxis.set_major_formatter(FuncFormatter(si))  # 250k, 1.2M
            ax.grid(alpha=0.3)
        axes[row][0].legend(fontsize=7)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
