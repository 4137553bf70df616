"""`apex bench replay`: a full PrioritizedReplay.sample(512), data gather included.

Two transition sizes: CartPole (a few floats) and Atari (84x84x4 uint8 stacks for obs and
next_obs, stored naively: 56,448 bytes a transition). The baseline is the floor of the data
movement itself: a uniform NumPy gather of the same number of rows from the same storage.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from apex.bench.timing import print_records, summarize, time_calls
from apex.replay import PrioritizedReplay

BATCH = 512
FILL_CHUNK = 4096

SPECS = {
    "cartpole": (
        2**20,
        {
            "obs": ((4,), np.float32),
            "action": ((), np.int64),
            "reward": ((), np.float32),
            "discount": ((), np.float32),
            "next_obs": ((4,), np.float32),
        },
    ),
    "atari": (
        2**14,
        {
            "obs": ((4, 84, 84), np.uint8),
            "action": ((), np.int64),
            "reward": ((), np.float32),
            "discount": ((), np.float32),
            "next_obs": ((4, 84, 84), np.uint8),
        },
    ),
}


def _fill(replay: PrioritizedReplay, rng: np.random.Generator) -> None:
    chunk = {
        name: rng.integers(0, 255, (FILL_CHUNK, *field.shape)).astype(field.dtype)
        for name, field in replay.fields.items()
    }
    while replay.total_added < replay.capacity:
        replay.add(chunk, rng.random(FILL_CHUNK))


def _measure(name: str, capacity: int, spec: dict[str, Any], seconds: float) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    replay = PrioritizedReplay(spec, capacity, seed=0)
    _fill(replay, rng)
    storage = {field: replay.storage[field] for field in spec}  # baseline reads the same arrays
    row_bytes = sum(a[0].nbytes for a in storage.values())
    new_priorities = rng.random(BATCH)

    def sample() -> None:
        replay.sample(BATCH, beta=0.4)

    def learner_step() -> None:
        _, indices, _ = replay.sample(BATCH, beta=0.4)
        replay.update_priorities(indices, new_priorities)

    def uniform_gather() -> None:
        slots = np.sort(rng.integers(0, capacity, BATCH))
        {field: np.take(array, slots, axis=0) for field, array in storage.items()}

    figures = {
        op: summarize(time_calls(fn, seconds=seconds))
        for op, fn in [("sample", sample), ("sample_update", learner_step), ("uniform_gather", uniform_gather)]
    }
    baseline_us = figures["uniform_gather"]["p50_us"]
    rows = []
    for op in ("sample", "sample_update"):
        p50 = figures[op]["p50_us"]
        rows.append(
            {
                "transition": name,
                "op": op,
                "capacity": capacity,
                "batch": BATCH,
                "bytes_per_transition": row_bytes,
                "replay_nbytes": replay.nbytes,
                "p50_us": p50,
                "transitions_per_s": round(BATCH * 1e6 / p50),
                "mb_per_s": round(BATCH * row_bytes / p50, 1),
                "uniform_gather_p50_us": baseline_us,
                "overhead_vs_uniform_gather": round(p50 / baseline_us, 2),
            }
        )
    return rows


def run(seconds: float = 1.0) -> dict[str, Any]:
    rows = []
    for name, (capacity, spec) in SPECS.items():
        rows += _measure(name, capacity, spec, seconds)
    print_records(
        "replay: PrioritizedReplay.sample(512) with the data gather (median per call)",
        [
            ("transition", "transition"),
            ("op", "op"),
            ("bytes/transition", "bytes_per_transition"),
            ("µs", "p50_us"),
            ("transitions/s", "transitions_per_s"),
            ("MB/s", "mb_per_s"),
            ("uniform gather µs", "uniform_gather_p50_us"),
        ],
        rows,
    )
    return {"baseline": "uniform NumPy gather of the same rows (no priorities)", "results": rows}
