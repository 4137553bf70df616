"""The IMPALA actor core (Espeholt et al. 2018): K environments sampling from the policy
they were last sent, unrolls of T steps out with the behaviour policy's log-probabilities
(V-trace corrects for the lag on the learner, ``apex.algos.impala``). Truncated episodes are
bootstrapped here: the last reward gets gamma * V(final observation) from the actor's own
value head. No torch here unless the observations are images (``apex.inference``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from apex.config import Config
from apex.envs import FrameStacker, VectorEnv
from apex.inference import log_probs, policy_value_network
from apex.protocol import Message


class Actor:
    def __init__(self, config: Config, welcome: dict, seed: int, tick: Callable[[], None] = lambda: None) -> None:
        """``tick`` keeps the connection alive while the environments are made."""
        self.config = config
        self.envs = VectorEnv(config.env, welcome["num_envs"], seed, tick)
        self.spec = self.envs.spec
        self.net = policy_value_network(self.spec, config.model)
        self.stacker = FrameStacker(self.num_envs, self.spec.stack, self.spec.frame_shape, self.spec.frame_dtype)
        self.rng = np.random.default_rng(seed)
        self.gamma = config.learner.gamma
        self.clip_rewards = config.is_atari and config.env.clip_rewards
        T, K = config.impala.unroll_length, self.num_envs
        self.action = np.zeros((K, T, *self.spec.action_shape), np.int64)
        self.reward = np.zeros((K, T), np.float32)
        self.discount = np.zeros((K, T), np.float32)
        self.behaviour_logp = np.zeros((K, T), np.float32)
        self.t = 0
        self.steps = 0
        self.weights_version = -1
        self._returns = np.zeros(K)
        self._lengths = np.zeros(K, np.int64)
        frames = self.envs.reset()
        self._frames: list[list[np.ndarray]] = []  # per env, from the first stack of the unroll
        self._obs_frame: list[list[int]] = []  # per env: where each step's stack starts
        for i, frame in enumerate(frames):
            self.stacker.reset(i, frame)
            self._frames.append([frame] * self.spec.stack)
            self._obs_frame.append([0])

    @property
    def num_envs(self) -> int:
        return self.envs.num_envs

    def set_weights(self, msg: Message) -> None:
        self.net.load(msg.arrays)
        self.weights_version = msg.fields["version"]

    def _forward(self, obs: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """(log-policy of each action component [K, n_i], values [K])."""
        logits, values = self.net(obs)
        return log_probs(logits, self.spec.action_nvec), values

    def _sample(self, log_policies: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """a ~ pi (Gumbel-max, per component) and log pi(a): [K] or [K, components], and [K]."""
        rows = np.arange(self.num_envs)
        picks = [np.argmax(lp + self.rng.gumbel(size=lp.shape), axis=1) for lp in log_policies]
        logp = sum(lp[rows, a] for lp, a in zip(log_policies, picks))
        return (picks[0] if self.spec.action_nvec is None else np.stack(picks, axis=1)), logp

    def act(self) -> tuple[dict | None, list[list]]:
        log_policies, _ = self._forward(self.stacker.obs)
        actions, logp = self._sample(log_policies)
        K, t = self.num_envs, self.t
        self.action[:, t] = actions
        self.behaviour_logp[:, t] = logp
        frames, rewards, terminated, truncated, final = self.envs.step(actions)
        self.steps += 1
        self._returns += rewards
        self._lengths += 1
        train_rewards = (np.sign(rewards) if self.clip_rewards else rewards) * self.config.env.reward_scale
        discount = np.where(terminated | truncated, 0.0, self.gamma)
        truncated_only = [i for i in final if truncated[i] and not terminated[i]]
        if truncated_only:  # bootstrap the cut-off episode from the actor's value estimate
            _, final_values = self._forward(np.stack([self.stacker.peek(i, final[i]) for i in truncated_only]))
            train_rewards = train_rewards.astype(np.float64)
            train_rewards[truncated_only] += self.gamma * final_values
        self.reward[:, t] = train_rewards
        self.discount[:, t] = discount
        episodes = []
        for i in range(K):
            if i in final:
                episodes.append([float(self._returns[i]), int(self._lengths[i]), True])
                self._returns[i], self._lengths[i] = 0.0, 0
                self.stacker.reset(i, frames[i])
                self._frames[i] += [frames[i]] * self.spec.stack
                self._obs_frame[i].append(len(self._frames[i]) - self.spec.stack)
            else:
                self.stacker.push(i, frames[i])
                self._frames[i].append(frames[i])
                self._obs_frame[i].append(self._obs_frame[i][-1] + 1)
        self.t += 1
        if self.t < self.config.impala.unroll_length:
            return None, episodes
        return self._emit(), episodes

    def _emit(self) -> dict:
        offsets = np.cumsum([0] + [len(f) for f in self._frames[:-1]])
        batch = {
            "frames": np.stack([frame for env_frames in self._frames for frame in env_frames]),
            "obs_frame": (np.asarray(self._obs_frame) + offsets[:, None]).astype(np.int32),
            "action": self.action.copy(),
            "reward": self.reward.copy(),
            "discount": self.discount.copy(),
            "behaviour_logp": self.behaviour_logp.copy(),
        }
        stack = self.spec.stack
        for i in range(self.num_envs):  # the next unroll starts at this one's bootstrap step
            start = self._obs_frame[i][-1]
            self._frames[i] = self._frames[i][start : start + stack]
            self._obs_frame[i] = [0]
        self.t = 0
        return batch

    def close(self) -> None:
        self.envs.close()
