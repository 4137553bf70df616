"""Ape-X DDPG's pieces: TD3's target (smoothing, twin critics) against its definition, the
delayed policy and target updates, the policy loss that leaves the critics alone, the noise
ladder and its noises, the actors' NumPy networks against the learner's, their batches, the
schema's refusals, checkpoints and the config's one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apex.algos.apex_ddpg.actor import ApexDdpgActor, float32_bounds
from apex.algos.apex_ddpg.exploration import ExplorationNoise, actor_noise_scales
from apex.algos.apex_ddpg.learner import ApexDdpgLearner
from apex.algos.apex_ddpg.loss import TargetSettings, bootstrap_targets, policy_loss
from apex.config import ApexDdpgConfig, load_dict
from apex.envs.make import EnvSpec, env_spec
from apex.errors import ConfigError, RejectedMessage
from apex.nets.deterministic import DeterministicActorCritic
from apex.nets.numpy_deterministic import NumpyDeterministic

SPEC = EnvSpec((3,), np.dtype(np.float32), 1, 2, continuous=True, action_low=(-2.0, 0.0), action_high=(2.0, 1.0))


def pendulum(**settings) -> tuple[ApexDdpgLearner, ApexDdpgActor]:
    config = load_dict(
        {
            "algo": "apex_ddpg",
            "env": {"id": "Pendulum-v1"},
            "actor": {"num_envs": 4},
            "model": {"hidden": [32, 32]},
            "apex_ddpg": {"chunk_transitions": 16, "batch_size": 32, **settings},
        }
    )
    learner = ApexDdpgLearner(config, env_spec(config.env, "apex_ddpg"), torch.device("cpu"))
    setup = learner.actor_setup(0, 4)
    return learner, ApexDdpgActor(config, setup, seed=0)


def fill(learner: ApexDdpgLearner, actor: ApexDdpgActor, transitions: int) -> dict:
    """Batches from the actor into the learner until it holds ``transitions``; the last batch."""
    batch = None
    while len(learner.replay) < transitions:
        batch, _ = actor.act()
        if batch is not None:
            arrays, _ = learner.schema.validate(batch, learner.batch_limits(actor.num_envs))
            learner.insert(arrays)
    return batch


def test_the_numpy_networks_compute_what_the_torch_ones_do():
    torch.manual_seed(0)
    config = load_dict({"algo": "apex_ddpg", "model": {"hidden": [16, 8]}}).model
    net = DeterministicActorCritic(SPEC, config, critics=1)
    numpy_net = NumpyDeterministic(SPEC, config)
    numpy_net.load({k: v.numpy() for k, v in net.state_dict().items()})
    obs = np.random.default_rng(0).normal(size=(5, 3)).astype(np.float32)
    actions = np.random.default_rng(1).uniform([-2, 0], [2, 1], (5, 2)).astype(np.float32)
    with torch.no_grad():
        mu = net(torch.from_numpy(obs)).numpy()
        q = net.critics[0](torch.from_numpy(obs), torch.from_numpy(actions)).numpy()
    np.testing.assert_allclose(numpy_net.policy(obs), mu, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(numpy_net.q(obs, actions), q, rtol=1e-5, atol=1e-5)
    assert (mu >= [-2, 0]).all() and (mu <= [2, 1]).all()


def test_the_target_is_the_smaller_twin_at_a_smoothed_clipped_action():
    torch.manual_seed(0)
    config = load_dict({"algo": "apex_ddpg", "model": {"hidden": [8]}}).model
    target = DeterministicActorCritic(SPEC, config, critics=2)
    obs = torch.randn(64, 3)
    reward, discount = torch.randn(64), torch.full((64,), 0.9)
    plain = bootstrap_targets(target, reward, discount, obs, TargetSettings(True, 0.0, 0.5))
    with torch.no_grad():
        mu = target(obs)
        q = target.q_values(obs, mu)
        single = bootstrap_targets(target, reward, discount, obs, TargetSettings(False, 0.0, 0.5))
    torch.testing.assert_close(plain, reward + discount * q.min(dim=0).values)
    torch.testing.assert_close(single, reward + discount * q[0])
    # Smoothing: noise of std 10 half ranges, clipped to 0.3 of it, then into the bounds.
    seen = []
    original = target.q_values

    def recording(o, a):
        seen.append(a.clone())
        return original(o, a)

    target.q_values = recording
    generator = torch.Generator().manual_seed(0)
    bootstrap_targets(target, reward, discount, obs, TargetSettings(True, 10.0, 0.3), generator)
    shift = seen[0] - mu
    half = torch.tensor([2.0, 0.5])
    assert (shift.abs() <= 0.3 * half + 1e-6).all() and (shift.abs() > 0).any()
    assert (seen[0] >= torch.tensor([-2.0, 0.0])).all() and (seen[0] <= torch.tensor([2.0, 1.0])).all()


def test_the_policy_loss_moves_the_policy_only():
    torch.manual_seed(0)
    config = load_dict({"algo": "apex_ddpg", "model": {"hidden": [8]}}).model
    net = DeterministicActorCritic(SPEC, config, critics=2)
    policy_loss(net, torch.randn(16, 3)).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.policy.parameters())
    assert all(p.grad is None for p in net.critics.parameters())
    assert all(p.requires_grad for p in net.critics.parameters())  # held only for the loss


def test_the_policy_and_the_targets_move_every_policy_delay_updates():
    learner, actor = pendulum(policy_delay=3, tau=0.25)
    fill(learner, actor, 2_000)
    actor.close()

    def params(module):
        return [p.detach().clone() for p in module.parameters()]

    for step in range(1, 7):
        policy, critics, target = params(learner.online.policy), params(learner.online.critics), params(learner.target)
        metrics = learner.step()
        moved_policy = any(not torch.equal(a, b) for a, b in zip(policy, learner.online.policy.parameters()))
        assert any(not torch.equal(a, b) for a, b in zip(critics, learner.online.critics.parameters()))
        assert moved_policy == (step % 3 == 0) == ("policy_loss" in metrics)
        if step % 3 == 0:  # target <- tau online + (1 - tau) target, after the update
            for before, online, after in zip(target, learner.online.parameters(), learner.target.parameters()):
                torch.testing.assert_close(after, 0.75 * before + 0.25 * online.detach())
        else:
            assert all(torch.equal(a, b) for a, b in zip(target, learner.target.parameters()))
    assert learner.policy_updates == 2 and learner.updates == 6


def test_the_noise_ladder_spreads_over_actors_and_leaves_evaluation_noiseless():
    config = ApexDdpgConfig(noise_base=0.5, noise_alpha=3.0, eval_envs=2)
    scales = [actor_noise_scales(i, 8, config) for i in range(4)]
    exploring = sorted(s for rung, _ in scales for s in rung[:6])
    assert len(set(exploring)) == 24  # distinct over the actors
    assert exploring[-1] == pytest.approx(0.5) and exploring[0] >= 0.5**4
    assert all(rung[6:] == [0.0, 0.0] and mask == [False] * 6 + [True] * 2 for rung, mask in scales)


def test_gaussian_noise_has_each_rows_scale_and_ou_noise_carries_until_reset():
    half = np.array([2.0, 0.5], np.float32)
    gaussian = ExplorationNoise("gaussian", 0.15, half, np.random.default_rng(0))
    samples = np.stack([gaussian.sample(np.array([0.1, 0.0, 1.0])) for _ in range(4000)])
    np.testing.assert_allclose(samples[:, 0].std(axis=0), 0.1 * half, rtol=0.05)
    assert (samples[:, 1] == 0).all()
    ou = ExplorationNoise("ou", 0.15, half, np.random.default_rng(0))
    ou.resize(2)
    steps = np.stack([ou.sample(np.array([0.2, 0.2])) for _ in range(500)])
    lag1 = np.corrcoef(steps[1:, 0, 0], steps[:-1, 0, 0])[0, 1]
    assert lag1 == pytest.approx(0.85, abs=0.05)  # x_t = 0.85 x_{t-1} + white
    ou.reset(0)
    assert (ou.state[0] == 0).all() and (ou.state[1] != 0).all()


def test_an_actors_batches_hold_bounded_float_actions_and_finite_priorities():
    learner, actor = pendulum()
    batch = fill(learner, actor, 1)
    actor.close()
    low, high = float32_bounds(actor.spec)
    assert batch["action"].dtype == np.float32 and batch["action"].shape[1:] == (1,)
    assert (batch["action"] >= low).all() and (batch["action"] <= high).all()
    assert np.isfinite(batch["priority"]).all() and (batch["priority"] >= 0).all()


def test_float32_bounds_stay_inside_bounds_that_float32_rounds_outward():
    spec = EnvSpec((1,), np.dtype(np.float32), 1, 1, continuous=True, action_low=(-0.1,), action_high=(0.1,))
    low, high = float32_bounds(spec)
    assert float(low[0]) >= -0.1 and float(high[0]) <= 0.1


@pytest.mark.parametrize(
    "change, reason, words",
    [
        (lambda b: b.update(action=b["action"] + 5.0), "out_of_range", "action"),
        (lambda b: b.update(action=b["action"] * np.nan), "nonfinite", "action"),
        (lambda b: b.update(action=b["action"].astype(np.int64)), "dtype", "action"),
        (lambda b: b.update(action=b["action"][:, 0]), "shape", "action"),
        (lambda b: b.update(priority=b["priority"] * np.inf), "nonfinite", "priority"),
        (lambda b: b.update(reward=b["reward"] * 0 + 1e12), "out_of_range", "reward"),
    ],
)
def test_hostile_batches_are_refused_with_a_reason(change, reason, words):
    learner, actor = pendulum()
    batch = fill(learner, actor, 1)
    actor.close()
    batch = {k: np.array(v) for k, v in batch.items()}
    change(batch)
    with pytest.raises(RejectedMessage, match=words) as caught:
        learner.schema.validate(batch, learner.batch_limits(4))
    assert caught.value.reason == reason


def test_a_checkpoint_restores_networks_counters_and_the_policy_for_eval():
    learner, actor = pendulum(policy_delay=1)
    fill(learner, actor, 500)
    actor.close()
    learner.step()
    state = learner.state_dict()
    fresh, other = pendulum(policy_delay=1)
    other.close()
    fresh.check_state(state)
    fresh.load_state_dict(state)
    assert fresh.policy_updates == 1 and fresh.updates == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.online.parameters(), learner.online.parameters()))
    assert state["policy"].keys() == learner.online.policy.state_dict().keys()
    with pytest.raises(ValueError, match="policy_updates"):
        fresh.check_state({**state, "policy_updates": -1})


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"env": {"id": "CartPole-v1"}}, "algo apex_ddpg needs continuous (Box) actions"),
        ({"env": {"id": "Pendulum-v1", "action_bounds": "squash"}}, "use env.action_bounds: clip"),
        ({"env": {"id": "Pendulum-v1"}, "apex_ddpg": {"noise": "pink"}}, "apex_ddpg.noise must be gaussian or ou"),
        ({"env": {"id": "Pendulum-v1"}, "apex_ddpg": {"policy_delay": 0}}, "apex_ddpg.policy_delay must be in"),
    ],
)
def test_what_apex_ddpg_cannot_run_is_refused_in_one_line(settings, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        config = load_dict({"algo": "apex_ddpg", **settings})
        env_spec(config.env, "apex_ddpg")


def test_pixels_train_through_conv_torsos_and_the_actors_torch_network_takes_the_weights():
    """Image observations: frames stored once and stacked by the replay, a conv torso for the
    policy and each critic; an actor's network (torch, one critic) loads what the learner
    publishes and acts inside the bounds."""
    from apex.nets.numpy_deterministic import TorchDeterministic, deterministic_network

    spec = EnvSpec((20, 20), np.dtype(np.uint8), 2, 2, continuous=True, action_low=(-1.0, -1.0), action_high=(1.0, 1.0))
    config = load_dict({"algo": "apex_ddpg", "apex_ddpg": {"batch_size": 16, "replay": {"min_size": 10}}})
    learner = ApexDdpgLearner(config, spec, torch.device("cpu"))
    rng = np.random.default_rng(0)
    n = 40
    chunk = {
        "frames": rng.integers(0, 256, (n + 2, 20, 20), dtype=np.uint8),
        "obs_frame": np.arange(n, dtype=np.int32),
        "next_obs_frame": np.arange(1, n + 1, dtype=np.int32),
        "action": rng.uniform(-1, 1, (n, 2)).astype(np.float32),
        "reward": rng.normal(size=n).astype(np.float32),
        "discount": np.full(n, 0.99, np.float32),
        "priority": np.ones(n, np.float32),
    }
    arrays, _ = learner.schema.validate(chunk, learner.batch_limits(4))
    learner.insert(arrays)
    before = [p.detach().clone() for p in learner.online.critics.parameters()]
    assert "loss" in learner.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.online.critics.parameters()))
    actor_net = deterministic_network(spec, config.model)
    assert isinstance(actor_net, TorchDeterministic)
    actor_net.load(learner.weights())
    obs = chunk["frames"][None, :2]
    action = actor_net.policy(obs)
    assert action.shape == (1, 2) and (np.abs(action) <= 1).all()
    with torch.no_grad():
        expected = learner.online(torch.from_numpy(obs)).numpy()
    np.testing.assert_allclose(action, expected, rtol=1e-5, atol=1e-6)
    assert actor_net.q(obs, action).shape == (1,)
