"""apex.training.distributed: the data-parallel group's step (gloo, two real processes)."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch

from apex import config as config_module
from apex.algos.apex_dqn.learner import ApexDqnLearner
from apex.bench.transport import free_port
from apex.envs.make import EnvSpec
from apex.errors import ApexError
from apex.training.distributed import GradientAllReduce, init_group, leave_group
from apex.training.pipeline import Staged
from apex.training.rank import Rank
from tests.support.sockets import listening_sockets, non_loopback_address

SPEC = EnvSpec((3,), np.dtype(np.float32), 1, 2)
BATCH = 64


def bandit_learner(grad_clip: float) -> ApexDqnLearner:
    config = config_module.load(
        None,
        [
            "apex_dqn.batch_size=64",
            "apex_dqn.lr=1e-2",
            f"apex_dqn.grad_clip={grad_clip}",
            "learner.device=cpu",
            "seed=7",
        ],
    )
    core = ApexDqnLearner(config, SPEC, torch.device("cpu"))
    rng = np.random.default_rng(0)
    n = 500
    action = rng.integers(0, 2, n)
    core.insert(
        {
            "frames": rng.standard_normal((n + 1, 3)).astype(np.float32),
            "obs_frame": np.arange(n, dtype=np.int32),
            "next_obs_frame": np.arange(1, n + 1, dtype=np.int32),
            "action": action,
            "reward": (action == 0).astype(np.float32),
            "discount": np.full(n, 0.9, np.float32),
            "priority": rng.random(n).astype(np.float32) + 0.1,
        }
    )
    return core


def one_step(core: ApexDqnLearner, batch: dict[str, np.ndarray]) -> dict:
    metrics = core.finish(
        [core.train(Staged({k: torch.from_numpy(v) for k, v in batch.items()}, np.arange(len(batch["action"]))))]
    )[0]
    return metrics


SECRET = b"the test group's secret, 32 bytes"[:32]  # the store's (apex.training.rendezvous)


def grads(core: ApexDqnLearner) -> dict[str, np.ndarray]:
    return {name: p.grad.numpy().copy() for name, p in core.online.named_parameters()}


def _rank_main(
    rank: int, world: int, port: int, grad_clip: float, batch: dict, out: mp.Queue, without_batch: tuple[int, ...] = ()
) -> None:
    """One step of the group on a share of ``batch`` (ranks in ``without_batch`` have none)."""
    torch.set_num_threads(1)
    init_group(Rank(rank, world, f"127.0.0.1:{port}"), torch.device("cpu"), lambda: SECRET)
    try:
        core = bandit_learner(grad_clip)
        core.all_reduce = GradientAllReduce(world)
        if rank in without_batch:
            priorities = core.replay.priority_stats()
            metrics = core.finish([core.train_without_batch()])[0]
            assert core.replay.priority_stats() == priorities and core.updates == core.steps == 1
        else:
            ranks = [r for r in range(world) if r not in without_batch]
            size = BATCH // len(ranks)
            share = ranks.index(rank)
            metrics = one_step(core, {k: v[share * size : (share + 1) * size] for k, v in batch.items()})
        out.put((rank, metrics, grads(core), {k: v.numpy().copy() for k, v in core.online.state_dict().items()}))
    finally:
        leave_group()


def group_step(batch: dict, grad_clip: float, world: int, without_batch: tuple[int, ...] = ()) -> list:
    """(rank, metrics, gradients, network) of each of ``world`` ranks after one step."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    ranks = [
        ctx.Process(target=_rank_main, args=(r, world, port, grad_clip, batch, out, without_batch))
        for r in range(world)
    ]
    for p in ranks:
        p.start()
    results = sorted(out.get(timeout=120) for _ in ranks)
    for p in ranks:
        p.join(timeout=30)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("grad_clip", [1e6, 0.5])  # unclipped, and clipped after the average
def test_an_all_reduced_step_equals_one_step_on_the_concatenated_batch(grad_clip):
    reference = bandit_learner(grad_clip)
    sampled, _, weights = reference.replay.sample(BATCH, 0.4)
    batch = {**sampled, "weights": weights}
    before = {k: v.clone() for k, v in reference.online.state_dict().items()}
    one_step(reference, batch)
    expected, expected_grads = reference.online.state_dict(), grads(reference)
    assert any(not torch.equal(before[k], expected[k]) for k in expected)  # the step moved the network

    for _, metrics, rank_grads, state in group_step(batch, grad_clip, 2):
        assert metrics  # applied, not skipped
        for name, value in expected_grads.items():  # the averaged (then clipped) gradient is the whole batch's
            np.testing.assert_allclose(rank_grads[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_a_rank_without_a_batch_adds_no_gradient_and_takes_the_groups_step():
    """Of three ranks, rank 1 has no batch (its actors are silent): ranks 0 and 2 step on
    theirs, rank 1 steps without one; every rank ends with the network of one step on the
    batches of ranks 0 and 2 alone (the average is over the ranks that had a batch), and
    rank 1's replay priorities are untouched."""
    reference = bandit_learner(1e6)
    sampled, _, weights = reference.replay.sample(BATCH, 0.4)
    batch = {**sampled, "weights": weights}
    one_step(reference, batch)
    expected, expected_grads = reference.online.state_dict(), grads(reference)
    results = group_step(batch, 1e6, 3, without_batch=(1,))
    assert [rank for rank, *_ in results] == [0, 1, 2]
    for rank, metrics, rank_grads, state in results:
        assert bool(metrics) == (rank != 1)  # rank 1's step has no loss of its own to report
        for name, value in expected_grads.items():
            np.testing.assert_allclose(rank_grads[name], value, rtol=1e-5, atol=1e-7, err_msg=f"rank {rank} {name}")
        for name, value in expected.items():
            np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=f"rank {rank} {name}")


def listening_addresses(port: int) -> set[str]:
    """The addresses TCP sockets of this host listen on at ``port`` (/proc/net/tcp, tcp6)."""
    return listening_sockets().get(port, set())


def _store_main(master: str, out) -> None:
    init_group(Rank(0, 1, master), torch.device("cpu"), lambda: SECRET)
    try:
        out.put(listening_addresses(int(master.rpartition(":")[2])))
    finally:
        leave_group()


@pytest.mark.parametrize("where", ["loopback", "this host's address"])
def test_the_rendezvous_store_listens_on_the_master_address_alone(where):
    """Rank 0 serves the group's store on --master's address, not on every interface (torch's
    tcp:// rendezvous binds ::): 127.0.0.1 for one host, the host's own address across hosts."""
    host = "127.0.0.1" if where == "loopback" else non_loopback_address()
    if host is None:
        pytest.skip("this host has no address but loopback")
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rank = ctx.Process(target=_store_main, args=(f"{host}:{port}", out))
    rank.start()
    try:
        assert out.get(timeout=120) == {host}
    finally:
        rank.join(timeout=30)
    assert rank.exitcode == 0


def test_rank_0_says_in_one_line_when_it_cannot_listen_on_the_master_address():
    import socket

    cpu = torch.device("cpu")
    with pytest.raises(ApexError, match="rank 0 cannot listen on --master no-such-host.invalid:"):
        init_group(Rank(0, 2, f"no-such-host.invalid:{free_port()}"), cpu, lambda: SECRET)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ApexError, match="run rank 0 on the host whose address --master names, on a port no other"):
            init_group(Rank(0, 2, f"127.0.0.1:{taken.getsockname()[1]}"), cpu, lambda: SECRET)


@pytest.mark.parametrize(
    "args, message",
    [
        ((2, 2, "127.0.0.1:5000"), "--rank must be in 0..1"),
        ((0, 0, "127.0.0.1:5000"), "--world-size must be >= 1"),
        ((0, 2, "nohost"), "--master must be HOST:PORT"),
        ((0, 2, "127.0.0.1:99999"), "--master must be HOST:PORT"),
    ],
)
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
