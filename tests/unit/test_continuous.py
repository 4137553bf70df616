"""Continuous (Box) actions for IMPALA: a diagonal Gaussian whose log-probabilities match
torch.distributions on clipped and squashed actions, what the actor sampled is what the
learner scores, what a continuous batch may hold (Pendulum learned end to end:
tests/system/test_continuous.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gymnasium import spaces as gs
from torch.distributions import AffineTransform, Normal, TanhTransform, TransformedDistribution

from apex import config as config_module
from apex.algos.impala import actor as impala_actor
from apex.algos.impala import learner as impala
from apex.config import ModelConfig
from apex.envs import spaces
from apex.envs.make import EnvSpec
from apex.errors import RejectedMessage
from apex.nets import numpy_nets as inference
from apex.nets.torch_nets import (
    LOG_STD_MAX,
    LOG_STD_MIN,
    PolicyValueNetwork,
    gaussian_entropy,
    gaussian_log_prob,
    numpy_weights,
    squashed_log_prob,
)

LOW = torch.tensor([-2.0, 0.0, -1.0])
HIGH = torch.tensor([2.0, 1.0, 3.0])


def gaussian(shape=(64,), seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    """Policy parameters [..., 6] (mean, log-std of 3 values) and samples u beyond the bounds too."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(*shape, 3, generator=g)
    log_std = torch.rand(*shape, 3, generator=g) * 2 - 1.5
    u = mean + log_std.exp() * torch.randn(*shape, 3, generator=g) * 2
    return torch.cat([mean, log_std], -1), u


def test_gaussian_log_probs_and_entropy_match_torch_distributions():
    params, u = gaussian()
    normal = Normal(params[..., :3], params[..., 3:].exp())
    torch.testing.assert_close(gaussian_log_prob(params, u), normal.log_prob(u).sum(-1))
    torch.testing.assert_close(gaussian_entropy(params), normal.entropy().sum(-1))


def test_a_clipped_action_is_scored_by_the_sample_the_environment_got_clipped():
    """``clip``: the environment gets clip(u); the batch carries u and log N(u), which is
    what torch's Normal gives for u (inside the bounds, also the density of the action)."""
    params, u = gaussian()
    convert = spaces.action_plan(gs.Box(LOW.numpy(), HIGH.numpy()), "x", "clip").convert
    clipped = np.stack([convert(row) for row in u.numpy()])
    inside = ((u >= LOW) & (u <= HIGH)).all(-1)
    assert inside.any() and not inside.all()
    normal = Normal(params[..., :3], params[..., 3:].exp())
    torch.testing.assert_close(gaussian_log_prob(params, u), normal.log_prob(u).sum(-1))
    torch.testing.assert_close(
        gaussian_log_prob(params, u)[inside], normal.log_prob(torch.from_numpy(clipped)).sum(-1)[inside]
    )


def test_a_squashed_actions_log_density_matches_torch_and_leaves_the_ratio_alone():
    """``squash``: a = low + (tanh(u) + 1) (high - low) / 2. Its log-density matches torch's
    TransformedDistribution (tanh, then affine) on the action the adapter made; it differs
    from log N(u) by a term that does not depend on the policy, so pi / mu (what V-trace
    takes) is the same from either."""
    params, u = gaussian()
    target, _ = gaussian(seed=1)
    u = u.clamp(-4, 4)  # where float32 tanh is still invertible, for torch's reference
    convert = spaces.action_plan(gs.Box(LOW.numpy(), HIGH.numpy()), "x", "squash").convert
    action = torch.from_numpy(np.stack([convert(row) for row in u.numpy()]).astype(np.float64))
    mid, half = (HIGH + LOW) / 2, (HIGH - LOW) / 2
    reference = TransformedDistribution(
        Normal(params[..., :3].double(), params[..., 3:].exp().double()),
        [TanhTransform(), AffineTransform(mid.double(), half.double())],
    )
    torch.testing.assert_close(
        squashed_log_prob(params.double(), u.double(), LOW.double(), HIGH.double()),
        reference.log_prob(action).sum(-1),
        rtol=1e-5,
        atol=1e-4,
    )
    ratio_squashed = squashed_log_prob(target, u, LOW, HIGH) - squashed_log_prob(params, u, LOW, HIGH)
    ratio_gaussian = gaussian_log_prob(target, u) - gaussian_log_prob(params, u)
    torch.testing.assert_close(ratio_squashed, ratio_gaussian, rtol=1e-5, atol=1e-4)
    assert torch.isfinite(squashed_log_prob(params, u * 100, LOW, HIGH)).all()  # far out in tanh's tails too


def test_the_log_std_is_learned_clamped_and_the_same_in_the_actors_numpy_network():
    spec = EnvSpec((3,), np.dtype(np.float32), 1, 2, continuous=True)
    config = ModelConfig(hidden=[16])
    net = PolicyValueNetwork(spec, config)
    with torch.no_grad():
        net.log_std.copy_(torch.tensor([-9.0, 0.3]))
    obs = np.random.default_rng(0).normal(size=(5, 1, 3)).astype(np.float32)
    with torch.no_grad():
        params, values, _ = net(torch.from_numpy(obs))
    assert params.shape == (5, 4) and params[:, 2:].tolist() == [[LOG_STD_MIN, pytest.approx(0.3)]] * 5
    actor_net = inference.policy_value_network(spec, config)
    actor_net.load(numpy_weights(net))
    got, got_values, _ = actor_net(obs)
    np.testing.assert_allclose(got, params.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_values, values.numpy(), rtol=1e-5, atol=1e-6)
    assert net.greedy(params).tolist() == params[:, :2].tolist()  # the mean
    assert LOG_STD_MAX == 2.0 and "log_std" in dict(net.named_parameters())


def pendulum_config(*more: str):
    return config_module.load(None, ["algo=impala", "env.id=Pendulum-v1", "impala.unroll_length=6", *more])


@pytest.mark.parametrize("bounds", ["clip", "squash"])
def test_the_learner_scores_the_samples_the_actor_drew(bounds):
    K = 4
    config = pendulum_config(f"env.action_bounds={bounds}", f"impala.batch_unrolls={K}")
    actor = impala_actor.ImpalaActor(config, {"num_envs": K}, seed=0)
    spec = actor.spec
    learner = impala.ImpalaLearner(config, spec, torch.device("cpu"))
    with torch.no_grad():
        learner.net.log_std.fill_(-0.5)
    actor.net.load(numpy_weights(learner.net))
    batch = None
    while batch is None:
        batch, _ = actor.act()
    actor.close()
    assert batch["action"].dtype == np.float32 and batch["action"].shape == (K, 6, 1)
    arrays, _ = learner.schema.validate(batch, learner.batch_limits(K))
    learner.insert(arrays)
    tensors = learner.sample().tensors
    with torch.no_grad():
        params, _ = learner.net.unroll(tensors["obs"], None, None)
    torch.testing.assert_close(
        gaussian_log_prob(params[:-1], tensors["action"]), tensors["behaviour_logp"], rtol=1e-4, atol=1e-4
    )
    u = tensors["action"].numpy()
    assert np.abs(u).max() > 0 and np.std(u) > 0.2  # sampled, not the mean


def continuous_batch(config, K: int = 2) -> tuple[dict, EnvSpec]:
    actor = impala_actor.ImpalaActor(config, {"num_envs": K}, seed=0)
    batch = None
    while batch is None:
        batch, _ = actor.act()
    actor.close()
    return batch, actor.spec


@pytest.mark.parametrize(
    "name, value",
    [
        ("action", np.nan),
        ("action", np.inf),
        ("action", 1e7),  # beyond MAX_ABS_CONTINUOUS_ACTION: its log-density could overflow float32
        ("behaviour_logp", 50.0),  # a density no clamped log-std reaches
    ],
)
def test_a_forged_continuous_action_or_density_is_refused(name, value):
    config = pendulum_config()
    batch, spec = continuous_batch(config)
    batch[name] = batch[name].copy()
    batch[name].flat[0] = value
    with pytest.raises(RejectedMessage, match=name):
        impala.batch_schema(spec, config).validate(batch, impala.batch_limits(2, spec, config))


def test_integer_actions_for_a_continuous_run_are_refused():
    config = pendulum_config()
    batch, spec = continuous_batch(config)
    batch["action"] = batch["action"].astype(np.int64)
    with pytest.raises(RejectedMessage, match="action"):
        impala.batch_schema(spec, config).validate(batch, impala.batch_limits(2, spec, config))
