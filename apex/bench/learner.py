"""`apex bench learner`: Ape-X train steps per second at batch 512.

For the MLP (CartPole) and the Nature CNN (Atari, 4x84x84 stacks), on the CPU and on CUDA
where present: a full learner step (prioritized sample, stack gather, host-to-device copy,
double-DQN update, priority write-back) against the update alone on a batch already on the
device, so the cost of the replay and the copies shows as the difference.
"""

from __future__ import annotations

import numpy as np
import torch

from apex import config as config_module
from apex.algos.apex_dqn import Learner
from apex.bench import batches
from apex.bench.timing import print_table, summarize, time_calls
from apex.envs import EnvSpec

BATCH = 512
MODELS = {
    "mlp": (EnvSpec((4,), np.dtype(np.float32), 1, 2), batches.cartpole_chunk),
    "nature_cnn": (EnvSpec((84, 84), np.dtype(np.uint8), 4, 6), lambda: batches.atari()[0]),
}


def devices() -> list[str]:
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _learner(spec: EnvSpec, make_chunk, device: str) -> Learner:
    config = config_module.load(None, [
        f"learner.batch_size={BATCH}", "replay.capacity=20000", "replay.min_size=1000",
        "replay.samples_per_insert=1e-9", "replay.rate_slack=1000000000000", f"learner.device={device}",
    ])
    learner = Learner(config, spec, torch.device(device))
    chunk = make_chunk()
    while len(learner.replay) < 10_000:
        learner.insert(chunk)
    return learner


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(model: str, spec: EnvSpec, make_chunk, device: str, seconds: float) -> dict:
    learner = _learner(spec, make_chunk, device)
    sample, _, weights = learner.replay.sample(BATCH, 0.4)
    on_device = learner.to_device({**sample, "weights": weights})

    def full_step() -> None:
        learner.step()
        _sync(device)

    def update_only() -> None:
        learner.train_on(on_device)
        _sync(device)

    # The CNN on one CPU core takes seconds a step: a few calls suffice there.
    calls = dict(warmup=2, min_calls=3, seconds=seconds)
    full = summarize(time_calls(full_step, **calls))
    bare = summarize(time_calls(update_only, **calls))
    return {
        "model": model,
        "device": device,
        "batch": BATCH,
        "batches_per_s": round(1e6 / full["p50_us"], 2),
        "samples_per_s": round(BATCH * 1e6 / full["p50_us"]),
        "step_p50_ms": round(full["p50_us"] / 1e3, 2),
        "update_only_batches_per_s": round(1e6 / bare["p50_us"], 2),
        "update_only_p50_ms": round(bare["p50_us"] / 1e3, 2),
        "replay_and_copy_share": round(1 - bare["p50_us"] / full["p50_us"], 3),
    }


def run(seconds: float = 2.0) -> dict:
    torch.set_num_threads(1)
    rows = []
    for model, (spec, make_chunk) in MODELS.items():
        for device in devices():
            rows.append(_measure(model, spec, make_chunk, device, seconds))
    print_table(
        f"learner: Ape-X train steps at batch {BATCH} (torch threads 1 on CPU)",
        ["model", "device", "batches/s", "samples/s", "update only batches/s", "replay + copy share"],
        [[r["model"], r["device"], r["batches_per_s"], r["samples_per_s"], r["update_only_batches_per_s"],
          f"{100 * r['replay_and_copy_share']:.0f}%"] for r in rows],
    )
    return {"baseline": "the same update on a batch already on the device (update_only_*)", "results": rows}
