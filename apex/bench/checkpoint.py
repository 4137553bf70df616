"""`apex bench checkpoint`: writing a full Atari-sized replay into a checkpoint while a thread
keeps inserting, as the learner's ingest thread does.

A Pong-sized StackedReplay (250k transitions, 84x84 frames stored once: ~2 GB) is filled,
then a thread inserts 64-transition chunks flat out while `CheckpointWriter` writes a
checkpoint with it to a temporary directory. Reported: the checkpoint's size and write
time, how many transitions a resume gets back, the insert rate and insert latency (median,
p99, max) before and during the write, and the time to verify and to load it. The baseline
is the same inserter without a checkpoint (the "before" figures).
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from apex.bench.timing import print_table
from apex.checkpoint import CheckpointWriter, find_latest
from apex.replay import StackedReplay

CAPACITY = 250_000
CHUNK = 64
FRAME = (84, 84)
STACK, N_STEP = 4, 3


def _replay(capacity: int) -> StackedReplay:
    return StackedReplay(FRAME, np.uint8, STACK, capacity, capacity + capacity // 8 + 4096, seed=0)


def _chunk(frames: np.ndarray) -> dict[str, np.ndarray]:
    obs = np.arange(CHUNK)
    return {
        "frames": frames,
        "obs_frame": obs.astype(np.int32),
        "next_obs_frame": (obs + N_STEP).astype(np.int32),
        "action": np.zeros(CHUNK, np.int64),
        "reward": np.ones(CHUNK, np.float32),
        "discount": np.ones(CHUNK, np.float32),
        "priority": np.ones(CHUNK, np.float32),
    }


def _latency(calls: list[tuple[float, float]], start: float, stop: float) -> dict[str, float | None]:
    inside = [d for t, d in calls if start <= t < stop]
    if not inside:
        return {"inserts_per_s": 0.0, "median_ms": None, "p99_ms": None, "max_ms": None}
    return {
        "inserts_per_s": round(len(inside) / (stop - start), 1),
        "median_ms": round(float(np.median(inside)) * 1e3, 3),
        "p99_ms": round(float(np.percentile(inside, 99)) * 1e3, 2),
        "max_ms": round(max(inside) * 1e3, 1),
    }


def run(seconds: float = 2.0, capacity: int = CAPACITY) -> dict[str, Any]:
    """``seconds``: how long the inserter runs alone before the checkpoint (the baseline)."""
    replay = _replay(capacity)
    chunk = _chunk(np.random.default_rng(0).integers(0, 255, (CHUNK + STACK - 1 + N_STEP, *FRAME), dtype=np.uint8))
    while replay.total_added < capacity + CHUNK:
        replay.add(chunk)
    stop = threading.Event()
    calls: list[tuple[float, float]] = []

    def insert() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            replay.add(chunk)
            calls.append((started, time.perf_counter() - started))
            time.sleep(0.001)  # an ingest thread also receives and decodes between inserts

    with tempfile.TemporaryDirectory(prefix="apex-bench-ckpt-") as tmp:
        thread = threading.Thread(target=insert, daemon=True)
        thread.start()
        time.sleep(seconds)
        writer = CheckpointWriter(Path(tmp), keep=1)
        write_start = time.perf_counter()
        writer.save("ckpt-000000001", {"config": {}}, replay)
        write_stop = time.perf_counter()
        stop.set()
        thread.join()
        if writer.failures:
            raise RuntimeError("the checkpoint could not be written: see the log above")
        start = time.perf_counter()
        checkpoint = find_latest(Path(tmp))
        verify_s = time.perf_counter() - start
        restored = _replay(capacity)
        start = time.perf_counter()
        checkpoint.load_replay(restored)
        load_s = time.perf_counter() - start
        size = sum(f["bytes"] for f in checkpoint.manifest["files"].values())
    before = _latency(calls, write_start - seconds, write_start)
    during = _latency(calls, write_start, write_stop)
    result = {
        "baseline": "the same inserter with no checkpoint being written (before)",
        "replay_transitions": len(replay),
        "replay_nbytes": replay.nbytes,
        "checkpoint_bytes": size,
        "write_seconds": round(write_stop - write_start, 2),
        "restored_transitions": len(restored),
        "inserts_before": before,
        "inserts_during": during,
        "verify_seconds": round(verify_s, 2),
        "load_seconds": round(load_s, 2),
    }
    print_table(
        f"checkpoint: a Pong-sized replay ({len(replay):,} transitions, {replay.nbytes / 1e9:.2f} GB) written "
        f"while a thread inserts {CHUNK}-transition chunks",
        [
            "GB written",
            "write s",
            "restored",
            "inserts/s before",
            "inserts/s during",
            "insert ms median / p99 / max",
            "verify s",
            "load s",
        ],
        [
            [
                round(size / 1e9, 2),
                result["write_seconds"],
                f"{len(restored):,} of {len(replay):,}",
                before["inserts_per_s"],
                during["inserts_per_s"],
                f"{during['median_ms']} / {during['p99_ms']} / {during['max_ms']}",
                result["verify_seconds"],
                result["load_seconds"],
            ]
        ],
    )
    return result
