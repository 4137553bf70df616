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
    with tempfile.TemporaryDirectory(prefix="apex-soak-") as tmp:
        run_dir = Path(logdir) if logdir else Path(tmp) / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        soak = _Soak(config, run_dir, seconds, actors, random.Random(seed))
        try:
            soak.churn(churn_s)
            leftover = soak.leftovers()
        finally:
            soak.kill()
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}

    capacity = config.apex_dqn.replay.capacity
    samples = soak.samples
    full_at = next((s["t"] for s in samples if s["replay_size"] >= capacity), None)
    after = [s["rss_mb"] for s in samples if full_at is not None and s["t"] >= full_at]
    variation = 100 * (max(after) - min(after)) / (sum(after) / len(after)) if after else None
    result = {
        "seconds": seconds,
        "actors": actors,
        "churn_s": churn_s,
        "checkpoint_s": checkpoint_s,
        "replay_capacity": capacity,
        "actor_kills": soak.kills,
        "learner_exit": soak.learner.returncode,
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
    _print_table(result, after)
    if plot:
        _plot(samples, full_at, plot)
        print(f"wrote {plot}")
    problems = _problems(soak.learner.returncode, variation, capacity, leftover)
    result["passed"] = not problems
    result["problems"] = problems
    return result


class _Soak:
    """The learner and the churning actors of one soak, and the learner's memory over time."""

    def __init__(
        self, config: config_module.Config, run_dir: Path, seconds: float, actors: int, rng: random.Random
    ) -> None:
        """Starts the learner (to stop by itself after ``seconds``) and ``actors`` actors."""
        self.run_dir = run_dir
        self.seconds = seconds
        self.rng = rng
        self.config_file = run_dir / "soak-config.yaml"
        config.save(self.config_file)
        port = free_base_port()
        self.log = open(run_dir / "soak-processes.log", "ab")  # noqa: SIM115 - the child writes it all its life
        self.learner = spawn_apex(
            [
                "learner",
                "--config",
                str(self.config_file),
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
            self.log,
        )
        self.actor_args = ["actor", "--learner", f"127.0.0.1:{port}", "--config", str(self.config_file)]
        self.procs = [spawn_apex(self.actor_args, self.log) for _ in range(actors)]
        self.started = [*self.procs]
        self.samples: list[dict[str, Any]] = []
        self.kills = 0

    def churn(self, churn_s: float) -> None:
        """Until the learner stops: samples its memory every second and replaces an actor at
        random intervals of mean ``churn_s``."""
        start = time.monotonic()
        next_churn = start + self.rng.uniform(0.5, 1.5) * churn_s
        while self.learner.poll() is None:
            now = time.monotonic()
            self._sample(now - start)
            # No churn in the last seconds: every actor is connected when the learner
            # stops, and each must then exit by itself.
            if now >= next_churn and now - start < self.seconds - 15:
                self._replace_an_actor()
                next_churn = now + self.rng.uniform(0.5, 1.5) * churn_s
            time.sleep(1.0)

    def _sample(self, elapsed: float) -> None:
        row = _last_metrics(self.run_dir / "metrics.jsonl") or {}
        rss = memory_mb(self.learner.pid, "VmRSS")
        if rss is not None:
            self.samples.append(
                {
                    "t": round(elapsed, 1),
                    "rss_mb": round(rss, 1),
                    "replay_size": row.get("replay_size", 0),
                    "actors_connected": row.get("actors_connected", 0),
                    "learner_updates": row.get("learner_updates", 0),
                }
            )

    def _replace_an_actor(self) -> None:
        """Kills an actor (SIGKILL, or now and then SIGTERM) and starts a new one in its place."""
        victim = self.rng.randrange(len(self.procs))
        self.procs[victim].send_signal(signal.SIGTERM if self.rng.random() < 0.2 else signal.SIGKILL)
        self.procs[victim].wait()
        self.procs[victim] = spawn_apex(self.actor_args, self.log)
        self.started.append(self.procs[victim])
        self.kills += 1

    def leftovers(self) -> list[int]:
        """The pids of the processes still running shortly after the learner stopped."""
        # The learner told its actors to stop; they must be gone shortly after.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.2)
        leftover = [p.pid for p in self.started if p.poll() is None]
        ps = subprocess.run(["pgrep", "-f", str(self.config_file)], capture_output=True, text=True).stdout.split()
        leftover += [int(pid) for pid in ps if int(pid) not in leftover]  # grandchildren, if any
        return leftover

    def kill(self) -> None:
        """Kills what is still running."""
        for p in [self.learner, *self.started]:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.log.close()


def _print_table(result: dict[str, Any], after: list[float]) -> None:
    print_table(
        f"soak: CartPole Ape-X learner, {result['actors']} actors killed and restarted every "
        f"~{result['churn_s']:g} s, {result['seconds']:g} s",
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
                result["actor_kills"],
                result["replay_full_at_s"],
                "-" if not after else f"{min(after):.1f} / {sum(after) / len(after):.1f} / {max(after):.1f}",
                result["rss_variation_percent"],
                result["checkpoints_written"],
                result["learner_exit"],
                len(result["leftover_pids"]),
            ]
        ],
    )


def _problems(learner_exit: int | None, variation: float | None, capacity: int, leftover: list[int]) -> list[str]:
    problems = []
    if learner_exit != 0:
        problems.append(f"the learner exited with {learner_exit}")
    if variation is None:
        problems.append(f"the replay never filled ({capacity} transitions): run longer")
    elif variation >= RSS_LIMIT_PERCENT:
        problems.append(f"learner RSS varied by {variation:.1f}% after the replay filled (limit {RSS_LIMIT_PERCENT}%)")
    if leftover:
        problems.append(f"processes left behind: {leftover}")
    return problems


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
