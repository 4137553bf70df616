"""Timing helpers shared by the benchmarks: per-call latencies, medians, machine info."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from typing import Any

import numpy as np


def time_calls(
    fn: Callable[[], object],
    *,
    warmup: int = 20,
    min_calls: int = 50,
    max_calls: int = 5000,
    seconds: float = 1.0,
) -> np.ndarray:
    """Calls ``fn`` repeatedly and returns each call's latency in microseconds.

    Runs ``warmup`` untimed calls, then at least ``min_calls`` timed ones and more until
    ``seconds`` have passed or ``max_calls`` were made.
    """
    for _ in range(warmup):
        fn()
    latencies: list[int] = []
    deadline = time.perf_counter() + seconds
    while len(latencies) < max_calls and (len(latencies) < min_calls or time.perf_counter() < deadline):
        start = time.perf_counter_ns()
        fn()
        latencies.append(time.perf_counter_ns() - start)
    return np.asarray(latencies, dtype=np.float64) / 1e3


def summarize(latencies_us: np.ndarray) -> dict[str, float]:
    """Median and spread of per-call latencies, with the rate the median implies."""
    p50 = float(np.median(latencies_us))
    return {
        "p50_us": round(p50, 2),
        "p90_us": round(float(np.percentile(latencies_us, 90)), 2),
        "ops_per_s": round(1e6 / p50, 1),
        "calls": len(latencies_us),
    }


def machine_info() -> dict[str, object]:
    """What the figures were measured on."""
    import torch

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def print_table(title: str, header: list[str], rows: list[list[object]]) -> None:
    """Prints rows as a plain aligned table (also valid Markdown)."""
    cells = [header] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(str(row[i])) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print("| " + " | ".join(str(c).rjust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def print_records(title: str, columns: list[tuple[str, str]], records: list[dict[str, Any]]) -> None:
    """``print_table`` of dict rows: ``columns`` are (header, key) pairs."""
    print_table(title, [header for header, _ in columns], [[r[key] for _, key in columns] for r in records])


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.1f}" if abs(value) >= 100 else f"{value:.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def median_time(times: list[float | None]) -> float | None:
    """The median of runs' times to a threshold, a run that missed (None) counting as slower
    than every one that reached it: None when half or more missed."""
    import math
    import statistics

    ordered = sorted(times, key=lambda t: math.inf if t is None else t)
    middle = ordered[(len(ordered) - 1) // 2 : len(ordered) // 2 + 1]  # one value, or the two around the middle
    reached = [t for t in middle if t is not None]
    return None if not middle or len(reached) < len(middle) else round(statistics.mean(reached), 2)
