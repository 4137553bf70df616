"""IMPALA for episodes stepped elsewhere (`apex serve`'s clients, the agents of a multi-agent
environment): actions sampled from the policy, and unrolls built per slot, an episode that ends
handing its row over to the next one on that slot, as a local environment resets within an
unroll (``apex.algos.impala.actor``).

As the local actor does: a recurrent policy's core state is carried per episode (zero at its
first observation), and each unroll goes out with the state at its first observation and the
steps that ended an episode; continuous actions are Gaussian samples u, kept in the unroll with
their log-density, and the reply is u bounded into the Box (``env.action_bounds``).

A client's own action (``log_action``) is taken for a continuous policy only: the unroll keeps
its preimage u and the current policy's density of it, so that V-trace weighs it as the
policy's own sample. A categorical policy refuses it: the client's choice has no density that
would make it the policy's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from apex.algos.chunks import FrameTrack, frame_offsets
from apex.algos.impala.actor import sample, train_reward
from apex.algos.masks import MASKED_LOGIT, episode_masks, masked_values
from apex.algos.reward_normalizer import RewardNormalizer
from apex.config import Config
from apex.envs.make import EnvSpec
from apex.envs.spaces import box_actions, box_samples
from apex.nets.gaussian import LOG_2PI
from apex.nets.numpy_nets import CoreState, policy_value_network
from apex.wire.protocol import Message
from apex.wire.schema import episode_record

if TYPE_CHECKING:
    from apex.core import EpisodeRecord
    from apex.core.episode import Episode


def gaussian_logp(params: np.ndarray, u: np.ndarray) -> np.ndarray:
    """log pi(u) [B] for a diagonal Gaussian's parameters [B, 2D] (means, log standard
    deviations) and samples u [B, D]."""
    mean, log_std = np.split(np.asarray(params, np.float64), 2, axis=1)
    z = (np.asarray(u, np.float64) - mean) * np.exp(-log_std)
    logp: np.ndarray = (-0.5 * z * z - log_std).sum(axis=1) - 0.5 * LOG_2PI * mean.shape[1]
    return logp.astype(np.float32)


class _Row:
    """One row of unrolls (T steps) for the external episodes that play, in turn, on one slot.

    While an episode is under way ``len(track.starts) == t + 1``: the observation it acts on
    is at step t. Between a step's outcome and the next observation ``len(track.starts) == t``."""

    def __init__(self, T: int, spec: EnvSpec) -> None:
        self.action = np.zeros((T, *spec.action_shape), spec.action_dtype)
        self.reward = np.zeros(T, np.float32)
        self.discount = np.zeros(T, np.float32)
        self.behaviour_logp = np.zeros(T, np.float32)
        self.done = np.zeros(T, np.uint8)  # step t ended its episode (a recurrent core restarts after it)
        self.first_core: CoreState | None = None  # the core's state at step 0's observation (recurrent)
        self.track = FrameTrack(spec.stack)
        self.records: list[EpisodeRecord] = []  # of the episodes that ended in this row
        self.t = 0
        self.mask: np.ndarray | None = None  # [T, A] the legal actions of each step (a masked policy's)


def _slot(episode: Episode) -> int:
    """The slot of an episode that acts (``ExternalEpisodes`` seats it before it begins)."""
    if episode.slot is None:
        raise ValueError(f"episode {episode.id} has no slot")
    return episode.slot


class ImpalaEpisodeActor:
    """IMPALA's ``EpisodeActorCore``: the unrolls of episodes stepped elsewhere."""

    reuse_freed_slots = True  # a new episode continues the row an episode just left: no stale half rows

    def __init__(self, config: Config, setup: dict[str, Any], spec: EnvSpec, seed: int) -> None:
        self.config = config
        self.spec = spec
        self.net = policy_value_network(spec, config.model)
        self.recurrent = self.net.initial_state(1) is not None
        self.learns_logged_actions = spec.continuous
        if spec.continuous:
            how = config.env.action_bounds
            self._bound = box_actions(spec.action_low, spec.action_high, how)
            self._preimage = box_samples(spec.action_low, spec.action_high, how)
        self.rng = np.random.default_rng(seed)
        self.gamma = config.impala.gamma
        normalize = spec.resolve_auto(config.env.normalize_reward)
        self.reward_normalizer = RewardNormalizer(self.gamma) if normalize else None
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
        core = self.net.initial_state(1)
        episode.state = {
            "value": 0.0,
            "core": None if core is None else (core[0][0], core[1][0]),
            "return": 0.0,  # discounted, for env.normalize_reward
        }
        slot = _slot(episode)
        if slot not in self._rows:
            row = self._rows[slot] = _Row(self.T, self.spec)
            if self.spec.action_masked:
                row.mask = np.ones((self.T, self.spec.num_actions), np.uint8)

    def _cores(self, episodes: list[Episode]) -> CoreState | None:
        """These episodes' core states, stacked [B, L] (None for a feed-forward policy)."""
        if not self.recurrent:
            return None
        return (
            np.stack([e.state["core"][0] for e in episodes]),
            np.stack([e.state["core"][1] for e in episodes]),
        )

    def act(self, episodes: list[Episode], obs: np.ndarray, chosen: np.ndarray | None) -> np.ndarray:
        """The actions for ``obs`` (the policy's, or ``chosen`` by the client: continuous
        only) as the environment takes them; each step goes into its episode's row."""
        if chosen is not None and not self.spec.continuous:
            raise ValueError("a categorical IMPALA policy acts on its own only")  # ExternalEpisodes refuses it first
        core = self._cores(episodes)
        params, values, next_core = self.net(obs, core)
        if chosen is None:
            mask = episode_masks(episodes, self.spec.num_actions)
            samples, logp = sample(self.rng, masked_values(params, mask, MASKED_LOGIT), self.spec)
            actions = self._bound(samples).astype(np.float32) if self.spec.continuous else samples
        else:
            mask = None
            actions = np.asarray(chosen, np.float32)
            samples = self._preimage(actions).astype(np.float32)
            logp = gaussian_logp(params, samples)
        for i, episode in enumerate(episodes):
            row = self._rows[_slot(episode)]
            frame = obs[i, -1]
            if episode.acted:  # the outcome of its step t, then its next observation
                self._finish_step(row, self._train_reward(episode), False)
                row.track.push(frame)
            else:  # a new episode's first observation (a full stack of it)
                row.track.begin(frame)
            if row.t == self.T:
                self._emit(row)
            if core is not None and row.t == 0:
                row.first_core = (core[0][i].copy(), core[1][i].copy())
            row.action[row.t] = samples[i]
            row.behaviour_logp[row.t] = logp[i]
            if row.mask is not None:
                row.mask[row.t] = 1 if mask is None else mask[i]
            episode.state["value"] = float(values[i])
            if next_core is not None:
                episode.state["core"] = (next_core[0][i], next_core[1][i])
        return actions

    def end(self, episodes: list[Episode], obs: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        cut = [i for i in range(len(episodes)) if truncated[i] and not terminated[i]]
        final_values: dict[int, float] = {}
        if cut:
            _, values, _ = self.net(obs[cut], self._cores([episodes[i] for i in cut]))
            final_values = dict(zip(cut, values))
        for i, episode in enumerate(episodes):
            row = self._rows[_slot(episode)]
            # a time limit: the future is worth gamma * V(final observation), as a local actor does
            reward = self._train_reward(episode) + self.gamma * float(final_values.get(i, 0.0))
            self._finish_step(row, reward, True)
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
            row.done[row.t - 1] = 1

    def _train_reward(self, episode: Episode) -> float:
        """The reward of the episode's last step as trained on (``train_reward``, then
        env.normalize_reward's scaling with the episode's discounted return so far)."""
        reward = float(train_reward(episode.reward, self.config))
        if self.reward_normalizer is None:
            return reward
        scaled, returns = self.reward_normalizer.normalize(np.array([reward]), np.array([episode.state["return"]]))
        episode.state["return"] = float(returns[0])
        return float(scaled[0])

    def _finish_step(self, row: _Row, reward: float, ended: bool) -> None:
        row.reward[row.t] = reward
        row.discount[row.t] = 0.0 if ended else self.gamma
        row.done[row.t] = ended
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
        if self.recurrent:
            if row.first_core is None:
                raise RuntimeError("a recurrent unroll without the core's state at its first step")
            unroll.update(core_h=row.first_core[0], core_c=row.first_core[1], done=row.done.copy())
        self._ready.append((unroll, row.records))
        if keep:
            row.track.drop(self.T)
        else:
            row.track = FrameTrack(self.spec.stack)
        row.records = []
        row.first_core = None
        row.t = 0

    def take(self, flush: bool = False) -> list[tuple[dict[str, np.ndarray], list[EpisodeRecord]]]:
        """Batches of up to the session's unrolls per batch (fewer with ``flush``)."""
        names = ["action", "reward", "discount", "behaviour_logp"]
        names += ["mask"] if self.spec.action_masked else []
        names += ["core_h", "core_c", "done"] if self.recurrent else []
        batches: list[tuple[dict[str, np.ndarray], list[EpisodeRecord]]] = []
        while len(self._ready) >= self.max_unrolls or (flush and self._ready):
            group, self._ready = self._ready[: self.max_unrolls], self._ready[self.max_unrolls :]
            frames = [u["frames"] for u, _ in group]
            batch = {
                "frames": np.concatenate(frames),
                "obs_frame": np.stack([u["obs_frame"] for u, _ in group]) + frame_offsets(frames)[:, None],
            }
            for name in names:
                batch[name] = np.stack([u[name] for u, _ in group])
            batches.append((batch, [record for _, records in group for record in records]))
        return batches
