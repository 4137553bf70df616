"""`apex bench sumtree`: the native sum tree against a vectorised NumPy one, in one run.

For each capacity, both trees are filled with random priorities and then timed on the
operations a prioritized-replay learner performs, each on a batch of 512 unless noted:
  update        set 512 random leaves
  sample        stratified sample of 512 leaves (uniforms drawn from a NumPy Generator)
  learner_step  sample 512, then update those 512 with new priorities
  insert_64     set 64 consecutive leaves at a moving ring position (an actor's batch)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from apex.bench.numpy_sumtree import NumpySumTree
from apex.bench.timing import print_records, summarize, time_calls
from apex.native import SumTree

CAPACITIES = (2**20, 2**16)
BATCH = 512
INSERT = 64
POOL = 64  # pre-drawn index/priority arrays, cycled so that drawing them is not timed


def _operations(tree: SumTree | NumpySumTree, capacity: int, seed: int) -> dict[str, Callable[[], None]]:
    rng = np.random.default_rng(seed)
    indices = [rng.integers(0, capacity, BATCH) for _ in range(POOL)]
    priorities = [rng.random(BATCH) + 0.01 for _ in range(POOL)]
    inserts = [rng.random(INSERT) + 0.01 for _ in range(POOL)]
    sample_rng = np.random.default_rng(seed + 1)
    state = {"i": 0, "ring": 0}

    def next_i() -> int:
        state["i"] = (state["i"] + 1) % POOL
        return state["i"]

    def update() -> None:
        i = next_i()
        tree.update(indices[i], priorities[i])

    def sample() -> None:
        tree.sample(BATCH, sample_rng)

    def learner_step() -> None:
        idx, _ = tree.sample(BATCH, sample_rng)
        tree.update(idx, priorities[next_i()])

    def insert_64() -> None:
        start = state["ring"]
        state["ring"] = (start + INSERT) % (capacity - INSERT)
        tree.update(np.arange(start, start + INSERT), inserts[next_i()])

    return {
        "update": update,
        "sample": sample,
        "learner_step": learner_step,
        "insert_64": insert_64,
    }


def run(seconds: float = 1.0, capacities: tuple[int, ...] = CAPACITIES) -> dict[str, Any]:
    """Times every operation on both trees; returns rows for the JSON report."""
    rows = []
    for capacity in capacities:
        fill = np.random.default_rng(0).random(capacity) + 0.01
        trees: dict[str, SumTree | NumpySumTree] = {"native": SumTree(capacity), "numpy": NumpySumTree(capacity)}
        for tree in trees.values():
            tree.update(np.arange(capacity), fill)
        ops = {name: _operations(tree, capacity, seed=1) for name, tree in trees.items()}
        for op in ops["native"]:
            figures = {name: summarize(time_calls(ops[name][op], seconds=seconds)) for name in trees}
            rows.append(
                {
                    "capacity": capacity,
                    "batch": INSERT if op == "insert_64" else BATCH,
                    "op": op,
                    "native_p50_us": figures["native"]["p50_us"],
                    "native_ops_per_s": figures["native"]["ops_per_s"],
                    "numpy_p50_us": figures["numpy"]["p50_us"],
                    "numpy_ops_per_s": figures["numpy"]["ops_per_s"],
                    "speedup_vs_numpy": round(figures["numpy"]["p50_us"] / figures["native"]["p50_us"], 2),
                }
            )
    print_records(
        "sumtree: native vs vectorised NumPy (median per call)",
        [
            ("capacity", "capacity"),
            ("op", "op"),
            ("batch", "batch"),
            ("native µs", "native_p50_us"),
            ("native ops/s", "native_ops_per_s"),
            ("numpy µs", "numpy_p50_us"),
            ("speedup", "speedup_vs_numpy"),
        ],
        rows,
    )
    return {"baseline": "vectorised NumPy sum tree (apex.bench.numpy_sumtree)", "results": rows}
