"""A real run's settings for tests and what it writes: quick heartbeats and metrics rows,
metrics.jsonl read back, and a made-up run's metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from apex.config import Config

FAST = [
    "--set",
    "transport.heartbeat_interval_s=0.2",
    "--set",
    "transport.heartbeat_timeout_s=1.5",
    "--set",
    "learner.metrics_interval_s=0.5",
    "--set",
    "actor.num_envs=4",
]


def metrics(logdir: Path) -> list[dict]:
    path = logdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def last_row(logdir: Path) -> dict:
    """The newest metrics row, or {} before the first."""
    rows = metrics(logdir)
    return rows[-1] if rows else {}


def metrics_run(directory: Path, slope: float = 1.0, config: Config | None = None) -> str:
    """A run of 1.2M env steps over 20 minutes whose return zigzags up."""
    directory.mkdir(parents=True)
    rows = [
        {
            "time": 30.0 * t,
            "env_steps": 30_000 * t,
            "env_steps_per_s": 1000.0 + 10 * t,
            "return_mean_100": None if t == 0 else slope * t + (-1) ** t * 3,
        }
        for t in range(41)
    ]
    (directory / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    if config is not None:
        config.save(directory / "config.yaml")
    return str(directory)
