"""IMPALA: V-trace against the paper's formula written as a direct loop, the unroll queue,
and the actor's unrolls across episode boundaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from apex import config as config_module
from apex.algos.impala import actor as impala_actor
from apex.algos.impala import learner as impala
from apex.algos.impala import loss as impala_loss
from apex.envs.make import EnvSpec
from apex.replay import UnrollQueue


def vtrace_by_definition(behaviour_logp, target_logp, rewards, discounts, values, bootstrap, rho_bar, c_bar):
    """Eq. (1) of the paper, summed term by term for every s (slow, no recursion)."""
    T, B = rewards.shape
    rho = np.minimum(rho_bar, np.exp(target_logp - behaviour_logp))
    c = np.minimum(c_bar, np.exp(target_logp - behaviour_logp))
    v_next = np.concatenate([values[1:], bootstrap[None]])
    vs = np.zeros((T, B))
    for b in range(B):
        for s in range(T):
            total = values[s, b]
            for t in range(s, T):
                discount_product = np.prod(discounts[s:t, b])  # gamma_s ... gamma_{t-1}
                trace = np.prod(c[s:t, b])  # c_s ... c_{t-1}
                delta = rho[t, b] * (rewards[t, b] + discounts[t, b] * v_next[t, b] - values[t, b])
                total += discount_product * trace * delta
            vs[s, b] = total
    vs_next = np.concatenate([vs[1:], bootstrap[None]])
    pg = rho * (rewards + discounts * vs_next - values)
    return vs, pg


@settings(max_examples=60)
@given(
    T=st.integers(1, 8),
    B=st.integers(1, 3),
    rho_bar=st.sampled_from([1.0, 0.5, 2.0]),
    c_bar=st.sampled_from([1.0, 0.7, 1.5]),
    seed=st.integers(0, 1000),
)
def test_vtrace_matches_the_definition(T, B, rho_bar, c_bar, seed):
    rng = np.random.default_rng(seed)
    behaviour = np.log(rng.uniform(0.1, 1.0, (T, B)))
    target = np.log(rng.uniform(0.1, 1.0, (T, B)))
    rewards = rng.standard_normal((T, B))
    discounts = 0.9 * (rng.random((T, B)) > 0.2)  # some 0: episodes ending inside the unroll
    values = rng.standard_normal((T, B))
    bootstrap = rng.standard_normal(B)
    out = impala_loss.vtrace(
        *(torch.tensor(x) for x in (behaviour, target, rewards, discounts, values, bootstrap)),
        rho_bar=rho_bar,
        c_bar=c_bar,
    )
    vs, pg = vtrace_by_definition(behaviour, target, rewards, discounts, values, bootstrap, rho_bar, c_bar)
    np.testing.assert_allclose(out.vs.numpy(), vs, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(out.pg_advantages.numpy(), pg, rtol=1e-9, atol=1e-9)


def test_on_policy_vtrace_is_the_bootstrapped_n_step_return():
    rng = np.random.default_rng(0)
    T, B, gamma = 6, 2, 0.9
    logp = torch.tensor(np.log(rng.uniform(0.2, 1, (T, B))))
    rewards = torch.tensor(rng.standard_normal((T, B)))
    discounts = torch.full((T, B), gamma, dtype=torch.float64)
    discounts[3, 1] = 0.0  # env 1 terminates after step 3
    values = torch.tensor(rng.standard_normal((T, B)))
    bootstrap = torch.tensor(rng.standard_normal(B))
    out = impala_loss.vtrace(logp, logp, rewards, discounts, values, bootstrap, rho_bar=1.0, c_bar=1.0)
    for s in range(T):
        for b in range(B):
            ret, weight = 0.0, 1.0
            for t in range(s, T):
                ret += weight * rewards[t, b].item()
                weight *= discounts[t, b].item()
            ret += weight * bootstrap[b].item()
            assert out.vs[s, b].item() == pytest.approx(ret)


def test_vtrace_passes_no_gradient_into_its_targets():
    values = torch.zeros(3, 1, requires_grad=True)
    out = impala_loss.vtrace(
        torch.zeros(3, 1), torch.zeros(3, 1), torch.ones(3, 1), torch.full((3, 1), 0.9), values, torch.zeros(1)
    )
    assert not out.vs.requires_grad and not out.pg_advantages.requires_grad


def test_loss_lowers_on_a_fixed_batch():
    torch.manual_seed(0)
    T, B, A = 5, 4, 3
    logits = torch.zeros(T + 1, B, A, requires_grad=True)
    values = torch.zeros(T + 1, B, requires_grad=True)
    actions = torch.zeros(T, B, dtype=torch.long)  # action 0 always paid
    behaviour = torch.full((T, B), float(np.log(1 / 3)))
    optimizer = torch.optim.SGD([logits, values], lr=0.5)
    first = None
    for _ in range(50):
        out = impala.impala_loss(
            logits,
            values,
            actions,
            behaviour,
            torch.ones(T, B),
            torch.full((T, B), 0.9),
            1.0,
            1.0,
            0.5,
            0.0,
            EnvSpec((4,), np.dtype(np.float32), 1, A),
        )
        first = first if first is not None else out.baseline_loss.item()
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    assert torch.softmax(logits[0, 0], -1)[0] > 0.5  # the paid action became more likely
    assert out.baseline_loss.item() < first


def test_unroll_queue_blocks_or_drops():
    dropping = UnrollQueue(3, block=False)
    dropping.put([1, 2, 3, 4, 5])
    assert dropping.take(10) == [3, 4, 5] and dropping.dropped == 2
    blocking = UnrollQueue(2, block=True)
    assert blocking.wait_for_room(0)
    blocking.put([1, 2])
    assert not blocking.wait_for_room(0.01)
    assert blocking.wait_for(2, 0) and not blocking.wait_for(3, 0.01)
    assert blocking.take(1) == [1] and blocking.wait_for_room(0)


def test_actor_unrolls_overlap_by_the_bootstrap_step_and_restart_stacks_at_resets():
    config = config_module.load(None, ["algo=impala", "impala.unroll_length=7"])
    actor = impala_actor.ImpalaActor(config, {"num_envs": 3}, seed=0)
    frames_seen = []  # what the network saw, step by step, per env
    batches = []
    for _ in range(40):
        frames_seen.append(actor.stacker.obs.copy())
        batch, _ = actor.act()
        if batch is not None:
            batches.append(batch)
    frames_seen.append(actor.stacker.obs.copy())
    assert len(batches) == 5
    spec = actor.spec
    for n, batch in enumerate(batches):
        _, sizes = impala.batch_schema(spec, config).validate(batch, impala.batch_limits(3, spec, config))
        assert sizes["unrolls"] == 3
        obs = batch["frames"][batch["obs_frame"][..., None] + np.arange(spec.stack)]  # [K, T+1, stack, 4]
        for t in range(8):
            np.testing.assert_array_equal(obs[:, t], frames_seen[7 * n + t])
    assert (batches[0]["discount"] <= config.impala.gamma).all()
    actor.close()


def test_the_queue_keeps_each_frame_once_and_a_batch_gets_the_stacks_the_actor_saw():
    """Catch's 40x40 frames, 4 to a stack: the learner queues each unroll's frames once
    (about T + stack of them, not (T + 1) * stack) and builds the stacks of a batch, time-
    major, exactly as the actor's network saw them, across episode resets."""
    T = 12
    config = config_module.load(
        None,
        ["algo=impala", "env.id=tests.envs:apex-test/Catch-v0", f"impala.unroll_length={T}", "impala.batch_unrolls=4"],
    )
    actor = impala_actor.ImpalaActor(config, {"num_envs": 2}, seed=0)
    spec = actor.spec
    assert spec.stack == 4 and spec.frame_shape == (40, 40)
    learner = impala.ImpalaLearner(config, spec, torch.device("cpu"))
    seen = []  # [T+1, K, stack, 40, 40] per unroll batch
    stacks = []
    while len(seen) < 2:  # two batches of 2 unrolls: one learner batch of 4
        stacks.append(actor.stacker.obs.copy())
        batch, _ = actor.act()
        if batch is not None:
            stacks.append(actor.stacker.obs.copy())  # the bootstrap step
            seen.append(np.stack(stacks[-(T + 1) :]))
            stacks = stacks[:-1]  # the next unroll starts at this one's bootstrap step
            arrays, _ = learner.schema.validate(batch, learner.batch_limits(2))
            learner.insert(arrays)
    actor.close()
    # Catch's episodes are short, and each reset repeats its first frame to fill a stack:
    # still well under the stacks a step that the queue held before (4.3 frames here).
    stacked = (T + 1) * spec.stack * 40 * 40 / T
    assert learner.queue.bytes_per_transition(T) < 0.6 * stacked
    unrolls = learner.queue.take(4)
    frames_per_unroll = [len(u["frames"]) for u in unrolls]
    assert all(T + spec.stack <= n <= (T + 1) * spec.stack for n in frames_per_unroll), frames_per_unroll
    built = learner._stacks(unrolls)
    np.testing.assert_array_equal(built, np.concatenate(seen, axis=1))


def test_a_forged_stack_start_past_the_last_whole_stack_never_reaches_the_queue():
    """Each unroll's frames are sliced from where its stacks start to the last one's end: a
    start within stack - 1 of the batch's end (a stack that would run past its frames) is
    refused by the schema, counted by reason, before any slice is taken."""
    from apex.errors import RejectedMessage

    config = config_module.load(None, ["algo=impala", "env.id=tests.envs:apex-test/Catch-v0", "impala.unroll_length=6"])
    actor = impala_actor.ImpalaActor(config, {"num_envs": 2}, seed=0)
    learner = impala.ImpalaLearner(config, actor.spec, torch.device("cpu"))
    batch = None
    while batch is None:
        batch, _ = actor.act()
    actor.close()
    stack, n = actor.spec.stack, len(batch["frames"])
    last_whole = dict(batch, obs_frame=batch["obs_frame"].copy())
    last_whole["obs_frame"][-1, -1] = n - stack  # the last stack ends at the last frame: fine
    arrays, _ = learner.schema.validate(last_whole, learner.batch_limits(2))
    learner.insert(arrays)
    assert learner._stacks(learner.queue.take(2)).shape[2] == stack
    forged = dict(batch, obs_frame=batch["obs_frame"].copy())
    forged["obs_frame"][-1, -1] = n - stack + 1
    with pytest.raises(RejectedMessage) as refused:
        learner.schema.validate(forged, learner.batch_limits(2))
    assert refused.value.reason == "out_of_range" and len(learner.queue) == 0


def test_actor_scales_training_rewards_but_reports_returns_as_they_are():
    config = config_module.load(None, ["algo=impala", "env.reward_scale=0.01", "impala.unroll_length=5"])
    actor = impala_actor.ImpalaActor(config, {"num_envs": 2}, seed=0)
    batch, episodes = None, []
    while batch is None:
        batch, finished = actor.act()
        episodes += finished
    # CartPole gives +1 a step; no episode ends within 5 steps, so no bootstrap is added
    np.testing.assert_allclose(batch["reward"], 0.01, rtol=1e-6)
    for _ in range(200):
        episodes += actor.act()[1]
    assert episodes and all(ret == length for ret, length, _ in episodes)  # +1 a step, unscaled
    actor.close()
