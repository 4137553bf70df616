"""`apex bench learn`: learning quality, measured: each task's preset trained as `apex run`
does (real processes, one run at a time) to the task's threshold, beside published figures.

For each (task, algorithm, seed) it records the wall time from the command's start to the
threshold (None if the time limit came first), the start-up (command to the learner's first
update), both from the learner's wall-clock times in summary.json; env steps at the stop,
final and best return_mean_100, and env steps/s and updates/s. It prints one table with the
medians over seeds and the references, and can plot return against wall time and against
env steps with the threshold drawn. The tasks, their thresholds and references are in
``apex.bench.learn_tasks``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from apex import config as config_module
from apex.bench.learn_tasks import TASKS
from apex.bench.timing import median_time, print_table
from apex.bench.transport import free_base_port
from apex.core import ALGOS, FACTS
from apex.errors import ApexError


def parse_list(text: str | None, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    if not text:
        return known
    items = tuple(item.strip() for item in text.split(",") if item.strip())
    unknown = [item for item in items if item not in known]
    if unknown or not items:
        raise ApexError(f"--{what} takes a comma-separated list of {', '.join(known)}; got {text!r}")
    return items


def run(
    tasks: str | None = None,
    algos: str | None = None,
    seeds: int = 3,
    minutes: float | None = None,
    plot: str | None = None,
    seconds: float | None = None,
    runs_dir: str | None = None,
) -> dict[str, Any]:
    """Runs every (task, algorithm, seed), prints the table, returns the figures (and draws
    the curves into ``plot``). Each task runs for its own time limit (``Task.minutes``)
    unless ``minutes`` or ``seconds`` (apex bench's common flag, which wins) sets one for all.

    With ``runs_dir`` each run's directory and record (``<task>-<algo>-<seed>.json``) stay
    there, and a run already recorded with the same time limit is read back, not run again:
    a bench of hours can be stopped (Ctrl-C, a reboot) and the same command goes on."""
    names, algo_names, limit_s = _checked(tasks, algos, seeds, minutes, seconds)
    runs = []
    with tempfile.TemporaryDirectory(prefix="apex-learn-") as tmp:
        base = Path(runs_dir) if runs_dir else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        for name in names:
            for algo in (a for a in algo_names if a in TASKS[name].thresholds):  # continuous tasks: not Ape-X
                for seed in range(seeds):
                    task_limit_s = limit_s if limit_s is not None else TASKS[name].minutes * 60
                    runs.append(_recorded_or_run(name, algo, seed, task_limit_s, base, keep=runs_dir is not None))
    summary = _summarise(runs)
    _print_summary(summary, seeds, limit_s)
    if plot:
        _plot(runs, plot)
        print(f"wrote {plot}")
    return {
        "limit_s": limit_s,
        "seeds": seeds,
        "runs_wall_s": round(sum(r["wall_s"] for r in runs), 1),
        "summary": summary,
        "runs": runs,
    }


def _checked(
    tasks: str | None, algos: str | None, seeds: int, minutes: float | None, seconds: float | None
) -> tuple[tuple[str, ...], tuple[str, ...], float | None]:
    """The tasks and algorithms asked for (all when None), each task with one of them at
    least, and the time limit for all runs (None: each task's own); raises ApexError on a
    bad option."""
    names = parse_list(tasks, tuple(TASKS), "tasks")
    algo_names = parse_list(algos, ALGOS, "algos")
    if seeds < 1:
        raise ApexError(f"--seeds must be >= 1, got {seeds}")
    for name in names:
        if not any(algo in TASKS[name].thresholds for algo in algo_names):
            raise ApexError(
                f"--tasks {name} runs with --algos {', '.join(TASKS[name].thresholds)} only "
                "(continuous actions: the Gaussian policy of IMPALA and APPO)"
            )
    limit_s = seconds if seconds is not None else None if minutes is None else minutes * 60
    if limit_s is not None and limit_s <= 0:
        raise ApexError(f"--minutes must be positive, got {minutes}")
    return names, algo_names, limit_s


def _print_summary(summary: list[dict[str, Any]], seeds: int, limit_s: float | None) -> None:
    limits = f"{limit_s:g} s" if limit_s is not None else "each task's own time limit"
    print_table(
        f"learn: median over {seeds} seed(s), {limits} at most per run, 2 actors, times from the command's start",
        [
            "task",
            "algo",
            "threshold",
            "reached",
            "time to threshold s",
            "target s",
            "start-up s",
            "env steps",
            "final return",
            "best return",
            "env steps/s",
            "updates/s",
            "reference",
        ],
        [
            [
                s["task"],
                s["algo"],
                s["threshold"],
                f"{s['reached']}/{s['runs']}",
                "-" if s["time_to_threshold_s"] is None else s["time_to_threshold_s"],
                "-" if s["target_s"] is None else s["target_s"],
                *(
                    "-" if s[key] is None else s[key]
                    for key in (
                        "startup_s",
                        "env_steps",
                        "final_return",
                        "best_return",
                        "env_steps_per_s",
                        "updates_per_s",
                    )
                ),
                TASKS[s["task"]].reference,
            ]
            for s in summary
        ],
    )


def _recorded_or_run(task: str, algo: str, seed: int, limit_s: float, base: Path, keep: bool) -> dict[str, Any]:
    """A run's record from ``base`` when kept there with the same time limit and the same
    resolved preset (a retuned preset runs again; a config key added since, at its default,
    does not count), else a new run (recorded there when
    ``keep``). The record is written whole, then renamed, so a stop mid-write leaves no half
    record to be read back."""
    name = f"{task}-{algo}-{seed}"
    config = _task_config(task, algo)
    record = base / f"{name}.json"
    if keep and record.exists():
        try:
            run: dict[str, Any] = json.loads(record.read_text())
        except (OSError, ValueError) as exc:
            raise ApexError(f"bench learn: cannot read {record} ({exc}); delete it to run that seed again") from None
        if run.get("limit_s") == limit_s and _resolved(run.get("config")) == config:
            print(f"  {task} {algo} seed {seed}: {_describe(run)} (recorded in {record})", flush=True)
            return run
    logdir = base / name
    if logdir.exists():  # a run stopped midway: its files would be appended to
        shutil.rmtree(logdir)
    run = _run_one(task, algo, seed, limit_s, logdir)
    print(f"  {task} {algo} seed {seed}: {_describe(run)}", flush=True)
    if keep:
        run["config"] = config
        partial = record.with_suffix(".json.partial")
        partial.write_text(json.dumps(run) + "\n")
        partial.replace(record)
    return run


def _task_config(task: str, algo: str) -> dict[str, Any]:
    """The config a task's run has: its preset's, or the algorithm's defaults on its env."""
    spec = TASKS[task]
    if spec.preset:
        return config_module.load(FACTS[algo].preset(task)).to_dict()
    return config_module.load_dict({"algo": algo, "env": {"id": spec.env_id}}).to_dict()


def _resolved(recorded: object) -> dict[str, Any] | None:
    """A record's config with every key the record predates at its default (a key added
    since, at its default, leaves a run as it was), or None if it no longer loads."""
    if not isinstance(recorded, dict):
        return None
    try:
        return config_module.from_dict(recorded).to_dict()
    except ApexError:
        return None


def _run_one(task: str, algo: str, seed: int, limit_s: float, logdir: Path) -> dict[str, Any]:
    """One `apex run` of a task's preset to its threshold or the time limit."""
    spec = TASKS[task]
    threshold = spec.thresholds[algo]
    args = [
        sys.executable,
        "-m",
        "apex",
        "run",
        *spec.run_args(task, algo),
        "--seed",
        str(seed),
        "--stop-return",
        str(threshold),
        "--stop-seconds",
        str(limit_s),
        "--logdir",
        str(logdir),
        "--port",
        str(free_base_port()),
    ]
    started = time.time()  # wall clock, as the learner's times in summary.json
    proc = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.time() - started
    if proc.returncode != 0:
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"
        raise ApexError(f"bench learn: {task} {algo} seed {seed} failed: {last}")
    summary = json.loads((logdir / "summary.json").read_text())
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    reached = str(summary["stop_reason"]).startswith("return_mean_100")
    first_update, stopped = summary.get("first_update_unix_s"), summary.get("stopped_unix_s")
    rates = [r for r in rows if r.get("env_steps_per_s")]
    return {
        "task": task,
        "algo": algo,
        "seed": seed,
        "threshold": threshold,
        "limit_s": limit_s,
        "reached": reached,
        # from the command's start to the learner's stop on reaching it (not to the exit,
        # which adds the last checkpoint and the processes' ends)
        "time_to_threshold_s": round(stopped - started, 1) if reached and stopped else None,
        "wall_s": round(wall, 1),
        "startup_s": round(first_update - started, 2) if first_update else None,
        "env_steps": summary["env_steps"],
        "final_return": summary["return_mean_100"],
        "best_return": summary["best_return_mean_100"],
        "env_steps_per_s": round(statistics.mean(r["env_steps_per_s"] for r in rates), 1) if rates else None,
        "updates_per_s": round(statistics.mean(r["updates_per_s"] for r in rates), 1) if rates else None,
        "curve": [
            [r["time"], r["env_steps"], r["return_mean_100"]] for r in rows if r.get("return_mean_100") is not None
        ],
    }


def _describe(run: dict[str, Any]) -> str:
    if run["reached"]:
        return f"{run['threshold']:g} in {run['time_to_threshold_s']:.1f} s ({run['env_steps']:,} env steps)"
    final = run["final_return"]
    return f"not reached in {run['wall_s']:.0f} s (final {'-' if final is None else f'{final:.1f}'})"


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 2) if present else None


def _summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over seeds per (task, algo). A seed that did not reach the threshold counts
    as slower than every one that did: the median time is None when half or more missed."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["task"], r["algo"]), []).append(r)
    return [
        {
            "task": task,
            "algo": algo,
            "threshold": group[0]["threshold"],
            "runs": len(group),
            "target_s": TASKS[task].target_s[algo],
            "reached": sum(r["reached"] for r in group),
            "time_to_threshold_s": median_time([r["time_to_threshold_s"] for r in group]),
            **{
                key: _median([r[key] for r in group])
                for key in ("startup_s", "env_steps", "final_return", "best_return", "env_steps_per_s", "updates_per_s")
            },
        }
        for (task, algo), group in groups.items()
    ]


def _plot(runs: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter

        from apex.run.plot import si
    except ImportError:
        raise ApexError("apex bench learn --plot needs matplotlib: pip install 'apex-rl[plot]'") from None
    tasks = list(dict.fromkeys(r["task"] for r in runs))
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.2 * len(tasks)), squeeze=False)
    colors = {"apex_dqn": "tab:blue", "impala": "tab:orange", "appo": "tab:green"}
    for row, task in enumerate(tasks):
        for col, (x, label) in enumerate(((0, "wall time of the run (s)"), (1, "env steps"))):
            ax = axes[row][col]
            for r in (r for r in runs if r["task"] == task):
                if r["curve"]:
                    ax.plot(
                        [p[x] for p in r["curve"]],
                        [p[2] for p in r["curve"]],
                        color=colors[r["algo"]],
                        alpha=0.8,
                        label=f"{r['algo']} seed {r['seed']}",
                    )
            for threshold in sorted(set(TASKS[task].thresholds.values())):
                ax.axhline(threshold, color="gray", linestyle="--", label=f"threshold {threshold:g}")
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
