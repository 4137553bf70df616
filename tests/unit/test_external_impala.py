"""IMPALA's episode actor for recurrent and continuous policies (``apex.algos.impala.episode_actor``),
through ``apex.serve.episodes`` without sockets: the unrolls carry what the learner's pass over
them needs to give back the actor's own probabilities, and a client's continuous action is
kept with the policy's density of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apex import config as config_module
from apex.algos.impala import learner as impala
from apex.algos.impala.episode_actor import ImpalaEpisodeActor
from apex.algos.reward_normalizer import RewardNormalizer
from apex.envs.make import env_spaces
from apex.nets.torch_nets import PolicyValueNetwork, log_prob_and_entropy, numpy_weights
from apex.serve.episodes import ExternalEpisodes, RequestError
from apex.wire.protocol import Message

K, T = 4, 4


def served(*overrides: str, max_episodes: int = 8) -> tuple[ExternalEpisodes, PolicyValueNetwork]:
    """IMPALA episodes with random weights, and the torch network that holds the same."""
    config = config_module.load(None, ["algo=impala", "impala.gamma=0.9", f"impala.unroll_length={T}", *overrides])
    spec, low, high = env_spaces(config.env, "impala")
    actor = ImpalaEpisodeActor(config, {"num_envs": K}, spec, 0)
    torch.manual_seed(0)
    net = PolicyValueNetwork(spec, config.model)
    with torch.no_grad():  # away from the initial zeros, so that every weight matters
        for p in net.parameters():
            p.add_(0.3 * torch.randn_like(p))
    actor.set_weights(Message("weights", {"version": 1}, numpy_weights(net)))
    episodes = ExternalEpisodes(config, spec, low, high, actor, max_episodes=max_episodes, episode_timeout_s=10.0)
    return episodes, net


def cartpole_obs(t: int) -> list[float]:
    return [0.1 * t, -0.05 * t, 0.02 * t, 0.3 - 0.1 * t]


def learner_log_probs(episodes: ExternalEpisodes, net: PolicyValueNetwork, batch: dict) -> np.ndarray:
    """log pi(a_t) [B, T] as the learner computes it: a pass over the unrolls, time-major, from
    each one's core state with its done flags."""
    obs = torch.from_numpy(batch["frames"][batch["obs_frame"]]).transpose(0, 1)  # [T+1, B, obs]
    done = torch.from_numpy(batch["done"]).T if "done" in batch else None
    state = (torch.from_numpy(batch["core_h"]), torch.from_numpy(batch["core_c"])) if "core_h" in batch else None
    with torch.no_grad():
        params, _ = net.unroll(obs, done, state)
        logp, _ = log_prob_and_entropy(params[:-1], torch.from_numpy(batch["action"]).transpose(0, 1), episodes.spec)
    return logp.T.numpy()


def test_recurrent_unrolls_give_the_learner_the_actors_own_probabilities():
    """Two episodes in turn on one slot (one ends inside an unroll, so the core restarts
    there): each unroll carries the core's state at its first observation and the done flags,
    and the learner's pass from them gives back every behaviour log-probability."""
    episodes, net = served("model.recurrent=lstm", "model.lstm_size=16", max_episodes=1)
    first = episodes.start()[0]
    for t in range(6):
        episodes.act([first], [cartpole_obs(t)], None if t == 0 else [1.0])
    episodes.end([first], [cartpole_obs(6)], [True], [False], [1.0])
    second = episodes.start()[0]
    for t in range(7):
        episodes.act([second], [cartpole_obs(10 + t)], None if t == 0 else [1.0])
    ((batch, records),) = episodes.take(flush=True)
    impala.batch_schema(episodes.spec, episodes.config).validate(
        batch, impala.batch_limits(K, episodes.spec, episodes.config)
    )
    assert batch["action"].shape == (3, T) and records == [[6.0, 6, True]]
    assert batch["done"].tolist() == [[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]]
    assert not batch["core_h"][0].any() and batch["core_h"][1].any()  # zero only at an episode's start
    np.testing.assert_allclose(learner_log_probs(episodes, net, batch), batch["behaviour_logp"], atol=1e-5)
    # the state the third unroll starts from: the second episode's, after its steps 0 and 1
    h = c = torch.zeros(1, 16)
    for t in range(2):
        with torch.no_grad():
            _, _, (h, c) = net(torch.tensor([cartpole_obs(10 + t)]), (h, c))
    np.testing.assert_allclose(batch["core_h"][2], h[0].numpy(), atol=1e-6)
    np.testing.assert_allclose(batch["core_c"][2], c[0].numpy(), atol=1e-6)


def test_a_feed_forward_unroll_carries_no_core_state():
    episodes, net = served(max_episodes=1)
    (episode,) = episodes.start()
    for t in range(5):
        episodes.act([episode], [cartpole_obs(t)], None if t == 0 else [1.0])
    ((batch, _),) = episodes.take(flush=True)
    assert not {"core_h", "core_c", "done"} & batch.keys()
    np.testing.assert_allclose(learner_log_probs(episodes, net, batch), batch["behaviour_logp"], atol=1e-5)


@pytest.mark.parametrize("bounds", ["clip", "squash"])
def test_continuous_actions_come_back_bounded_and_client_actions_are_kept_with_their_density(bounds):
    """Pendulum (torque in [-2, 2]): the policy's actions come back inside the Box, the
    unroll keeps the samples u they came from; a client's own torque is kept as its preimage
    u with the policy's log-density of it (torch.distributions as the reference); a torque
    outside the Box is refused and changes nothing."""
    episodes, net = served("env.id=Pendulum-v1", f"env.action_bounds={bounds}", max_episodes=1)
    assert episodes.actor.learns_logged_actions
    (episode,) = episodes.start()
    observations = [[np.cos(0.3 * t), np.sin(0.3 * t), 0.5 - 0.2 * t] for t in range(T + 1)]
    replies = []
    for t in range(T):
        reward = None if t == 0 else [-1.0]
        if t % 2:
            episodes.log_action([episode], [observations[t]], [[1.5]], reward)
            replies.append(1.5)
        else:
            (action,) = episodes.act([episode], [observations[t]], reward)
            assert -2.0 <= action[0] <= 2.0
            replies.append(float(action[0]))
    with pytest.raises(RequestError, match=r"outside the action space \[-2, 2\]") as error:
        episodes.log_action([episode], [observations[T]], [[2.5]], [-1.0])
    assert error.value.status == 400
    episodes.act([episode], [observations[T]], [-1.0])  # the unroll's bootstrap step
    ((batch, _),) = episodes.take(flush=True)
    u = batch["action"][0, :, 0].astype(np.float64)
    bounded = 2 * np.tanh(u) if bounds == "squash" else np.clip(u, -2, 2)
    np.testing.assert_allclose(bounded, replies, atol=1e-5)
    with torch.no_grad():
        params, _, _ = net(torch.tensor(observations[:T], dtype=torch.float32))
    mean, log_std = params.chunk(2, dim=-1)
    reference = torch.distributions.Normal(mean, log_std.exp()).log_prob(torch.from_numpy(batch["action"][0]))
    np.testing.assert_allclose(batch["behaviour_logp"][0], reference.sum(-1).numpy(), atol=1e-4)


@pytest.mark.parametrize("normalize", ["auto", "false"])
def test_served_continuous_rewards_are_normalized_as_a_local_actors(normalize):
    """env.normalize_reward (auto: on for Box actions) in served episodes: the rewards in the
    unroll are the client's through a RewardNormalizer fed each episode's own stream, two
    episodes side by side; off, they are the client's."""
    episodes, _ = served("env.id=Pendulum-v1", f"env.normalize_reward={normalize}", max_episodes=2)
    pair = episodes.start(2)
    rewards = np.array([[-3.0, -0.5], [-2.0, -1.5], [-4.0, -0.25], [-1.0, -2.0]])
    for t in range(T + 1):
        obs = [[np.cos(0.3 * t), np.sin(0.3 * t), 0.1 * i] for i in range(2)]
        episodes.act(pair, obs, None if t == 0 else list(rewards[t - 1]))
    ((batch, _),) = episodes.take(flush=True)
    if normalize == "false":
        np.testing.assert_allclose(batch["reward"], rewards.T)
        return
    normalizer, returns, expected = RewardNormalizer(0.9), np.zeros(2), []
    for t in range(T):
        scaled = []
        for i in range(2):  # one episode at a time, as the requests' steps come in
            value, (returns[i],) = normalizer.normalize(rewards[t, i : i + 1], returns[i : i + 1])
            scaled.append(value[0])
        expected.append(scaled)
    np.testing.assert_allclose(batch["reward"], np.array(expected).T, rtol=1e-5)
    assert not np.allclose(batch["reward"], rewards.T)


def test_a_categorical_policy_still_refuses_client_actions():
    episodes, _ = served()
    with pytest.raises(RequestError, match="no probability under its policy") as error:
        episodes.log_action(episodes.start(), [cartpole_obs(0)], [1])
    assert error.value.status == 409
