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
from apex.algos.masks import MASKED_LOGIT, episode_masks, masked_values
from apex.config import Config
from apex.envs.make import EnvSpec, FrameStacker, VectorEnv
from apex.errors import ConfigError
from apex.nets.gaussian import LOG_2PI
from apex.nets.numpy_nets import log_probs, policy_value_network
from apex.wire.protocol import Message
from apex.wire.schema import episode_record

if TYPE_CHECKING:
    from apex.core import EpisodeRecord
    from apex.core.episode import Episode


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
        T, K = config.impala.unroll_length, self.num_envs
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


class _Row:
    """One row of unrolls (T steps) for the external episodes that play, in turn, on one slot.

    While an episode is under way ``len(track.starts) == t + 1``: the observation it acts on
    is at step t. Between a step's outcome and the next observation ``len(track.starts) == t``."""

    def __init__(self, T: int, action_shape: tuple[int, ...], stack: int) -> None:
        self.action = np.zeros((T, *action_shape), np.int64)
        self.reward = np.zeros(T, np.float32)
        self.discount = np.zeros(T, np.float32)
        self.behaviour_logp = np.zeros(T, np.float32)
        self.track = FrameTrack(stack)
        self.records: list[EpisodeRecord] = []  # of the episodes that ended in this row
        self.t = 0
        self.mask: np.ndarray | None = None  # [T, A] the legal actions of each step (a masked policy's)


def _slot(episode: Episode) -> int:
    """The slot of an episode that acts (``ExternalEpisodes`` seats it before it begins)."""
    if episode.slot is None:
        raise ValueError(f"episode {episode.id} has no slot")
    return episode.slot


class ImpalaEpisodeActor:
    """IMPALA for episodes stepped elsewhere (``apex.serve.episodes``): actions sampled from the
    policy, and the unrolls built per slot, an episode that ends handing its row over to the
    next one on that slot (as a local environment resets within an unroll). Client-chosen
    actions are refused: V-trace needs the behaviour policy's own probabilities."""

    learns_logged_actions = False
    reuse_freed_slots = True  # a new episode continues the row an episode just left: no stale half rows

    def __init__(self, config: Config, setup: dict[str, Any], spec: EnvSpec, seed: int) -> None:
        if config.model.recurrent != "none" or spec.continuous:
            what = (
                "a recurrent model (model.recurrent lstm)" if config.model.recurrent != "none" else "continuous actions"
            )
            raise ConfigError(
                f"apex serve runs feed-forward IMPALA policies over Discrete and MultiDiscrete actions, "
                f"and this learner trains {what}: step that environment in apex actors "
                "(env.imports) instead"
            )
        self.config = config
        self.spec = spec
        self.net = policy_value_network(spec, config.model)
        self.rng = np.random.default_rng(seed)
        self.gamma = config.impala.gamma
        self.T = config.impala.unroll_length
        self.max_unrolls = setup["num_envs"]  # per batch: the learner's limit for this session
        self.weights_version = -1
        self._rows: dict[int, _Row] = {}
        # one unroll each, with the episodes it ends
        self._ready: list[tuple[dict[str, np.ndarray], list[EpisodeRecord]]] = []

    def set_weights(self, msg: Message) -> None:
        self.net.load(msg.arrays)
        self.weights_version = msg.fields["version"]

    def begin(self, episode: Episode) -> None:
        episode.state = {"value": 0.0}
        slot = _slot(episode)
        if slot not in self._rows:
            row = self._rows[slot] = _Row(self.T, self.spec.action_shape, self.spec.stack)
            if self.spec.action_masked:
                row.mask = np.ones((self.T, self.spec.num_actions), np.uint8)

    def act(self, episodes: list[Episode], obs: np.ndarray, chosen: np.ndarray | None) -> np.ndarray:
        if chosen is not None:
            raise ValueError("IMPALA acts on its own policy only")  # ExternalEpisodes refuses it first
        params, values, _ = self.net(obs)
        mask = episode_masks(episodes, self.spec.num_actions)
        actions, logp = sample(self.rng, masked_values(params, mask, MASKED_LOGIT), self.spec)
        for i, episode in enumerate(episodes):
            row = self._rows[_slot(episode)]
            frame = obs[i, -1]
            if episode.acted:  # the outcome of its step t, then its next observation
                self._finish_step(row, float(train_reward(episode.reward, self.config)), self.gamma)
                row.track.push(frame)
            else:  # a new episode's first observation (a full stack of it)
                row.track.begin(frame)
            if row.t == self.T:
                self._emit(row)
            row.action[row.t] = actions[i]
            row.behaviour_logp[row.t] = logp[i]
            if row.mask is not None:
                row.mask[row.t] = 1 if mask is None else mask[i]
            episode.state["value"] = float(values[i])
        return actions

    def end(self, episodes: list[Episode], obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        cut = [i for i in range(len(episodes)) if truncated[i] and not terminated[i]]
        final_values = dict(zip(cut, self.net(obs[cut])[1])) if cut else {}
        for i, episode in enumerate(episodes):
            row = self._rows[_slot(episode)]
            # a time limit: the future is worth gamma * V(final observation), as a local actor does
            reward = float(train_reward(episode.reward, self.config)) + self.gamma * float(final_values.get(i, 0.0))
            self._finish_step(row, reward, 0.0)
            row.records.append(episode_record(episode, True))
            if row.t == self.T:  # complete but for its bootstrap step, which discount 0 ignores
                row.track.begin(obs[i, -1])
                self._emit(row, keep=False)

    def abandon(self, episode: Episode) -> None:
        """An idle episode closed: cut at its last observation (a time limit there, worth
        gamma * V of it); the action out there is dropped."""
        if not episode.acted:
            return
        row = self._rows[_slot(episode)]
        row.track.pop()
        if episode.length > 0 and row.t > 0:  # its previous step is in this row: make it the last
            row.reward[row.t - 1] += self.gamma * episode.state["value"]
            row.discount[row.t - 1] = 0.0

    def _finish_step(self, row: _Row, reward: float, discount: float) -> None:
        row.reward[row.t] = reward
        row.discount[row.t] = discount
        row.t += 1

    def _emit(self, row: _Row, keep: bool = True) -> None:
        """Hands out a complete unroll; the row goes on from its bootstrap step (``keep``)
        or empty (an episode ended on its last step)."""
        frames, starts = row.track.take(self.T)
        unroll = {
            "frames": np.stack(frames),
            "obs_frame": starts,
            "action": row.action.copy(),
            "reward": row.reward.copy(),
            "discount": row.discount.copy(),
            "behaviour_logp": row.behaviour_logp.copy(),
            **({} if row.mask is None else {"mask": row.mask.copy()}),
        }
        self._ready.append((unroll, row.records))
        if keep:
            row.track.drop(self.T)
        else:
            row.track = FrameTrack(self.spec.stack)
        row.records = []
        row.t = 0

    def take(self, flush: bool = False) -> list[tuple[dict[str, np.ndarray], list[EpisodeRecord]]]:
        """Batches of up to the session's unrolls per batch (fewer with ``flush``)."""
        batches: list[tuple[dict[str, np.ndarray], list[EpisodeRecord]]] = []
        while len(self._ready) >= self.max_unrolls or (flush and self._ready):
            group, self._ready = self._ready[: self.max_unrolls], self._ready[self.max_unrolls :]
            frames = [u["frames"] for u, _ in group]
            batch = {
                "frames": np.concatenate(frames),
                "obs_frame": np.stack([u["obs_frame"] for u, _ in group]) + frame_offsets(frames)[:, None],
            }
            for name in (
                "action",
                "reward",
                "discount",
                "behaviour_logp",
                *(("mask",) if self.spec.action_masked else ()),
            ):
                batch[name] = np.stack([u[name] for u, _ in group])
            batches.append((batch, [record for _, records in group for record in records]))
        return batches
