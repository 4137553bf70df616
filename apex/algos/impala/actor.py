"""The IMPALA actor core (Espeholt et al. 2018): K environments sampling from the policy
they were last sent, unrolls of T steps out with the behaviour policy's log-probabilities
(V-trace corrects for the lag on the learner, ``apex.algos.impala.learner``). Truncated episodes are
bootstrapped here: the last reward gets gamma * V(final observation) from the actor's own
value head. A recurrent policy's core state is carried per environment, zeroed where an
episode starts, and each unroll goes out with the state at its first observation. No torch
here unless the observations are images (``apex.nets.numpy_nets``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, overload

import numpy as np

from apex.algos.chunks import FrameTrack, frame_offsets
from apex.algos.reward_normalizer import RewardNormalizer
from apex.config import Config
from apex.envs.make import EnvSpec, FrameStacker, VectorEnv
from apex.nets.gaussian import LOG_2PI
from apex.nets.numpy_nets import log_probs, policy_value_network
from apex.wire.protocol import Message

if TYPE_CHECKING:
    from apex.core import EpisodeRecord


def sample(rng: np.random.Generator, params: np.ndarray, spec: EnvSpec) -> tuple[np.ndarray, np.ndarray]:
    """a ~ pi and log pi(a) for policy parameters [B, P]: categorical (Gumbel-max, per
    component) [B] or [B, components] int64; Gaussian [B, D] float32, the sample u before the
    adapter bounds it, with its log-density."""
    if spec.continuous:
        mean, log_std = np.split(params, 2, axis=1)
        noise = rng.standard_normal(mean.shape).astype(np.float32)
        logp: np.ndarray = (-0.5 * noise * noise - log_std).sum(axis=1) - 0.5 * LOG_2PI * mean.shape[1]
        return (mean + np.exp(log_std) * noise).astype(np.float32), logp
    log_policies = log_probs(params, spec.action_nvec)
    rows = np.arange(len(log_policies[0]))
    picks = [np.argmax(lp + rng.gumbel(size=lp.shape), axis=1) for lp in log_policies]
    logp = functools.reduce(operator.add, (lp[rows, a] for lp, a in zip(log_policies, picks)))
    return (picks[0] if spec.action_nvec is None else np.stack(picks, axis=1)), logp


@overload
def train_reward(reward: float, config: Config) -> float: ...
@overload
def train_reward(reward: np.ndarray, config: Config) -> np.ndarray: ...
def train_reward(reward: float | np.ndarray, config: Config) -> float | np.ndarray:
    """The reward trained on: sign-clipped for Atari when env.clip_rewards, times env.reward_scale."""
    return (np.sign(reward) if config.env.is_atari and config.env.clip_rewards else reward) * config.env.reward_scale


def setup_problem(setup: dict[str, Any]) -> str | None:
    """IMPALA's actors need nothing beyond the setup's common part (``LearnerCore.actor_setup``)."""
    return None


class ImpalaActor:
    def __init__(
        self, config: Config, setup: dict[str, Any], seed: int, tick: Callable[[], None] = lambda: None
    ) -> None:
        """``tick`` keeps the connection alive while the environments are made."""
        self.config = config
        self.envs = VectorEnv(config.env, setup["num_envs"], seed, tick)
        self.spec = self.envs.spec
        self.net = policy_value_network(self.spec, config.model)
        self.stacker = FrameStacker(self.num_envs, self.spec.stack, self.spec.frame_shape, self.spec.frame_dtype)
        self.rng = np.random.default_rng(seed)
        self.gamma = config.impala.gamma
        normalize = self.spec.resolve_auto(config.env.normalize_reward)
        self.reward_normalizer = RewardNormalizer(self.gamma) if normalize else None
        T, K = config.impala.unroll_length, self.num_envs
        self._normalizer_returns = np.zeros(K)  # each environment's discounted return (env.normalize_reward)
        self.action = np.zeros((K, T, *self.spec.action_shape), self.spec.action_dtype)
        self.reward = np.zeros((K, T), np.float32)
        self.discount = np.zeros((K, T), np.float32)
        self.behaviour_logp = np.zeros((K, T), np.float32)
        self.core = self.net.initial_state(K)  # the recurrent core's (h, c) per environment, or None
        self.first_core = self.core  # at the unroll's first observation
        self.done = np.zeros((K, T), np.uint8)  # step t ended its episode (recurrent unrolls)
        self.t = 0
        self.steps = 0
        self.weights_version = -1
        self._returns = np.zeros(K)
        self._lengths = np.zeros(K, np.int64)
        self._tracks = [FrameTrack(self.spec.stack) for _ in range(K)]  # per env, from the unroll's first step
        for i, frame in enumerate(self.envs.reset()):
            self.stacker.reset(i, frame)
            self._tracks[i].begin(frame)

    @property
    def num_envs(self) -> int:
        return self.envs.num_envs

    def set_weights(self, msg: Message) -> None:
        self.net.load(msg.arrays)
        self.weights_version = msg.fields["version"]

    def act(self) -> tuple[dict[str, np.ndarray] | None, list[EpisodeRecord]]:
        K, t = self.num_envs, self.t
        if t == 0:
            self.first_core = self.core
        params, _, core = self.net(self.stacker.obs, self.core)
        actions, logp = sample(self.rng, params, self.spec)
        self.action[:, t] = actions
        self.behaviour_logp[:, t] = logp
        frames, rewards, terminated, truncated, final = self.envs.step(actions)
        self.steps += 1
        self._returns += rewards
        self._lengths += 1
        train_rewards = train_reward(rewards, self.config)
        if self.reward_normalizer is not None:
            train_rewards, returns = self.reward_normalizer.normalize(train_rewards, self._normalizer_returns)
            self._normalizer_returns = np.where(terminated | truncated, 0.0, returns)
        discount = np.where(terminated | truncated, 0.0, self.gamma)
        truncated_only = [i for i in final if truncated[i] and not terminated[i]]
        if truncated_only:  # bootstrap the cut-off episode from the actor's value estimate
            final_core = None if core is None else (core[0][truncated_only], core[1][truncated_only])
            _, final_values, _ = self.net(
                np.stack([self.stacker.peek(i, final[i]) for i in truncated_only]), final_core
            )
            train_rewards = train_rewards.astype(np.float64)
            train_rewards[truncated_only] += self.gamma * final_values
        self.reward[:, t] = train_rewards
        self.discount[:, t] = discount
        self.done[:, t] = terminated | truncated
        if core is not None and final:  # those environments start new episodes (the net's output: ours to zero)
            ended = list(final)
            for part in core:
                part[ended] = 0.0
        self.core = core
        episodes: list[EpisodeRecord] = []
        for i in range(K):
            if i in final:
                episodes.append([float(self._returns[i]), int(self._lengths[i]), True])
                self._returns[i], self._lengths[i] = 0.0, 0
                self.stacker.reset(i, frames[i])
                self._tracks[i].begin(frames[i])
            else:
                self.stacker.push(i, frames[i])
                self._tracks[i].push(frames[i])
        self.t += 1
        if self.t < self.config.impala.unroll_length:
            return None, episodes
        return self._emit(), episodes

    def _emit(self) -> dict[str, np.ndarray]:
        T = self.config.impala.unroll_length
        frames, starts = zip(*(track.take(T) for track in self._tracks))
        batch = {  # every environment's frames stacked in one copy
            "frames": np.stack([frame for env_frames in frames for frame in env_frames]),
            "obs_frame": np.stack(starts) + frame_offsets(frames)[:, None],
            "action": self.action.copy(),
            "reward": self.reward.copy(),
            "discount": self.discount.copy(),
            "behaviour_logp": self.behaviour_logp.copy(),
        }
        if self.first_core is not None:
            batch["core_h"], batch["core_c"] = (np.array(part, np.float32) for part in self.first_core)
            batch["done"] = self.done.copy()
        for track in self._tracks:  # the next unroll starts at this one's bootstrap step
            track.drop(T)
        self.t = 0
        return batch

    def batch_info(self, episodes: list[EpisodeRecord]) -> dict[str, Any]:
        return {"episodes": episodes}

    def close(self) -> None:
        self.envs.close()
