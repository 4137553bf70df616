"""apex.training.pipeline and the cores' three stages: what the pipelined learner trains on is what a
step in a row would, priorities and counts come back, skips are decided alike on the host and
on the device, and a bug in the prefetch thread is reported without stopping it."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from apex import config as config_module
from apex.algos.apex_dqn.learner import PREFETCH_BYTES, ApexDqnLearner, prefetch_depth
from apex.envs.make import EnvSpec
from apex.replay import StackedReplay
from apex.training import optim
from apex.training.pipeline import Pipeline, SectionTimes

SPEC = EnvSpec((3,), np.dtype(np.float32), 1, 2)


def bandit_chunk(n: int, seed: int = 0) -> dict:
    """One state; action 0 pays 1, action 1 pays 0; episodes end at once."""
    action = np.random.default_rng(seed).integers(0, 2, n)
    return {
        "frames": np.zeros((n + 1, 3), np.float32),
        "obs_frame": np.zeros(n, np.int32),
        "next_obs_frame": np.ones(n, np.int32),
        "action": action,
        "reward": (action == 0).astype(np.float32),
        "discount": np.zeros(n, np.float32),
        "priority": np.ones(n, np.float32),
    }


def learner(*overrides: str) -> ApexDqnLearner:
    config = config_module.load(
        None,
        [
            "apex_dqn.batch_size=32",
            "apex_dqn.lr=1e-2",
            "apex_dqn.replay.min_size=64",
            "apex_dqn.replay_ratio=1e-9",
            "apex_dqn.replay.rate_slack=1000000000",
            *overrides,
        ],
    )
    core = ApexDqnLearner(config, SPEC, torch.device("cpu"))
    core.insert(bandit_chunk(1000))
    return core


def run_pipeline(core, steps: int) -> tuple[list[dict], SectionTimes]:
    times = SectionTimes()
    pipeline = Pipeline(core, times)
    pipeline.start()
    metrics = []
    try:
        for _ in range(steps):
            deadline = time.monotonic() + 10
            while (staged := pipeline.take()) is None:
                assert time.monotonic() < deadline, "nothing staged in 10 s"
                time.sleep(0.001)
            started = time.perf_counter()
            pipeline.submit(core.train(staged))
            times.add("train", time.perf_counter() - started)
            times.steps += 1
            metrics += pipeline.results()
    finally:
        pipeline.stop()
    return metrics + pipeline.results(), times


def test_the_pipeline_trains_every_staged_batch_and_writes_every_priority_back():
    core = learner("apex_dqn.prefetch_batches=4")
    metrics, times = run_pipeline(core, 60)
    assert len(metrics) == 60 and all(m["loss"] >= 0 for m in metrics)  # each step's metrics, none lost
    assert core.updates == core.steps == 60 and core.skipped_updates == 0
    # every sampled batch was trained on: the limiter counted what was staged, at most a refill more
    assert 60 * 32 <= core.limiter.samples <= (60 + 4) * 32
    q = core.online(torch.zeros(1, 1, 3)).detach()[0]
    assert q[0] > q[1]  # it learned the better arm
    assert core.replay.priorities(np.arange(1000)).min() < 1.0  # written back: the initial ones were all 1
    sections = times.take()
    assert sections["time_train_ms"] > 0 and sections["time_sample_ms"] > 0 and sections["time_write_back_ms"] > 0


def test_the_default_depth_is_sized_by_the_staged_batches_memory():
    """apex_dqn.prefetch_batches null: as many batches as 256 MiB hold, 2 to 64."""
    cartpole = EnvSpec((4,), np.dtype(np.float32), 1, 2)
    atari = EnvSpec((84, 84), np.dtype(np.uint8), 4, 6)
    assert prefetch_depth(cartpole, 512) == 64 and prefetch_depth(atari, 512) == 9
    assert prefetch_depth(EnvSpec((210, 160, 3), np.dtype(np.uint8), 4, 6), 4096) == 2
    for spec, size in ((cartpole, 512), (atari, 512), (atari, 100)):
        depth = prefetch_depth(spec, size)
        assert depth == 64 or depth * size * 2 * spec.stack * np.prod(spec.frame_shape) <= PREFETCH_BYTES
    assert learner().prefetch_batches == prefetch_depth(learner().spec, 32)
    assert learner("apex_dqn.prefetch_batches=4").prefetch_batches == 4
    with pytest.raises(config_module.ConfigError, match="prefetch_batches must be in 1..64 or null"):
        config_module.load(None, ["apex_dqn.prefetch_batches=0"])


def test_batches_drawn_together_each_span_the_whole_replay():
    replay = StackedReplay((3,), np.float32, 1, capacity=10_000, frame_capacity=20_000, seed=0)
    replay.add(bandit_chunk(10_000))
    batch, indices, weights = replay.sample(64, 0.4, batches=8)
    assert len(indices) == 512 and len(weights) == 512 and len(batch["obs"]) == 512
    for k in range(8):  # equal priorities: every batch covers the replay from end to end
        part = indices[64 * k : 64 * (k + 1)]
        assert part.min() < 1_000 and part.max() > 9_000


@pytest.mark.parametrize("skipped", [None, 0, 1, 2])
def test_finishing_several_steps_together_equals_finishing_them_one_by_one(skipped):
    """Also with one step among them skipped (a NaN reward): its metrics {}, the transitions
    it trained on dropped, the others' priorities written back all the same."""
    one_by_one, together = learner(), learner()
    pending = {}
    for core in (one_by_one, together):
        staged = core.sample(3)
        if skipped is not None:
            reward = staged[skipped].tensors["reward"] = staged[skipped].tensors["reward"].clone()
            reward[3] = float("nan")
        pending[id(core)] = [core.train(s) for s in staged]
    metrics = [one_by_one.finish([p])[0] for p in pending[id(one_by_one)]]
    assert together.finish(pending[id(together)]) == metrics
    assert [m == {} for m in metrics] == [k == skipped for k in range(3)]
    np.testing.assert_array_equal(
        one_by_one.replay.priorities(np.arange(1000)), together.replay.priorities(np.arange(1000))
    )
    counts = ("updates", "skipped_updates", "dropped_transitions")
    assert [getattr(together, c) for c in counts] == [getattr(one_by_one, c) for c in counts]
    assert together.updates == (3 if skipped is None else 2)
    trained_on = 0 if skipped is None else len(np.unique(pending[id(together)][skipped].context))
    assert together.dropped_transitions == trained_on


@pytest.mark.parametrize("on_device", [False, True])
def test_a_non_finite_step_is_skipped_on_the_host_or_on_the_device_alike(monkeypatch, on_device):
    """Fused Adam skips on the device (found_inf) on CUDA; the same path runs on the CPU here."""
    monkeypatch.setattr(optim, "skips_on_device", lambda optimizer: on_device)
    core = learner()
    before = {k: v.clone() for k, v in core.online.state_dict().items()}
    staged = core.sample()[0]
    staged.tensors["reward"] = staged.tensors["reward"].clone()
    staged.tensors["reward"][3] = float("nan")
    (metrics,) = core.finish([core.train(staged)])
    assert metrics == {} and core.skipped_updates == 1 and core.updates == 0
    trained_on = np.unique(staged.context)
    assert core.dropped_transitions == len(trained_on) > 1  # all it trained on, not only the NaN one
    assert (core.replay.priorities(trained_on) == 0).all()  # never sampled again
    for name, value in core.online.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)
    assert core.step()["loss"] >= 0 and core.updates == 1  # and the next finite step goes through


def test_device_and_host_skip_paths_take_the_same_finite_step(monkeypatch):
    results = []
    for on_device in (False, True):
        monkeypatch.setattr(optim, "skips_on_device", lambda optimizer, d=on_device: d)
        core = learner()
        core.step()
        results.append({k: v.clone() for k, v in core.online.state_dict().items()})
    for name in results[0]:
        torch.testing.assert_close(results[0][name], results[1][name])


def test_a_bug_in_the_prefetch_thread_is_reported_and_the_thread_goes_on():
    core = learner()
    real_prepare, calls = core.prepare, []

    def flaky(timeout, most=1):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return real_prepare(timeout, most)

    core.prepare = flaky
    errors = []
    reported = threading.Event()
    pipeline = Pipeline(core, SectionTimes(), on_error=lambda e: (errors.append(e), reported.set()))
    pipeline.start()
    try:
        assert reported.wait(10)
        deadline = time.monotonic() + 10
        while (staged := pipeline.take()) is None:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        pipeline.submit(core.train(staged))
    finally:
        pipeline.stop()
    assert [str(e) for e in errors] == ["a bug"] and core.updates == 1
