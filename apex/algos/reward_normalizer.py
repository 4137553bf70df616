"""Rewards divided by a running standard deviation of the discounted return (``env.normalize_reward``),
as Stable-Baselines3's ``VecNormalize`` and Gymnasium's ``NormalizeReward`` do: values then
stay near 1 whatever the task's reward scale, so that a torso shared by the policy and the
value is not spent fitting values of tens (issue 47: on apex-test/Reach-v0, returns near -50,
IMPALA did not learn at all without it).

Each actor keeps its own statistics (no learner round trip; with many actors they agree
within a few thousand steps, as the same task's returns do). The caller keeps the running
returns (an actor's per environment, a served episode's in its state) and zeroes one where its
episode ends; a time limit's bootstrap value, in the value head's units, is added after."""

from __future__ import annotations

import numpy as np

CLIP = 10.0  # VecNormalize's clip_reward: one outlier step cannot dwarf the rest
EPS = 1e-8


class RunningVariance:
    """The variance of a stream of values, updated a batch at a time (Chan et al.'s parallel
    algorithm); it starts at 1 with a weight of almost nothing, as VecNormalize's."""

    def __init__(self) -> None:
        self.mean = 0.0
        self.var = 1.0
        self.count = 1e-4

    def update(self, values: np.ndarray) -> None:
        n = values.size
        if n == 0:
            return
        batch_mean, batch_var = float(values.mean()), float(values.var())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.var = (self.var * self.count + batch_var * n + delta * delta * self.count * n / total) / total
        self.count = total


class RewardNormalizer:
    """``normalize(rewards, returns)``: the rewards of one step of several streams, divided
    by the running standard deviation of their discounted returns (clipped to +-CLIP), and
    the returns moved on by them."""

    def __init__(self, gamma: float) -> None:
        self.gamma = gamma
        self.returns_var = RunningVariance()

    def normalize(self, rewards: np.ndarray, returns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rewards = np.asarray(rewards, np.float64)
        returns = self.gamma * np.asarray(returns, np.float64) + rewards
        finite = np.isfinite(returns)
        self.returns_var.update(returns[finite])  # a non-finite reward cannot poison every later one
        scaled = np.clip(rewards / np.sqrt(self.returns_var.var + EPS), -CLIP, CLIP)
        return scaled, np.where(finite, returns, 0.0)
