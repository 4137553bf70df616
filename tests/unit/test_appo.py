"""APPO: its loss against a slow per-step reference (torch.distributions for the densities
and KL, V-trace and GAE as the sums their papers write), the target network's schedule, the
adaptive KL weight, checkpoints, the config's checks, and the circular buffer of unrolls."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributions import Categorical, Independent, Normal, kl_divergence

from apex.algos.appo.learner import AppoLearner
from apex.algos.appo.loss import SurrogateSettings, appo_loss
from apex.algos.impala.actor import ImpalaActor
from apex.config import ConfigError, load_dict
from apex.envs.make import env_spec
from apex.replay import UnrollRing

T, B, A, D = 5, 3, 4, 2


def distribution(params: torch.Tensor, continuous: bool):
    if continuous:
        mean, log_std = params.chunk(2, dim=-1)
        return Independent(Normal(mean, log_std.exp()), 1)
    return Categorical(logits=params)


def reference_loss(params, values, old_params, old_values, actions, mu_logp, rewards, discounts, s, continuous):
    """The loss step by step, as the module docstring writes it (no recursion, no batching)."""
    V = values.detach()
    logp = torch.zeros(T, B, dtype=torch.float64)
    old_logp = torch.zeros(T, B, dtype=torch.float64)
    entropy = torch.zeros(T, B, dtype=torch.float64)
    kl = torch.zeros(T, B, dtype=torch.float64)
    for t in range(T):
        for b in range(B):
            pi, old = distribution(params[t, b], continuous), distribution(old_params[t, b].detach(), continuous)
            logp[t, b] = pi.log_prob(actions[t, b])
            old_logp[t, b] = old.log_prob(actions[t, b])
            entropy[t, b] = pi.entropy()
            kl[t, b] = kl_divergence(old, pi)
    advantages = torch.zeros(T, B, dtype=torch.float64)
    targets = torch.zeros(T, B, dtype=torch.float64)
    for b in range(B):
        if s.advantages == "vtrace":
            rho = [min(s.rho_bar, math.exp(old_logp[t, b] - mu_logp[t, b])) for t in range(T)]
            c = [min(s.c_bar, math.exp(old_logp[t, b] - mu_logp[t, b])) for t in range(T)]
            vs = []
            for start in range(T + 1):
                total = float(V[start, b])
                for t in range(start, T):
                    weight = math.prod(float(discounts[i, b]) * c[i] for i in range(start, t))
                    total += weight * rho[t] * float(rewards[t, b] + discounts[t, b] * V[t + 1, b] - V[t, b])
                vs.append(total)
            for t in range(T):
                targets[t, b] = vs[t]
                advantages[t, b] = rho[t] * (rewards[t, b] + discounts[t, b] * vs[t + 1] - V[t, b])
        else:
            for start in range(T):
                total = 0.0
                for t in range(start, T):
                    weight = math.prod(float(discounts[i, b]) * s.gae_lambda for i in range(start, t))
                    total += weight * float(rewards[t, b] + discounts[t, b] * V[t + 1, b] - V[t, b])
                advantages[start, b] = total
                targets[start, b] = total + V[start, b]
    if s.normalize_advantages:
        advantages = (advantages - advantages.mean()) / (advantages.std(correction=0) + 1e-8)
    pg = torch.zeros((), dtype=torch.float64)
    value = torch.zeros((), dtype=torch.float64)
    for t in range(T):
        for b in range(B):
            w = torch.exp(logp[t, b] - mu_logp[t, b]) * min(math.exp(mu_logp[t, b] - old_logp[t, b]), 2.0)
            a = advantages[t, b]
            pg = pg - torch.minimum(w * a, w.clamp(1 - s.clip, 1 + s.clip) * a) / (T * B)
            error = (targets[t, b] - values[t, b]) ** 2
            if s.value_clip is not None:
                held = old_values[t, b] + (values[t, b] - old_values[t, b]).clamp(-s.value_clip, s.value_clip)
                error = torch.maximum(error, (targets[t, b] - held) ** 2)
            value = value + 0.5 * error / (T * B)
    return pg + s.baseline_cost * value - s.entropy_cost * entropy.mean() + s.kl_coeff * kl.mean()


def surrogate(**changes) -> SurrogateSettings:
    base = {
        "clip": 0.2,
        "kl_coeff": 0.0,
        "value_clip": None,
        "advantages": "vtrace",
        "normalize_advantages": False,
        "gae_lambda": 0.9,
        "rho_bar": 1.0,
        "c_bar": 0.9,
        "baseline_cost": 0.5,
        "entropy_cost": 0.01,
    }
    return SurrogateSettings(**{**base, **changes})


@pytest.mark.parametrize("continuous", [False, True])
@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"advantages": "gae"},
        {"normalize_advantages": True},
        {"kl_coeff": 0.7},
        {"value_clip": 0.05},
        {"advantages": "gae", "value_clip": 0.05, "kl_coeff": 0.3, "normalize_advantages": True},
    ],
    ids=["vtrace", "gae", "normalized", "kl", "value-clip", "everything"],
)
def test_the_appo_loss_and_its_gradients_match_the_per_step_reference(continuous, changes):
    torch.manual_seed(0)
    config = load_dict({"algo": "appo", "env": {"id": "Pendulum-v1" if continuous else "CartPole-v1"}})
    spec = env_spec(config.env, "appo")
    P = 2 * D if continuous else A
    spec = dataclasses.replace(spec, num_actions=D if continuous else A)
    params = torch.randn(T + 1, B, P, dtype=torch.float64, requires_grad=True)
    values = torch.randn(T + 1, B, dtype=torch.float64, requires_grad=True)
    # pi_old near pi (some ratios inside the clip, some beyond), mu further off (some beyond 2)
    old_params = (params + 0.3 * torch.randn_like(params)).detach()
    old_values = (values + 0.1 * torch.randn_like(values)).detach()
    if continuous:
        actions = torch.randn(T, B, D, dtype=torch.float64)
    else:
        actions = torch.randint(0, A, (T, B))
    with torch.no_grad():
        mu_logp = distribution(old_params[:-1] + 0.8 * torch.randn_like(old_params[:-1]), continuous).log_prob(actions)
    rewards = torch.randn(T, B, dtype=torch.float64)
    discounts = torch.full((T, B), 0.95, dtype=torch.float64)
    discounts[2, 1] = 0.0  # an episode ends inside the unroll
    s = surrogate(**changes)

    out = appo_loss(params, values, old_params, old_values, actions, mu_logp, rewards, discounts, s, spec)
    expected = reference_loss(
        params, values, old_params, old_values, actions, mu_logp, rewards, discounts, s, continuous
    )
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-9)
    got = torch.autograd.grad(out.loss, (params, values))
    want = torch.autograd.grad(expected, (params, values))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-9)
    assert 0 < out.clip_fraction.item() < 1  # the fixture reaches both sides of the clip
    assert out.kl.item() > 0


def cartpole_learner(**appo) -> tuple[AppoLearner, ImpalaActor]:
    config = load_dict(
        {"algo": "appo", "appo": appo, "impala": {"batch_unrolls": 8, "unroll_length": 10}, "actor": {"num_envs": 8}}
    )
    learner = AppoLearner(config, env_spec(config.env, "appo"), torch.device("cpu"))
    return learner, ImpalaActor(config, {"num_envs": 8, "seed": 0}, seed=0)


def feed(learner: AppoLearner, actor: ImpalaActor, *others: AppoLearner) -> None:
    """One batch from the actor into the learner (and the same batch into the others)."""
    batch = None
    while batch is None:
        batch, _ = actor.act()
    for each in (learner, *others):
        arrays, _ = each.schema.validate(batch, each.batch_limits(8))
        each.insert(arrays)


def same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_the_target_network_is_the_network_as_of_every_target_update_every_updates():
    learner, actor = cartpole_learner(target_update_every=3, epochs=2, minibatches=2)  # 4 updates a batch
    initial = {k: v.clone() for k, v in learner.target.state_dict().items()}
    snapshots = []
    original = learner._stepped

    def recording() -> None:
        original()
        snapshots.append(({k: v.clone() for k, v in learner.net.state_dict().items()}, learner.steps))

    learner._stepped = recording
    for _ in range(2):
        feed(learner, actor)
        assert learner.step()  # 4 updates each
    actor.close()
    assert learner.updates == 8 and [steps for _, steps in snapshots] == list(range(1, 9))
    as_of_6 = snapshots[5][0]
    assert all(torch.equal(learner.target.state_dict()[k], as_of_6[k]) for k in as_of_6)
    assert not same(learner.target, learner.net)  # steps 7 and 8 moved the network since
    assert not all(torch.equal(initial[k], as_of_6[k]) for k in initial)


def test_skipping_the_target_pass_while_it_holds_the_network_changes_no_update():
    """The target's forward pass is skipped while it holds the network's weights; a learner
    that always runs it must end with the same weights, bit for bit."""
    skipping, actor = cartpole_learner(target_update_every=2, epochs=2, minibatches=2)
    always, other = cartpole_learner(target_update_every=2, epochs=2, minibatches=2)
    other.close()
    passes = {"always": 0}
    run_target = always.target.unroll

    def counted(*args):
        passes["always"] += 1
        return run_target(*args)

    always.target.unroll = counted
    original = always._stepped

    def never_skip() -> None:
        original()
        always._target_is_net = False

    always._target_is_net = False
    always._stepped = never_skip
    for _ in range(2):
        feed(skipping, actor, always)
        assert skipping.step() and always.step()
    actor.close()
    assert passes["always"] == 8
    assert same(skipping.net, always.net) and same(skipping.target, always.target)


def test_the_kl_weight_adapts_towards_its_target_or_stays_fixed():
    learner, actor = cartpole_learner(kl_coeff=0.2, kl_target=0.01)
    actor.close()
    learner._adapt_kl(0.1)  # far above 1.5 x the target
    assert learner.kl_coeff == pytest.approx(0.4)
    learner._adapt_kl(0.001)  # far below
    learner._adapt_kl(0.001)
    assert learner.kl_coeff == pytest.approx(0.1)
    learner._adapt_kl(0.011)  # near the target: unchanged
    assert learner.kl_coeff == pytest.approx(0.1)
    fixed, actor = cartpole_learner(kl_coeff=0.2, kl_target=None)
    actor.close()
    fixed._adapt_kl(10.0)
    assert fixed.kl_coeff == 0.2


def test_a_checkpoint_restores_the_target_network_and_the_kl_weight():
    learner, actor = cartpole_learner(kl_coeff=0.2, target_update_every=1000)
    feed(learner, actor)
    learner.step()
    actor.close()
    learner.kl_coeff = 0.8
    state = learner.state_dict()
    fresh, other = cartpole_learner(kl_coeff=0.2, target_update_every=1000)
    other.close()
    fresh.load_state_dict(state)
    assert same(fresh.target, learner.target) and same(fresh.net, learner.net) and fresh.kl_coeff == 0.8
    with pytest.raises(ValueError, match="kl_coeff"):
        fresh.check_state({**state, "kl_coeff": float("nan")})


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"appo": {"minibatches": 64}}, "appo.minibatches must be in 1..impala.batch_unrolls (32)"),
        ({"appo": {"advantages": "td"}}, "appo.advantages must be vtrace or gae"),
        ({"appo": {"clip": 1.5}}, "appo.clip must be in (0, 1)"),
        ({"appo": {"replay_ratio": 0}}, "appo.replay_ratio must be in 1..100"),
    ],
)
def test_appo_settings_out_of_range_are_named(setting, message):
    with pytest.raises(ConfigError) as error:
        load_dict({"algo": "appo", **setting})
    assert message in str(error.value)


# -- the circular buffer


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 12),
    max_uses=st.integers(1, 4),
    block=st.booleans(),
    script=st.lists(st.tuples(st.sampled_from(["put", "take"]), st.integers(1, 6)), max_size=40),
)
def test_the_ring_never_gives_an_unroll_more_than_max_uses_times_and_new_ones_first(capacity, max_uses, block, script):
    ring = UnrollRing(capacity, block=block, max_uses=max_uses, seed=1)
    uses: dict[int, int] = {}
    next_id = 0
    for op, n in script:
        if op == "put":
            if block and not ring.wait_for_room(0):
                continue
            ring.put([{"id": np.array(next_id + k)} for k in range(n)])
            next_id += n
        else:
            fresh_before = [i for i in range(next_id) if i not in uses]
            taken = [int(u["id"]) for u in ring.take(n)]
            assert len(set(taken)) == len(taken)  # no unroll twice in one batch
            new = [i for i in taken if i not in uses]
            # the new ones come first, oldest first, before any used one
            assert taken[: len(new)] == new and new == sorted(new)
            assert all(i in fresh_before for i in new)
            for i in taken:
                uses[i] = uses.get(i, 0) + 1
        assert len(ring) <= capacity or not ring._used  # only untrained unrolls overshoot
    assert all(count <= max_uses for count in uses.values())
    if block:
        assert ring.dropped == 0  # an unroll never trained on is only dropped where allowed


def test_the_ring_reuses_unrolls_when_new_ones_are_short_and_waits_for_one_new_at_least():
    ring = UnrollRing(8, block=True, max_uses=2, seed=0)
    ring.put([{"id": np.array(i)} for i in range(4)])
    assert [int(u["id"]) for u in ring.take(4)] == [0, 1, 2, 3]
    assert not ring.wait_for(4, 0)  # four in the buffer, none new
    ring.put([{"id": np.array(4)}])
    assert ring.wait_for(4, 0)
    again = [int(u["id"]) for u in ring.take(4)]
    assert again[0] == 4 and set(again[1:]) <= {0, 1, 2, 3} and ring.reused == 3
    assert len(ring) == 2  # the 3 reused have been used twice: gone; 4 and one of 0-3 stay
