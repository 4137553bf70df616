"""apex.distributed: the data-parallel group's step (gloo, two real processes)."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from apex import config as config_module
from apex.algos.apex_dqn import Learner as ApexLearner
from apex.bench.transport import free_port
from apex.distributed import GradientAllReduce, Rank, init_group, leave_group
from apex.envs import EnvSpec
from apex.errors import ApexError
from apex.pipeline import Staged

SPEC = EnvSpec((3,), np.dtype(np.float32), 1, 2)
BATCH = 64


def bandit_learner(grad_clip: float) -> ApexLearner:
    config = config_module.load(None, ["learner.batch_size=64", "learner.lr=1e-2", f"learner.grad_clip={grad_clip}",
                                       "learner.device=cpu", "seed=7"])
    core = ApexLearner(config, SPEC, torch.device("cpu"))
    rng = np.random.default_rng(0)
    n = 500
    action = rng.integers(0, 2, n)
    core.insert({"frames": rng.standard_normal((n + 1, 3)).astype(np.float32),
                 "obs_frame": np.arange(n, dtype=np.int32), "next_obs_frame": np.arange(1, n + 1, dtype=np.int32),
                 "action": action, "reward": (action == 0).astype(np.float32),
                 "discount": np.full(n, 0.9, np.float32), "priority": rng.random(n).astype(np.float32) + 0.1})
    return core


def one_step(core: ApexLearner, batch: dict[str, np.ndarray]) -> dict:
    metrics = core.finish([core.train(Staged({k: torch.from_numpy(v) for k, v in batch.items()}, np.arange(len(batch["action"]))))])[0]
    return metrics


def grads(core: ApexLearner) -> dict[str, np.ndarray]:
    return {name: p.grad.numpy().copy() for name, p in core.online.named_parameters()}


def _rank_main(rank: int, world: int, port: int, grad_clip: float, batch: dict, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    init_group(Rank(rank, world, f"127.0.0.1:{port}"), torch.device("cpu"))
    try:
        core = bandit_learner(grad_clip)
        core.all_reduce = GradientAllReduce(world)
        size = BATCH // world
        metrics = one_step(core, {k: v[rank * size : (rank + 1) * size] for k, v in batch.items()})
        out.put((rank, metrics, grads(core), {k: v.numpy().copy() for k, v in core.online.state_dict().items()}))
    finally:
        leave_group()


@pytest.mark.parametrize("grad_clip", [1e6, 0.5])  # unclipped, and clipped after the average
def test_an_all_reduced_step_equals_one_step_on_the_concatenated_batch(grad_clip):
    reference = bandit_learner(grad_clip)
    sampled, _, weights = reference.replay.sample(BATCH, 0.4)
    batch = {**sampled, "weights": weights}
    before = {k: v.clone() for k, v in reference.online.state_dict().items()}
    one_step(reference, batch)
    expected, expected_grads = reference.online.state_dict(), grads(reference)
    assert any(not torch.equal(before[k], expected[k]) for k in expected)  # the step moved the network

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_rank_main, args=(r, 2, port, grad_clip, batch, out)) for r in range(2)]
    for p in ranks:
        p.start()
    results = [out.get(timeout=120) for _ in ranks]
    for p in ranks:
        p.join(timeout=30)
        assert p.exitcode == 0
    for _, metrics, rank_grads, state in results:
        assert metrics  # applied, not skipped
        for name, value in expected_grads.items():  # the averaged (then clipped) gradient is the whole batch's
            np.testing.assert_allclose(rank_grads[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("args, message", [
    ((2, 2, "127.0.0.1:5000"), "--rank must be in 0..1"),
    ((0, 0, "127.0.0.1:5000"), "--world-size must be >= 1"),
    ((0, 2, "nohost"), "--master must be HOST:PORT"),
    ((0, 2, "127.0.0.1:99999"), "--master must be HOST:PORT"),
])
def test_rank_arguments_are_checked(args, message):
    with pytest.raises(ApexError, match=message):
        Rank.checked(*args)


def test_rank_from_torchrun_variables():
    assert Rank.from_environment({}) is None
    rank = Rank.from_environment({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"})
    assert rank == Rank(1, 2, "10.0.0.5:29500", by_environment=True) and not rank.is_leader
    assert Rank.checked(1, 2, "10.0.0.5:29500").by_environment is False
    with pytest.raises(ApexError, match="MASTER_PORT"):
        Rank.from_environment({"RANK": "1", "WORLD_SIZE": "2"})
