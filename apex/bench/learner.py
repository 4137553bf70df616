"""`apex bench learner`: Ape-X train steps per second at batch 512.

For the MLP (CartPole) and the Nature CNN (Atari, 4x84x84 stacks), on the CPU and on CUDA
where present, three ways over the same replay:
  pipelined    as the learner process runs (apex.training.pipeline): a prefetch thread keeps
               apex_dqn.prefetch_batches batches staged, sampling half of them at a time and
               writing back the priorities of the steps trained since, while the main thread
               trains; with the time per section
  sequential   sample, copy, train, write back, one after the other (``ApexDqnLearner.step``)
  update only  the update alone on batches already on the device (16, in turn), its results
               read back: what the pipeline is measured against (``pipelined / update only``)
Rates are steps over wall time (the CNN on one CPU core takes ~0.5 s a step: a few steps).

With ``--ranks 1,2,...`` it also runs that many learner processes as one data-parallel group
(apex.training.distributed: each rank trains its own batch from its own replay, the gradients
all-reduced; gloo on the CPU, NCCL on CUDA): batches/s of the group, samples/s of all ranks,
and the scaling efficiency against one process (samples/s over ranks times one process's).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.queues
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from apex import config as config_module
from apex.algos.apex_dqn.learner import ApexDqnLearner
from apex.bench import batches
from apex.bench.timing import print_records
from apex.bench.transport import free_port
from apex.envs.make import EnvSpec
from apex.system.malloc import keep_large_blocks
from apex.training.pipeline import Pipeline, SectionTimes

BATCH = 512
MakeChunk = Callable[[], dict[str, np.ndarray]]  # a batch as an actor sends it
Steps = Callable[[int], None]  # runs n train steps
MODELS: dict[str, tuple[EnvSpec, MakeChunk]] = {
    "mlp": (EnvSpec((4,), np.dtype(np.float32), 1, 2), batches.cartpole_chunk),
    "nature_cnn": (EnvSpec((84, 84), np.dtype(np.uint8), 4, 6), lambda: batches.atari()[0]),
}
WARMUP_STEPS = 2
MIN_STEPS = 3
ROUNDS = 8  # turns of each mode, taken in turn
UPDATE_ONLY_BATCHES = 16


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _learner(spec: EnvSpec, make_chunk: MakeChunk, device: str) -> ApexDqnLearner:
    config = config_module.load(
        None,
        [
            f"apex_dqn.batch_size={BATCH}",
            "apex_dqn.replay.capacity=20000",
            "apex_dqn.replay.min_size=1000",
            "apex_dqn.replay_ratio=1e-9",
            "apex_dqn.replay.rate_slack=1000000000000",
            f"learner.device={device}",
        ],
    )
    learner = ApexDqnLearner(config, spec, torch.device(device))
    chunk = make_chunk()
    while len(learner.replay) < 10_000:
        learner.insert(chunk)
    return learner


def _interleaved_rates(modes: dict[str, Callable[[], Steps]], seconds: float, rounds: int) -> dict[str, float]:
    """Steps per second of each mode (name: a function making ``run_steps(n)``, which may
    have a ``close``), measured in ``rounds`` short turns each, taken in turn, so that the
    machine's drift (other tenants of a VM) weighs on every mode alike."""
    steps, elapsed = dict.fromkeys(modes, 0), dict.fromkeys(modes, 0.0)
    for _ in range(rounds):
        for name, make in modes.items():
            run_steps = make()
            try:
                run_steps(WARMUP_STEPS)
                start, n = time.perf_counter(), 0
                while n < max(1, MIN_STEPS // rounds) or time.perf_counter() - start < seconds / rounds:
                    run_steps(1)
                    n += 1
                elapsed[name] += time.perf_counter() - start
                steps[name] += n
            finally:
                getattr(run_steps, "close", lambda: None)()
    return {name: steps[name] / elapsed[name] for name in modes}


def _update_only(learner: ApexDqnLearner) -> Steps:
    """The update alone: batches already on the device (UPDATE_ONLY_BATCHES of them, taken in
    turn: one batch over and over would stay in the caches as no real batch does), results read."""
    staged = itertools.cycle(learner.sample(UPDATE_ONLY_BATCHES))

    def run(n: int) -> None:
        for _ in range(n):
            learner.train(next(staged)).result()

    return run


def _sequential(learner: ApexDqnLearner) -> Steps:
    def run(n: int) -> None:
        for _ in range(n):
            learner.step()

    return run


class _Pipelined:
    """The learner process's loop without sockets (apex.training.pipeline.Pipeline): the prefetch
    thread stages batches and writes results back, the main thread trains."""

    def __init__(self, learner: ApexDqnLearner, times: SectionTimes) -> None:
        self.learner = learner
        self.times = times
        self.pipeline = Pipeline(learner, times)
        self.pipeline.start()
        self.warm = False

    def __call__(self, n: int) -> None:
        times = self.times if self.warm else SectionTimes()  # the warm-up steps are not counted
        self.warm = True
        for _ in range(n):
            started = time.perf_counter()
            while (staged := self.pipeline.take()) is None:
                time.sleep(0)
            trained = time.perf_counter()
            times.add("idle", trained - started)
            self.pipeline.submit(self.learner.train(staged))
            times.add("train", time.perf_counter() - trained)
            times.steps += 1
            self.pipeline.results()

    def close(self) -> None:
        self.pipeline.stop()


def _measure(model: str, spec: EnvSpec, make_chunk: MakeChunk, device: str, seconds: float) -> dict[str, Any]:
    learner = _learner(spec, make_chunk, device)
    times = SectionTimes()
    rounds = 1 if model == "nature_cnn" and device == "cpu" else ROUNDS  # ~0.5 s a step there
    rates = _interleaved_rates(
        {
            "update_only": lambda: _update_only(learner),
            "sequential": lambda: _sequential(learner),
            "pipelined": lambda: _Pipelined(learner, times),
        },
        seconds,
        rounds,
    )
    return {
        "model": model,
        "device": device,
        "batch": BATCH,
        "batches_per_s": round(rates["pipelined"], 2),
        "samples_per_s": round(BATCH * rates["pipelined"]),
        "sequential_batches_per_s": round(rates["sequential"], 2),
        "update_only_batches_per_s": round(rates["update_only"], 2),
        "pipelined_vs_update_only": round(rates["pipelined"] / rates["update_only"], 3),
        **times.take(),
    }


def _rank_main(
    rank: int,
    ranks: int,
    port: int,
    model: str,
    device: str,
    steps: int,
    secret: bytes,
    out: multiprocessing.queues.Queue[tuple[int, int, float, dict[str, float]]],
) -> None:
    """One rank of a data-parallel group: the pipelined loop with the gradient all-reduce
    for ``steps`` steps after a warm-up; reports (steps, seconds, ms per step by section)."""
    # torch.distributed only in the ranks' processes (its import costs the one-process run a second)
    from apex.training.distributed import GradientAllReduce, init_group, leave_group
    from apex.training.rank import Rank

    torch.set_num_threads(1)
    keep_large_blocks()
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    init_group(Rank(rank, ranks, f"127.0.0.1:{port}"), torch.device(device), lambda: secret)
    try:
        spec, make_chunk = MODELS[model]
        learner = _learner(spec, make_chunk, device)
        learner.all_reduce = GradientAllReduce(ranks)
        times = SectionTimes()
        loop = _Pipelined(learner, times)
        try:
            loop(WARMUP_STEPS)
            torch.distributed.barrier()
            start = time.perf_counter()
            loop(steps)
            elapsed = time.perf_counter() - start
        finally:
            loop.close()
        out.put((rank, steps, elapsed, times.take()))
    finally:
        leave_group()


def _measure_ranks(model: str, device: str, ranks: int, steps: int) -> dict[str, Any]:
    """Batches/s of ``ranks`` learner processes training together (each its own batch of
    BATCH from its own replay, gradients all-reduced): the slowest rank's time."""
    ctx = mp.get_context("spawn")
    out: multiprocessing.queues.Queue[tuple[int, int, float, dict[str, float]]] = ctx.Queue()
    port = free_port()
    secret = os.urandom(32)  # the group store's (apex.training.rendezvous), handed to each rank
    procs = [
        ctx.Process(target=_rank_main, args=(r, ranks, port, model, device, steps, secret, out), daemon=True)
        for r in range(ranks)
    ]
    for p in procs:
        p.start()
    try:
        reports = [out.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    elapsed = max(seconds for _, _, seconds, _ in reports)
    leader = next(sections for rank, _, _, sections in reports if rank == 0)
    rate = steps / elapsed
    return {
        "model": model,
        "device": device,
        "ranks": ranks,
        "batch": BATCH,
        "batches_per_s": round(rate, 2),
        "samples_per_s": round(ranks * BATCH * rate),
        **leader,
    }


def run(seconds: float = 2.0, ranks: tuple[int, ...] = (1,)) -> dict[str, Any]:
    """``ranks``: the group sizes to measure (1: the single process, with its sequential and
    update-only comparisons; more: that many learner processes over torch.distributed, gloo on
    the CPU, NCCL on CUDA, each rank on its own GPU where there are enough)."""
    torch.set_num_threads(1)
    rows = []
    for model, (spec, make_chunk) in MODELS.items():
        for device in devices():
            single = _measure(model, spec, make_chunk, device, seconds)
            rows.append({"ranks": 1, **single, "scaling_efficiency": 1.0})
            for size in sorted(set(ranks) - {1}):
                # as many steps as one process makes in ``seconds``: the same work per rank
                steps = max(MIN_STEPS, round(seconds * single["batches_per_s"]))
                row = _measure_ranks(model, device, size, steps)
                row["scaling_efficiency"] = round(row["samples_per_s"] / (size * single["samples_per_s"]), 3)
                rows.append(row)
    print_records(
        f"learner: Ape-X train steps at batch {BATCH} a rank (torch threads 1 on CPU); ms per step by section",
        [
            ("model", "model"),
            ("device", "device"),
            ("ranks", "ranks"),
            ("batches/s", "batches_per_s"),
            ("samples/s", "samples_per_s"),
            ("scaling", "scaling_efficiency"),
            ("update only", "update_only_batches_per_s"),
            ("pipelined / update only", "pipelined_vs_update_only"),
            ("sequential", "sequential_batches_per_s"),
            ("sample", "time_sample_ms"),
            ("to device", "time_to_device_ms"),
            ("train", "time_train_ms"),
            ("write back", "time_write_back_ms"),
            ("idle", "time_idle_ms"),
        ],
        [
            {"update_only_batches_per_s": "", "pipelined_vs_update_only": "", "sequential_batches_per_s": "", **r}
            for r in rows
        ],
    )
    return {
        "baseline": "one process: the same update on a batch already on the device (update_only_*), and the "
        "unpipelined step (sequential_*); ranks > 1: one rank's samples/s times the ranks "
        "(scaling_efficiency)",
        "results": rows,
    }
