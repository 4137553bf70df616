"""Ape-X DQN pieces against slow references written from the paper's definitions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from apex.algos.apex_dqn import actor as apex_dqn_actor
from apex.algos.apex_dqn.loss import dqn_loss


def reference_transitions(frames, actions, rewards, values, q_taken, final_value, terminated, n, gamma, stack):
    """Every transition of one episode, straight from the definitions (slow)."""
    T = len(actions)
    padded = [frames[0]] * (stack - 1) + list(frames)  # padded[t + stack - 1] = frame at step t

    def obs(t):
        return np.stack(padded[t : t + stack])

    out = []
    for t in range(T):
        horizon = min(t + n, T)
        ret = sum(gamma**k * rewards[t + k] for k in range(horizon - t))
        if terminated and horizon == T:
            discount, bootstrap = 0.0, 0.0
        else:
            discount = gamma ** (horizon - t)
            bootstrap = final_value if horizon == T else values[horizon]
        priority = abs(ret + discount * bootstrap - q_taken[t])
        out.append((obs(t), actions[t], ret, discount, obs(horizon), priority))
    return out


@settings(max_examples=150)
@given(
    length=st.integers(1, 40),
    n=st.integers(1, 5),
    stack=st.sampled_from([1, 4]),
    chunk=st.integers(1, 12),
    terminated=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_chunker_matches_reference(length, n, stack, chunk, terminated, seed):
    rng = np.random.default_rng(seed)
    gamma = 0.9
    frames = [np.full((2, 2), t, np.float32) for t in range(length + 1)]  # frame t = value t
    actions = rng.integers(0, 3, length)
    rewards = rng.standard_normal(length)
    values = rng.standard_normal(length)
    q_taken = rng.standard_normal(length)
    final_value = float(rng.standard_normal())

    chunker = apex_dqn_actor.NStepChunker(stack, n, gamma, chunk, clip_rewards=False)
    chunker.start(frames[0])
    chunks = []
    for t in range(length):
        c = chunker.record_action(actions[t], q_taken[t], values[t])
        if c is not None:
            assert len(c["action"]) == chunk
            chunks.append(c)
        chunker.record_step(rewards[t], frames[t + 1])
    last = chunker.end_episode(terminated, final_value)
    if last is not None:
        chunks.append(last)
    assert chunker.episode_return == pytest.approx(rewards.sum())

    got = []
    for c in chunks:
        f = c["frames"]
        for i in range(len(c["action"])):
            o, nx = c["obs_frame"][i], c["next_obs_frame"][i]
            got.append(
                (
                    f[o : o + stack],
                    c["action"][i],
                    c["reward"][i],
                    c["discount"][i],
                    f[nx : nx + stack],
                    c["priority"][i],
                )
            )
    expected = reference_transitions(
        frames, actions, rewards, values, q_taken, final_value, terminated, n, gamma, stack
    )
    assert len(got) == len(expected) == length
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g[0], e[0])
        assert g[1] == e[1]
        assert g[2] == pytest.approx(e[2], rel=1e-5, abs=1e-5)
        assert g[3] == pytest.approx(e[3], rel=1e-6)
        np.testing.assert_array_equal(g[4], e[4])
        assert g[5] == pytest.approx(e[5], rel=1e-4, abs=1e-4)


def test_chunker_clips_training_rewards_but_not_the_return():
    chunker = apex_dqn_actor.NStepChunker(1, 1, 0.5, 10, clip_rewards=True)
    chunker.start(np.zeros(1))
    for r in (5.0, -3.0):
        chunker.record_action(0, 0.0, 0.0)
        chunker.record_step(r, np.zeros(1))
    chunk = chunker.end_episode(True, 0.0)
    assert chunk["reward"].tolist() == [1.0, -1.0]
    assert chunker.episode_return == 2.0


def test_chunker_scales_training_rewards_but_not_the_return():
    chunker = apex_dqn_actor.NStepChunker(1, 1, 0.5, 10, clip_rewards=False, reward_scale=0.01)
    chunker.start(np.zeros(1))
    for r in (-1.0, -1.0, 100.0):
        chunker.record_action(0, 0.0, 0.0)
        chunker.record_step(r, np.zeros(1))
    chunk = chunker.end_episode(True, 0.0)
    np.testing.assert_allclose(chunk["reward"], [-0.01, -0.01, 1.0], rtol=1e-6)
    assert chunker.episode_return == 98.0


def test_merge_chunks_offsets_frame_indices():
    a = {
        "frames": np.arange(3.0)[:, None],
        "obs_frame": np.array([0, 1]),
        "next_obs_frame": np.array([1, 2]),
        "action": np.array([0, 1]),
        "reward": np.ones(2),
        "discount": np.ones(2),
        "priority": np.ones(2),
    }
    b = {
        "frames": np.arange(10.0, 12.0)[:, None],
        "obs_frame": np.array([0]),
        "next_obs_frame": np.array([1]),
        "action": np.array([2]),
        "reward": np.ones(1),
        "discount": np.ones(1),
        "priority": np.ones(1),
    }
    m = apex_dqn_actor.merge_chunks([a, b])
    assert m["frames"][m["obs_frame"], 0].tolist() == [0.0, 1.0, 10.0]
    assert m["frames"][m["next_obs_frame"], 0].tolist() == [1.0, 2.0, 11.0]
    assert m["action"].tolist() == [0, 1, 2]


class TableQ(nn.Module):
    """Q(s, a) = table[s, a] for integer states: easy to compute by hand."""

    def __init__(self, table):
        super().__init__()
        self.table = nn.Parameter(torch.tensor(table, dtype=torch.float32))

    def forward(self, obs):
        return self.table[obs.long().squeeze(-1)]


def test_dqn_loss_is_double_dqn_with_importance_weights():
    online = TableQ([[1.0, 2.0], [3.0, 0.5]])
    target = TableQ([[10.0, 20.0], [30.0, 40.0]])
    obs = torch.tensor([[0], [1]])
    next_obs = torch.tensor([[1], [0]])
    action = torch.tensor([1, 0])
    reward = torch.tensor([1.0, 2.0])
    discount = torch.tensor([0.5, 0.0])
    weights = torch.tensor([1.0, 0.5])
    out = dqn_loss(online, target, obs, action, reward, discount, next_obs, weights)
    # sample 0: online argmax at state 1 is action 0 -> target Q(1, 0) = 30; y = 1 + 0.5 * 30 = 16
    # sample 1: terminal (discount 0): y = 2
    q = torch.tensor([2.0, 3.0])
    y = torch.tensor([16.0, 2.0])
    td = y - q
    huber = torch.where(td.abs() <= 1, 0.5 * td**2, td.abs() - 0.5)
    assert out.loss.item() == pytest.approx((weights * huber).mean().item())
    assert out.priorities.tolist() == pytest.approx(td.abs().tolist())
    out.loss.backward()
    assert target.table.grad is None  # no gradient into the target network
    assert online.table.grad[1, 0] != 0 and online.table.grad[0, 0] == 0
