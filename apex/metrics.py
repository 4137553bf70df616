"""Run output: metrics.jsonl lines, the console status line, summary.json, episode stats."""

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


class MetricsWriter:
    """Appends one JSON object per call to LOGDIR/metrics.jsonl and shows a status line."""

    def __init__(self, logdir: Path, console: TextIO | None = None) -> None:
        logdir.mkdir(parents=True, exist_ok=True)
        self._file = open(logdir / "metrics.jsonl", "a", buffering=1)
        self._console = console if console is not None else sys.stderr
        self._tty = self._console.isatty()
        self._last_plain = 0.0

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._status(row)

    def _status(self, row: dict[str, Any]) -> None:
        ret = row.get("return_mean_100")
        line = (
            f"[{row['time']:7.1f}s] steps {row['env_steps']:>10,} ({row['env_steps_per_s']:>8,.0f}/s)  "
            f"updates {row['learner_updates']:>8,} ({row['updates_per_s']:>6,.0f}/s)  "
            f"return {'-' if ret is None else f'{ret:7.1f}'}  replay {row['replay_size']:>9,}  "
            f"actors {row['actors_connected']}"
        )
        if self._tty:
            self._console.write("\r" + line)
            self._console.flush()
        elif row["time"] - self._last_plain >= 10 or self._last_plain == 0.0:
            self._console.write(line + "\n")
            self._last_plain = max(row["time"], 1e-9)

    def close(self) -> None:
        if self._tty:
            self._console.write("\n")
        self._file.close()


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

    def __init__(self) -> None:
        self._last_time = time.monotonic()
        self._last_count = 0

    def __call__(self, count: int) -> float:
        now = time.monotonic()
        rate = (count - self._last_count) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_count = now, count
        return rate
