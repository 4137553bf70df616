"""Ape-X DQN (Horgan et al. 2018, "Distributed Prioritized Experience Replay").

Actor side: the epsilon ladder (Sec. 4.1: eps_i = eps ** (1 + alpha * i / (N - 1)), eps=0.4,
alpha=7; here spread over the actors that join, see ``actor_epsilons``), and ``NStepChunker``, which turns one environment's steps into n-step transitions
(Sec. 3, Alg. 1) with initial priorities from the actor's own Q-values:

    G_t = sum_{k<n} gamma^k r_{t+k},   target_t = G_t + gamma^n max_a Q(s_{t+n}, a)
    priority_t = |target_t - Q(s_t, a_t)|

bootstrapping on truncation (time limits) and not on termination.

Learner side: ``dqn_loss``, double DQN (van Hasselt et al. 2016) with a target network and
Huber loss weighted by importance-sampling weights; it returns new priorities |td|.

Where defaults differ from the paper (see configs/): a smaller replay and batch, a much
shorter target-network period and a higher learning rate for CartPole on two cores; the
actors' envs also include ``actor.eval_envs`` near-greedy ones that report
return_mean_100.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from apex.config import ActorConfig, Config
from apex.envs import EnvSpec, FrameStacker, VectorEnv
from apex.models import QNetwork, load_numpy_weights, numpy_weights, to_device
from apex.errors import ProtocolError
from apex.protocol import Compressed, Message
from apex.replay import RateLimiter, StackedReplay
from apex.schema import FLOAT32_MAX, ArrayRule, BatchSchema, Range, below, frame_rule
from apex.spaces import check_algo_actions


def epsilon_ladder(i: int, n: int, base: float = 0.4, alpha: float = 7.0) -> float:
    """Exploration rate of the i-th of n exploring environments (the paper's ladder)."""
    if n <= 1:
        return base
    return ladder_epsilon(i / (n - 1), base, alpha)


def ladder_epsilon(u: float, base: float = 0.4, alpha: float = 7.0) -> float:
    """Exploration rate at position u in [0, 1] of the ladder: base at 0, base ** (1 + alpha) at 1."""
    return base ** (1 + alpha * u)


def actor_offset(actor_index: int) -> float:
    """Where in [0, 1) an actor's environments sit between rungs: the base-2 van der Corput
    sequence (0, 1/2, 1/4, 3/4, 1/8, ...), so that actors 0..M-1 together always spread
    evenly, whatever M is, without an actor's epsilons changing as others join."""
    offset, scale = 0.0, 0.5
    while actor_index:
        offset += scale * (actor_index & 1)
        actor_index >>= 1
        scale /= 2
    return offset


def actor_epsilons(actor_index: int, num_envs: int, config: ActorConfig) -> tuple[list[float], list[bool]]:
    """Per-environment epsilons for one actor, and which of its environments evaluate.

    The ladder follows the actors actually in the run, however many join: the K exploring
    environments of actor i sit at positions u = (j + offset_i) / K, j = 0..K-1, on
    eps = eps_base ** (1 + eps_alpha * u), with offset_i = ``actor_offset(i)``. Every actor
    covers the whole range; actors with distinct indices (the learner hands out the lowest
    free one, so a newcomer takes the place of one that left) get distinct epsilons, and
    actors 0..M-1 fill the ladder evenly (exactly so for M a power of two; with M actors of
    K environments it is the paper's ladder over M*K rungs, its greediest rung at u < 1).
    The last ``eval_envs`` of each actor play with ``eval_epsilon``. Evaluation episodes
    (return_mean_100) are those of every environment whose epsilon is at most
    ``eval_epsilon``: the set-aside ones and the near-greedy end of the ladder, never the
    exploring ones that would drag the mean down.
    """
    eval_envs = min(config.eval_envs, num_envs)
    exploring = num_envs - eval_envs
    offset = actor_offset(actor_index)
    epsilons = [ladder_epsilon((j + offset) / exploring, config.eps_base, config.eps_alpha) for j in range(exploring)]
    epsilons += [config.eval_epsilon] * eval_envs
    return epsilons, [eps <= config.eval_epsilon for eps in epsilons]


class NStepChunker:
    """Builds one environment's n-step transitions and hands them out in chunks.

    Frames are stored once: the observation at step t is the stack of frames
    ``F[t .. t+stack-1]`` where ``F`` holds ``stack`` copies of the episode's first frame,
    then one frame per step. A chunk carries the frames its transitions need plus, per
    transition, where its observation stack and its bootstrap stack start.

    Call order per step: ``record_action`` (when acting on s_t, with Q(s_t, a_t) and
    max_a Q(s_t, a)), then ``record_step`` (reward r_t and the next frame), then, if the
    episode ended, ``end_episode``.
    """

    def __init__(self, stack: int, n_step: int, gamma: float, chunk_transitions: int, clip_rewards: bool) -> None:
        self.stack, self.n, self.gamma = stack, n_step, gamma
        self.chunk_transitions = chunk_transitions
        self.clip_rewards = clip_rewards
        self._powers = gamma ** np.arange(n_step + 1)

    def start(self, frame: np.ndarray) -> None:
        """Begins an episode whose first frame is ``frame``."""
        self.frames = [frame] * self.stack  # F[c .. ]: from the first frame of the chunk's first stack
        self.actions: list[int] = []
        self.q_taken: list[float] = []
        self.values: list[float] = []  # max_a Q(s_t, a) for t = c, c+1, ...
        self.rewards: list[float] = []
        self.c = 0  # step index of the chunk's first transition
        self.t = 0  # current step index
        self.episode_return = 0.0

    def record_action(self, action: int, q_taken: float, value: float) -> dict | None:
        """Acting on s_t; returns a chunk when enough transitions have their bootstrap value."""
        self.actions.append(int(action))
        self.q_taken.append(float(q_taken))
        self.values.append(float(value))
        complete = self.t - self.n + 1 - self.c  # transitions t' with t' + n <= t
        if complete >= self.chunk_transitions:
            return self._emit(self.chunk_transitions, end=None, terminated=False, final_value=0.0)
        return None

    def record_step(self, reward: float, next_frame: np.ndarray) -> None:
        self.episode_return += reward
        self.rewards.append(float(np.sign(reward)) if self.clip_rewards else float(reward))
        self.frames.append(next_frame)
        self.t += 1

    def end_episode(self, terminated: bool, final_value: float) -> dict | None:
        """The episode ended at step t (``final_value``: max_a Q of the final observation,
        used only on truncation). Returns a chunk of every remaining transition."""
        count = self.t - self.c
        return self._emit(count, end=self.t, terminated=terminated, final_value=final_value) if count else None

    def _emit(self, count: int, *, end: int | None, terminated: bool, final_value: float) -> dict:
        c, n = self.c, self.n
        steps = np.arange(c, c + count)
        horizon = steps + n if end is None else np.minimum(steps + n, end)  # bootstrap step
        rewards = np.asarray(self.rewards, np.float64)
        values = np.asarray(self.values + ([final_value] if end is not None else []), np.float64)
        returns = np.zeros(count)
        for k in range(n):  # G_t = sum_k gamma^k r_{t+k}, stopping at the horizon
            alive = steps + k < horizon
            returns[alive] += self._powers[k] * rewards[(steps + k - c)[alive]]
        discount = self._powers[horizon - steps]
        if terminated:
            discount = np.where(horizon == end, 0.0, discount)
        priority = np.abs(returns + discount * values[horizon - c] - np.asarray(self.q_taken[:count]))
        last_frame = int(horizon.max()) - c + self.stack  # exclusive end of the frames needed
        chunk = {
            "frames": np.stack(self.frames[:last_frame]),
            "obs_frame": (steps - c).astype(np.int32),
            "next_obs_frame": (horizon - c).astype(np.int32),
            "action": np.asarray(self.actions[:count], np.int64),
            "reward": returns.astype(np.float32),
            "discount": discount.astype(np.float32),
            "priority": priority.astype(np.float32),
        }
        del self.frames[:count], self.actions[:count], self.q_taken[:count]
        del self.values[:count], self.rewards[:count]
        self.c += count
        return chunk


def merge_chunks(chunks: list[dict]) -> dict:
    """Concatenates chunks into one batch, offsetting frame indices."""
    if len(chunks) == 1:
        return chunks[0]
    offsets = np.cumsum([0] + [len(c["frames"]) for c in chunks[:-1]], dtype=np.int32)
    indices = ("obs_frame", "next_obs_frame")
    merged = {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0] if name not in indices}
    for name in indices:
        merged[name] = np.concatenate([c[name] + off for c, off in zip(chunks, offsets)]).astype(np.int32, copy=False)
    return merged


def batch_schema(spec: EnvSpec, config: Config) -> BatchSchema:
    """What an Ape-X batch holds: frames, then per transition where its observation and
    bootstrap stacks start in them, its action, n-step return, discount and priority."""
    stack_starts = below("frames", 1 - spec.stack)
    max_return = config.transport.max_abs_reward * config.learner.n_step
    transitions = ("transitions",)
    return BatchSchema((
        frame_rule(spec.frame_shape, spec.frame_dtype),
        ArrayRule("obs_frame", "iu", np.dtype(np.int32), transitions, stack_starts),
        ArrayRule("next_obs_frame", "iu", np.dtype(np.int32), transitions, stack_starts),
        ArrayRule("action", "iu", np.dtype(np.int64), transitions, below(spec.num_actions)),
        ArrayRule("reward", "f", np.dtype(np.float32), transitions, Range(-max_return, max_return)),
        ArrayRule("discount", "f", np.dtype(np.float32), transitions, Range(0.0, 1.0)),
        # float32 and finite: however many there are, their sum in the tree stays finite
        ArrayRule("priority", "f", np.dtype(np.float32), transitions, Range(0.0, FLOAT32_MAX)),
    ))


def batch_limits(num_envs: int, spec: EnvSpec, config: Config) -> dict[str, int]:
    """The most transitions and frames one batch of an actor with ``num_envs`` environments
    can hold: it sends once it holds chunk_transitions (C) or more, and one step adds at
    most two chunks per environment (a full one and an episode's end, each up to C + n
    transitions, with the n + stack frames around them)."""
    chunk, n = config.actor.chunk_transitions, config.learner.n_step
    chunks = chunk + 2 * num_envs
    transitions = chunk + num_envs * (2 * chunk + n)
    return {"transitions": min(transitions, config.replay.capacity),
            "frames": min(transitions + chunks * (n + spec.stack), config.frame_capacity)}


class LossOutput(NamedTuple):
    loss: torch.Tensor  # scalar, to minimise
    priorities: torch.Tensor  # [B] |td|, detached
    q_mean: torch.Tensor  # scalar, detached
    td_abs_mean: torch.Tensor  # scalar, detached


def dqn_loss(
    online: nn.Module,
    target: nn.Module,
    obs: torch.Tensor,  # [B, *obs_shape]
    action: torch.Tensor,  # [B] int64
    reward: torch.Tensor,  # [B] n-step return
    discount: torch.Tensor,  # [B] gamma^k, 0 where the episode terminated
    next_obs: torch.Tensor,  # [B, *obs_shape]
    weights: torch.Tensor,  # [B] importance-sampling weights
) -> LossOutput:
    """Double DQN: the online network picks the next action, the target network values it."""
    q = online(obs).gather(1, action[:, None]).squeeze(1)  # [B]
    with torch.no_grad():  # separate passes: backward then runs over B rows, not 2B
        next_action = online(next_obs).argmax(dim=1, keepdim=True)  # [B, 1]
        next_q = target(next_obs).gather(1, next_action).squeeze(1)  # [B]
        td_target = reward + discount * next_q
    td = td_target - q
    loss = (weights * F.huber_loss(q, td_target, reduction="none")).mean()
    return LossOutput(loss, td.detach().abs(), q.detach().mean(), td.detach().abs().mean())


# ---------------------------------------------------------------------------------------
# The learner core: owns the networks, the replay and its rate limiter.


class Learner:
    """Double dueling DQN over a prioritized replay of frame-deduplicated n-step transitions.

    The generic learner process calls ``insert`` from its ingest thread and ``step`` from
    its main loop; ``wait_to_insert`` / ``wait_to_step`` apply the sample-to-insert limit.
    """

    def __init__(self, config: Config, spec: EnvSpec, device: torch.device) -> None:
        torch.manual_seed(config.seed)
        if spec.action_nvec is not None:  # env_spec(..., algo) says so first, in the parent process
            check_algo_actions("MultiDiscrete", spec.action_nvec, "apex_dqn", config.env.id)
        self.config = config
        self.spec = spec
        self.device = device
        self.online = QNetwork(spec, config.model).to(device)
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        # fused: one kernel for all parameters (measured: 2.3 -> 2.0 ms a CartPole update on CPU)
        self.optimizer = torch.optim.Adam(
            self.online.parameters(), lr=config.learner.lr, eps=config.learner.adam_eps, fused=True
        )
        self.replay = StackedReplay(
            spec.frame_shape, spec.frame_dtype, spec.stack, config.replay.capacity, config.frame_capacity,
            alpha=config.replay.alpha, eps=config.replay.eps, seed=config.seed,
        )
        self.limiter = RateLimiter(config.replay.samples_per_insert, config.replay.min_size, config.replay.rate_slack)
        self.updates = 0
        self.skipped_updates = 0  # non-finite loss or gradient: not applied
        self.dropped_transitions = 0  # whose loss was not finite: never sampled again
        self.samples_per_update = config.learner.batch_size
        self.schema = batch_schema(spec, config)

    def batch_limits(self, num_envs: int) -> dict[str, int]:
        return batch_limits(num_envs, self.spec, self.config)

    @staticmethod
    def env_steps(sizes: dict[str, int]) -> int:
        """Env steps a validated batch stands for: one transition per step."""
        return sizes["transitions"]

    def welcome(self, actor_index: int, num_envs: int) -> dict:
        epsilons, eval_mask = actor_epsilons(actor_index, num_envs, self.config.actor)
        return {"epsilons": epsilons, "eval_envs": eval_mask}

    def wait_to_insert(self, timeout: float) -> bool:
        return self.limiter.wait_to_insert(timeout)

    def insert(self, arrays: dict) -> int:
        """Stores a batch validated by ``self.schema``; frames may still be lz4-compressed
        (decode(lazy=True)): the replay decompresses them straight into its frame ring."""
        self.replay.add(arrays)
        count = len(arrays["priority"])
        self.limiter.inserted(count)
        return count

    def insert_many(self, batches: list[dict]) -> list[Exception | None]:
        """Inserts several validated batches; returns each one's error (a ProtocolError for
        a corrupt lz4 payload), or None. Batches with plain frames go in merged, as one
        insert (the bookkeeping of a small CartPole batch costs more than its data), if
        together they fit the replay; compressed frames go in one by one, straight into
        the frame ring."""
        errors: list[Exception | None] = [None] * len(batches)
        plain = [i for i, b in enumerate(batches) if not isinstance(b["frames"], Compressed)]
        if len(plain) > 1:
            merged = merge_chunks([batches[i] for i in plain])
            if len(merged["frames"]) <= self.replay.frames.capacity and len(merged["priority"]) <= self.replay.capacity:
                self.insert(merged)
                plain = []
        for i, batch in enumerate(batches):
            if i in plain or isinstance(batch["frames"], Compressed):
                try:
                    self.insert(batch)
                except ProtocolError as e:  # the frames' lz4 payload did not decompress
                    errors[i] = e
        return errors

    def wait_to_step(self, timeout: float) -> bool:
        if not self.limiter.wait_to_sample(self.config.learner.batch_size, timeout):
            return False
        if not self.replay.transitions.sampleable:  # every transition dropped as poison: wait for more
            time.sleep(timeout)
            return False
        return True

    def step(self) -> dict[str, float]:
        """One update: sample, move to the device, train, write the priorities back (not
        when the update was skipped as non-finite)."""
        cfg = self.config
        batch, indices, weights = self.replay.sample(cfg.learner.batch_size, cfg.replay.beta)
        tensors = self.to_device({**batch, "weights": weights})
        priorities, metrics = self.train_on(tensors)
        priorities = priorities.cpu().numpy()
        if metrics:
            self.replay.update_priorities(indices, priorities)
        else:  # skipped: the transitions that made it non-finite are never sampled again
            self.dropped_transitions += self.replay.drop(indices[~np.isfinite(priorities)])
        self.limiter.sampled(cfg.learner.batch_size)
        return metrics

    def to_device(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {name: to_device(array, self.device) for name, array in batch.items()}

    def train_on(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The gradient step on a batch already on the device: (new priorities, metrics).
        A non-finite loss, gradient or priority skips the step (metrics empty, counted in
        ``skipped_updates``; the priorities show the rows that were not finite): one host
        synchronisation decides, the one the metrics need."""
        out = dqn_loss(self.online, self.target, batch["obs"], batch["action"], batch["reward"],
                       batch["discount"], batch["next_obs"], batch["weights"])
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.online.parameters(), self.config.learner.grad_clip)
        figures = torch.stack([out.loss.detach(), out.q_mean, out.td_abs_mean, grad_norm,
                               out.priorities.sum()]).cpu().tolist()
        metrics = dict(zip(("loss", "q_mean", "td_abs_mean", "grad_norm"), figures))
        if not all(math.isfinite(x) for x in figures):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            return out.priorities, {}
        self.optimizer.step()
        self.updates += 1
        if self.updates % self.config.learner.target_update_interval == 0:
            self.target.load_state_dict(self.online.state_dict())
        return out.priorities, metrics

    def weights(self) -> dict[str, np.ndarray]:
        return numpy_weights(self.online)

    def state_dict(self) -> dict:
        return {
            "online": self.online.state_dict(),
            "target": self.target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
            "limiter": {"inserts": self.limiter.inserts, "samples": self.limiter.samples},
        }

    def load_state_dict(self, state: dict) -> None:
        """Networks, optimizer and counters of a checkpoint. Call after the replay was
        restored (if it was): the sample-to-insert limit then goes on where it was instead of
        waiting for replay.min_size new transitions."""
        self.online.load_state_dict(state["online"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = state["updates"]
        if len(self.replay) > 0:
            self.limiter.inserts, self.limiter.samples = state["limiter"]["inserts"], state["limiter"]["samples"]

    @property
    def checkpoint_replay(self) -> StackedReplay | None:
        """The replay that checkpoints hold, or None when learner.checkpoint_replay is off."""
        return self.replay if self.config.learner.checkpoint_replay else None

    @property
    def memory_nbytes(self) -> int:
        return self.replay.nbytes

    def metrics(self) -> dict:
        return {
            "replay_size": len(self.replay),
            "replay_capacity": self.replay.capacity,
            **self.replay.priority_stats(),
            "replay_bytes_per_transition": round(self.replay.bytes_per_transition, 1),
            "replay_nbytes_mb": round(self.replay.nbytes / 2**20, 1),
            "inserted": self.limiter.inserts,
            "skipped_updates": self.skipped_updates,
            "dropped_transitions": self.dropped_transitions,
        }


# ---------------------------------------------------------------------------------------
# The actor core: epsilon-greedy over K environments, n-step chunks out.


class Actor:
    """K environments on the Ape-X ladder; ``act()`` is one step of all of them."""

    def __init__(self, config: Config, welcome: dict, seed: int, tick: Callable[[], None] = lambda: None) -> None:
        """``tick`` keeps the connection alive while the environments are made."""
        torch.set_num_threads(1)
        self.config = config
        self.epsilons = np.asarray(welcome["epsilons"])
        self.eval_mask = list(welcome["eval_envs"])
        self.envs = VectorEnv(config.env, len(self.epsilons), seed, tick)
        self.spec = self.envs.spec
        self.net = QNetwork(self.spec, config.model).eval()
        self.stacker = FrameStacker(self.num_envs, self.spec.stack, self.spec.frame_shape, self.spec.frame_dtype)
        self.chunkers = [
            NStepChunker(self.spec.stack, config.learner.n_step, config.learner.gamma, config.actor.chunk_transitions,
                         clip_rewards=config.is_atari and config.env.clip_rewards)
            for _ in range(self.num_envs)
        ]
        self.rng = np.random.default_rng(seed)
        self.steps = 0  # vector steps taken
        self.weights_version = -1
        self._pending: list[dict] = []
        for i, frame in enumerate(self.envs.reset()):
            self.stacker.reset(i, frame)
            self.chunkers[i].start(frame)

    @property
    def num_envs(self) -> int:
        return len(self.epsilons)

    def set_weights(self, msg: Message) -> None:
        load_numpy_weights(self.net, msg.arrays)
        self.weights_version = msg.fields["version"]

    def _q_values(self, obs: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.net(torch.from_numpy(obs)).numpy()

    def act(self) -> tuple[dict | None, list[list]]:
        """One step of every environment: (a batch to send, or None; finished episodes as
        [return, length, is_eval])."""
        q = self._q_values(self.stacker.obs)
        explore = self.rng.random(self.num_envs) < self.epsilons
        actions = np.where(explore, self.rng.integers(0, self.spec.num_actions, self.num_envs), q.argmax(axis=1))
        q_taken = q[np.arange(self.num_envs), actions]
        values = q.max(axis=1)
        for i, chunker in enumerate(self.chunkers):
            chunk = chunker.record_action(actions[i], q_taken[i], values[i])
            if chunk is not None:
                self._pending.append(chunk)
        frames, rewards, terminated, truncated, final = self.envs.step(actions)
        self.steps += 1
        truncated_only = [i for i in final if truncated[i] and not terminated[i]]
        final_values = {}
        if truncated_only:  # bootstrap values of the final observations
            obs = np.stack([self.stacker.peek(i, final[i]) for i in truncated_only])
            final_values = dict(zip(truncated_only, self._q_values(obs).max(axis=1)))
        episodes = []
        for i, chunker in enumerate(self.chunkers):
            chunker.record_step(rewards[i], final.get(i, frames[i]))
            if i in final:
                chunk = chunker.end_episode(bool(terminated[i]), float(final_values.get(i, 0.0)))
                if chunk is not None:
                    self._pending.append(chunk)
                episodes.append([chunker.episode_return, chunker.t, self.eval_mask[i]])
                chunker.start(frames[i])
                self.stacker.reset(i, frames[i])
            else:
                self.stacker.push(i, frames[i])
        if sum(len(c["action"]) for c in self._pending) < self.config.actor.chunk_transitions:
            return None, episodes
        batch, self._pending = merge_chunks(self._pending), []
        return batch, episodes

    def close(self) -> None:
        self.envs.close()
