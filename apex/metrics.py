"""Run output: metrics.jsonl lines, TensorBoard scalars, the console status line, summary.json,
episode stats."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, TextIO


class EpisodeStats:
    """Returns of the last 100 evaluation and the last 100 training episodes."""

    def __init__(self, window: int = 100) -> None:
        self.window = window
        self.eval_returns: deque[float] = deque(maxlen=window)
        self.train_returns: deque[float] = deque(maxlen=window)
        self.episodes = 0
        self.best_return_mean = -math.inf

    def add(self, episode_return: float, is_eval: bool) -> None:
        self.episodes += 1
        self.train_returns.append(float(episode_return))
        if is_eval:
            self.eval_returns.append(float(episode_return))
            if len(self.eval_returns) == self.window:
                self.best_return_mean = max(self.best_return_mean, self.return_mean)

    def state_dict(self) -> dict:
        return {"eval": list(self.eval_returns), "train": list(self.train_returns),
                "episodes": self.episodes, "best": self.best_return_mean}

    def load_state_dict(self, state: dict) -> None:
        self.eval_returns.extend(state["eval"])
        self.train_returns.extend(state["train"])
        self.episodes = state["episodes"]
        self.best_return_mean = state["best"]

    @property
    def return_mean(self) -> float | None:
        """Mean of the last 100 evaluation episodes (of those so far, before there are 100)."""
        return sum(self.eval_returns) / len(self.eval_returns) if self.eval_returns else None

    @property
    def full_window(self) -> bool:
        return len(self.eval_returns) == self.window

    @property
    def train_return_mean(self) -> float | None:
        return sum(self.train_returns) / len(self.train_returns) if self.train_returns else None


# TensorBoard groups scalars by the part of the tag before the slash.
_TB_GROUPS = (
    ("return", ("return_mean_100", "train_return_mean_100", "episodes")),
    ("throughput", ("env_steps_per_s", "updates_per_s", "samples_per_s")),
    ("lag", ("policy_lag_mean", "policy_lag_max", "weights_version")),
    ("replay", ("replay_", "queue_", "inserted", "priority_")),
    ("loss", ("loss", "q_mean", "td_abs_mean", "pg_loss", "baseline_loss", "entropy", "grad_norm")),
)


def tensorboard_tag(key: str) -> str:
    for group, prefixes in _TB_GROUPS:
        if key.startswith(prefixes):
            return f"{group}/{key}"
    return f"system/{key}"


class MetricsWriter:
    """Appends one JSON object per call to LOGDIR/metrics.jsonl, writes the numbers as
    TensorBoard scalars to LOGDIR/tb (by env steps), and keeps a status line on the console
    when it is a terminal (nothing when it is not: the files have it all)."""

    def __init__(self, logdir: Path, console: TextIO | None = None, tensorboard: bool = True) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        self._file = open(logdir / "metrics.jsonl", "a", buffering=1)
        self._console = console if console is not None else sys.stderr
        self._tty = self._console.isatty()
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: not at start-up

            self._tb = SummaryWriter(str(logdir / "tb"), flush_secs=10)

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            step = row["env_steps"]
            for key, value in row.items():
                if key not in ("time", "env_steps") and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(tensorboard_tag(key), value, step, walltime=None)
        if self._tty:
            self._console.write("\r" + status_line(row) + "\033[K")
            self._console.flush()

    def close(self) -> None:
        if self._tty:
            self._console.write("\n")
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def status_line(row: dict[str, Any]) -> str:
    """One line: time, env steps and rate, updates and rate, return, replay fill, actors, lag."""
    ret, lag = row.get("return_mean_100"), row.get("policy_lag_mean")
    capacity = row.get("replay_capacity")
    fill = f" ({100 * row['replay_size'] / capacity:3.0f}%)" if capacity else ""
    return (
        f"[{row['time']:7.1f}s] steps {row['env_steps']:>10,} ({row['env_steps_per_s']:>8,.0f}/s)  "
        f"updates {row['learner_updates']:>8,} ({row['updates_per_s']:>6,.0f}/s)  "
        f"return {'-' if ret is None else f'{ret:7.1f}'}  replay {row['replay_size']:>9,}{fill}  "
        f"actors {row['actors_connected']}  lag {'-' if lag is None else f'{lag:.0f}'}"
    )


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class Rate:
    """Events per second between successive reads."""

    def __init__(self, count: int = 0) -> None:
        self._last_time = time.monotonic()
        self._last_count = count

    def __call__(self, count: int) -> float:
        now = time.monotonic()
        rate = (count - self._last_count) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_count = now, count
        return rate
