"""env.normalize_reward and impala.normalize_advantages (issue 47): the running statistics
against Gymnasium's, what IMPALA's actors send with each setting, the advantages IMPALA's loss
takes, and the settings' errors and the key that moved."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium.wrappers.utils import RunningMeanStd

import tests.envs  # noqa: F401  (registers apex-test/Reach-v0)
from apex.algos.impala import loss as impala_loss
from apex.algos.impala.actor import ImpalaActor
from apex.algos.reward_normalizer import CLIP, RewardNormalizer, RunningVariance
from apex.config import load_dict
from apex.envs.make import EnvSpec
from apex.errors import ConfigError


def test_the_running_variance_is_gymnasiums_running_mean_std():
    rng = np.random.default_rng(0)
    ours, theirs = RunningVariance(), RunningMeanStd(shape=())
    for size in (1, 7, 64, 3, 200):
        batch = rng.normal(3.0, 5.0, size)
        ours.update(batch)
        theirs.update(batch)
        assert ours.mean == pytest.approx(float(theirs.mean), rel=1e-9)
        assert ours.var == pytest.approx(float(theirs.var), rel=1e-9)
    assert ours.var == pytest.approx(25.0, rel=0.25)  # and it converges on the stream's own


def test_rewards_are_divided_by_the_discounted_returns_running_std_and_clipped():
    """One stream against a direct computation: the return moves on by each reward, its
    running variance (Gymnasium's RunningMeanStd, the prior VecNormalize uses) scales the
    reward, the result is held within +-CLIP, and the caller's zeroed return starts afresh."""
    gamma = 0.9
    rng = np.random.default_rng(1)
    rewards = np.concatenate([rng.normal(-5.0, 2.0, 30), [400.0], rng.normal(-5.0, 2.0, 10)])
    normalizer, reference = RewardNormalizer(gamma), RunningMeanStd(shape=())
    ret = ref_ret = 0.0
    clipped = 0
    for i, reward in enumerate(rewards):
        scaled, returns = normalizer.normalize(np.array([reward]), np.array([ret]))
        ref_ret = gamma * ref_ret + reward
        reference.update(np.array([ref_ret]))
        expected = reward / np.sqrt(reference.var + 1e-8)
        clipped += abs(expected) > CLIP
        assert scaled[0] == pytest.approx(np.clip(expected, -CLIP, CLIP), rel=1e-9)
        assert returns[0] == pytest.approx(ref_ret)
        ret = returns[0]
        if i == 20:  # the episode ended: the caller zeroes its return
            ret = ref_ret = 0.0
    assert clipped == 1  # the 400 only
    assert abs(scaled[0]) < 2.0 < abs(rewards[-1])  # rewards of -5 come out near 1


def test_a_non_finite_reward_does_not_poison_the_statistics():
    normalizer = RewardNormalizer(0.99)
    normalizer.normalize(np.array([1.0, 2.0]), np.zeros(2))
    before = normalizer.returns_var.var
    _, returns = normalizer.normalize(np.array([np.nan, 1.0]), np.zeros(2))
    assert np.isfinite(normalizer.returns_var.var) and normalizer.returns_var.var != before
    assert returns[0] == 0.0 and returns[1] == 1.0


def emitted_rewards(env_id: str, normalize: bool | str, steps: int = 3) -> np.ndarray:
    config = load_dict({"algo": "impala", "seed": 3, "env": {"id": env_id, "normalize_reward": normalize}})
    actor = ImpalaActor(config, {"num_envs": 4}, seed=3)
    rows = []
    while len(rows) < steps:
        batch, _ = actor.act()
        if batch is not None:
            rows.append(batch["reward"])
    actor.close()
    return np.concatenate(rows, axis=1)  # [K, steps * T]


def test_a_continuous_actor_sends_normalized_rewards_by_default_and_raw_ones_when_off():
    """apex-test/Reach-v0's rewards are -distance (and 10 on arrival); the same seed makes
    the same episodes either way (the reward does not steer the actions), so the rewards sent
    with ``auto`` are the raw ones through a RewardNormalizer fed the same stream (40
    steps: within the 50-step limit, whose bootstrap would hide the raw reward)."""
    raw = emitted_rewards("apex-test/Reach-v0", False, steps=2)
    auto = emitted_rewards("apex-test/Reach-v0", "auto", steps=2)
    assert not np.allclose(raw, auto)
    normalizer, returns = RewardNormalizer(0.99), np.zeros(raw.shape[0])
    for t in range(raw.shape[1]):
        scaled, returns = normalizer.normalize(raw[:, t], returns)
        returns = np.where(raw[:, t] == 10.0, 0.0, returns)  # arrived: a new episode
        np.testing.assert_allclose(auto[:, t], scaled, rtol=1e-5, atol=1e-6)
    assert np.abs(auto).max() <= CLIP


def test_a_discrete_actor_sends_raw_rewards_unless_asked():
    assert set(np.unique(emitted_rewards("CartPole-v1", "auto", steps=1))) <= {1.0}
    forced = emitted_rewards("CartPole-v1", True, steps=1)
    assert not np.allclose(forced[forced < 5], 1.0)  # scaled (the bootstrapped steps aside)


def test_impala_normalizes_its_policy_gradient_advantages_when_asked():
    """With normalize_advantages the policy-gradient term is the one of the V-trace
    advantages scaled to mean 0 and std 1 over the batch; the value loss is unchanged."""
    torch.manual_seed(0)
    T, B, D = 5, 3, 2
    spec = EnvSpec((4,), np.dtype(np.float32), 1, D, continuous=True)
    params = torch.randn(T + 1, B, 2 * D, dtype=torch.float64, requires_grad=True)
    values = torch.randn(T + 1, B, dtype=torch.float64)
    actions = torch.randn(T, B, D, dtype=torch.float64)
    behaviour = torch.randn(T, B, dtype=torch.float64) - 3
    rewards = torch.randn(T, B, dtype=torch.float64) * 10 - 20
    discounts = torch.full((T, B), 0.99, dtype=torch.float64)
    args = (params, values, actions, behaviour, rewards, discounts, 1.0, 1.0, 0.5, 0.0, spec)
    plain, normalized = impala_loss.impala_loss(*args), impala_loss.impala_loss(*args, normalize_advantages=True)
    logp, _ = impala_loss.log_prob_and_entropy(params[:-1], actions, spec)
    returns = impala_loss.vtrace(behaviour, logp.detach(), rewards, discounts, values[:-1], values[-1])
    advantages = returns.pg_advantages
    scaled = (advantages - advantages.mean()) / advantages.std(correction=0)
    torch.testing.assert_close(normalized.pg_loss, -(logp * scaled).mean().detach())
    torch.testing.assert_close(plain.pg_loss, -(logp * advantages).mean().detach())
    torch.testing.assert_close(normalized.baseline_loss, plain.baseline_loss)


def test_the_learners_resolve_auto_by_the_action_space():
    continuous = EnvSpec((4,), np.dtype(np.float32), 1, 2, continuous=True)
    discrete = EnvSpec((4,), np.dtype(np.float32), 1, 2)
    assert continuous.resolve_auto("auto") and not discrete.resolve_auto("auto")
    assert discrete.resolve_auto(True) and not continuous.resolve_auto(False)


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"env": {"normalize_reward": "yes"}}, "env.normalize_reward must be true, false or auto, got 'yes'"),
        ({"impala": {"normalize_advantages": "on"}}, "impala.normalize_advantages must be true, false or auto"),
        (
            {"algo": "apex_ddpg", "env": {"id": "Pendulum-v1", "normalize_reward": True}},
            "env.normalize_reward true needs algo impala or appo",
        ),
    ],
)
def test_bad_settings_are_named(raw, message):
    with pytest.raises(ConfigError, match=message):
        load_dict({"algo": "impala", **raw})


def test_appos_older_normalize_advantages_key_reads_as_impalas():
    config = load_dict({"algo": "appo", "appo": {"normalize_advantages": True}})
    assert config.impala.normalize_advantages is True
    assert load_dict({"algo": "appo"}).impala.normalize_advantages == "auto"
