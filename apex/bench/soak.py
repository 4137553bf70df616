"""`apex bench soak`: a learner with churning actors for a fixed time; memory must stay flat.

A real `apex learner` (CartPole Ape-X, checkpoints with the replay every ``checkpoint_s``)
and N `apex actor` processes; at random intervals (mean ``churn_s``) one actor is killed
(SIGKILL, or now and then SIGTERM) and a new one started in its place, until 15 s before
the end, when the learner stops and tells the actors to exit. The learner's
resident memory is sampled every second from /proc. Once the replay is full, the learner's
memory should not move: a leak in ingest, reconnects or checkpoints shows up as a slope.

It fails (exit 2) when the learner's RSS varies by 5% or more after the replay filled, when
the learner does not exit 0 at the end, or when any process it started is left behind.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from apex import config as config_module
from apex.bench.e2e import memory_mb, spawn_apex
from apex.bench.timing import print_table
from apex.bench.transport import free_base_port

RSS_LIMIT_PERCENT = 5.0


def _last_metrics(path: Path) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode(errors="replace").splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None


def run(
    seconds: float = 600.0,
    actors: int = 3,
    churn_s: float = 10.0,
    checkpoint_s: float = 60.0,
    overrides: tuple[str, ...] = (),
    plot: str | None = None,
    logdir: str | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Runs the soak; returns the RSS series and the verdict (``passed``, ``problems``)."""
    config = config_module.load(None, [f"learner.checkpoint_interval_s={checkpoint_s}", *overrides])
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="apex-soak-") as tmp:
        run_dir = Path(logdir) if logdir else Path(tmp) / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        config_file = run_dir / "soak-config.yaml"
        config.save(config_file)
        port = free_base_port()
        log = open(run_dir / "soak-processes.log", "ab")  # noqa: SIM115 - the child writes it all its life
        learner = spawn_apex(
            [
                "learner",
                "--config",
                str(config_file),
                "--logdir",
                str(run_dir),
                "--bind-host",
                "127.0.0.1",
                "--port",
                str(port),
                "--stop-seconds",
                str(seconds),
                "--set",
                "learner.metrics_interval_s=1",
            ],
            log,
        )
        actor_args = ["actor", "--learner", f"127.0.0.1:{port}", "--config", str(config_file)]
        procs = [spawn_apex(actor_args, log) for _ in range(actors)]
        started = [*procs]
        samples, kills = [], 0
        start = time.monotonic()
        next_churn = start + rng.uniform(0.5, 1.5) * churn_s
        try:
            while learner.poll() is None:
                now = time.monotonic()
                row = _last_metrics(run_dir / "metrics.jsonl") or {}
                rss = memory_mb(learner.pid, "VmRSS")
                if rss is not None:
                    samples.append(
                        {
                            "t": round(now - start, 1),
                            "rss_mb": round(rss, 1),
                            "replay_size": row.get("replay_size", 0),
                            "actors_connected": row.get("actors_connected", 0),
                            "learner_updates": row.get("learner_updates", 0),
                        }
                    )
                # No churn in the last seconds: every actor is connected when the learner
                # stops, and each must then exit by itself.
                if now >= next_churn and now - start < seconds - 15:
                    victim = rng.randrange(actors)
                    procs[victim].send_signal(signal.SIGTERM if rng.random() < 0.2 else signal.SIGKILL)
                    procs[victim].wait()
                    procs[victim] = spawn_apex(actor_args, log)
                    started.append(procs[victim])
                    kills += 1
                    next_churn = now + rng.uniform(0.5, 1.5) * churn_s
                time.sleep(1.0)
            # The learner told its actors to stop; they must be gone shortly after.
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                time.sleep(0.2)
            leftover = [p.pid for p in started if p.poll() is None]
            ps = subprocess.run(["pgrep", "-f", str(config_file)], capture_output=True, text=True).stdout.split()
            leftover += [int(pid) for pid in ps if int(pid) not in leftover]  # grandchildren, if any
        finally:
            for p in [learner, *started]:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            log.close()
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}

    capacity = config.apex_dqn.replay.capacity
    full_at = next((s["t"] for s in samples if s["replay_size"] >= capacity), None)
    after = [s["rss_mb"] for s in samples if full_at is not None and s["t"] >= full_at]
    variation = 100 * (max(after) - min(after)) / (sum(after) / len(after)) if after else None
    result = {
        "seconds": seconds,
        "actors": actors,
        "churn_s": churn_s,
        "checkpoint_s": checkpoint_s,
        "replay_capacity": capacity,
        "actor_kills": kills,
        "learner_exit": learner.returncode,
        "replay_full_at_s": full_at,
        "rss_mb_after_full": {"min": min(after), "max": max(after), "mean": round(sum(after) / len(after), 1)}
        if after
        else None,
        "rss_variation_percent": None if variation is None else round(variation, 2),
        "rss_limit_percent": RSS_LIMIT_PERCENT,
        "leftover_pids": leftover,
        "checkpoints_written": summary.get("checkpoints_written"),
        "env_steps": summary.get("env_steps"),
        "learner_updates": summary.get("learner_updates"),
        "samples": samples,
    }
    print_table(
        f"soak: CartPole Ape-X learner, {actors} actors killed and restarted every ~{churn_s:g} s, {seconds:g} s",
        [
            "actor kills",
            "replay full at s",
            "RSS after full MB (min/mean/max)",
            "RSS variation %",
            "checkpoints",
            "learner exit",
            "leftover processes",
        ],
        [
            [
                kills,
                full_at,
                "-" if not after else f"{min(after):.1f} / {sum(after) / len(after):.1f} / {max(after):.1f}",
                result["rss_variation_percent"],
                result["checkpoints_written"],
                learner.returncode,
                len(leftover),
            ]
        ],
    )
    if plot:
        _plot(samples, full_at, plot)
        print(f"wrote {plot}")
    problems = []
    if learner.returncode != 0:
        problems.append(f"the learner exited with {learner.returncode}")
    if variation is None:
        problems.append(f"the replay never filled ({capacity} transitions): run longer")
    elif variation >= RSS_LIMIT_PERCENT:
        problems.append(f"learner RSS varied by {variation:.1f}% after the replay filled (limit {RSS_LIMIT_PERCENT}%)")
    if leftover:
        problems.append(f"processes left behind: {leftover}")
    result["passed"] = not problems
    result["problems"] = problems
    return result


def _plot(samples: list[dict[str, Any]], full_at: float | None, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("apex bench soak --plot needs matplotlib: pip install 'apex-rl[plot]'") from None
    t = [s["t"] for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(t, [s["rss_mb"] for s in samples])
    top.set(ylabel="learner RSS (MB)", title="soak: learner memory with churning actors")
    bottom.plot(t, [s["replay_size"] for s in samples], color="tab:green", label="replay size")
    bottom.set(xlabel="seconds", ylabel="replay transitions")
    connected = bottom.twinx()
    connected.step(t, [s["actors_connected"] for s in samples], color="tab:red", alpha=0.5, where="post")
    connected.set_ylabel("actors connected")
    for axis in (top, bottom):
        if full_at is not None:
            axis.axvline(full_at, color="grey", linestyle="--", linewidth=1)
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
