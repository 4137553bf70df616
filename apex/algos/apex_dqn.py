"""Ape-X DQN (Horgan et al. 2018, "Distributed Prioritized Experience Replay").

Actor side: the epsilon ladder (Sec. 4.1: eps_i = eps ** (1 + alpha * i / (N - 1)), eps=0.4,
alpha=7), and ``NStepChunker``, which turns one environment's steps into n-step transitions
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
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from apex.config import ActorConfig, Config
from apex.envs import EnvSpec, FrameStacker, VectorEnv
from apex.models import QNetwork, load_numpy_weights, numpy_weights, to_device
from apex.protocol import Compressed, Message, materialize
from apex.replay import RateLimiter, StackedReplay


def epsilon_ladder(i: int, n: int, base: float = 0.4, alpha: float = 7.0) -> float:
    """Exploration rate of the i-th of n exploring environments."""
    if n <= 1:
        return base
    return base ** (1 + alpha * i / (n - 1))


def actor_epsilons(actor_index: int, num_envs: int, config: ActorConfig) -> tuple[list[float], list[bool]]:
    """Per-environment epsilons for one actor, and which of its environments evaluate.

    The ladder runs over the exploring environments of all ``num_actors`` actors,
    interleaved so that every actor covers the whole range; the last ``eval_envs`` of each
    actor play with ``eval_epsilon``. Evaluation episodes (return_mean_100) are those of
    every environment whose epsilon is at most ``eval_epsilon``: the set-aside ones and
    the near-greedy end of the ladder, never the exploring ones that would drag the
    mean down.
    """
    eval_envs = min(config.eval_envs, num_envs)
    exploring = num_envs - eval_envs
    total = max(1, exploring * config.num_actors)
    slot = actor_index % config.num_actors
    epsilons = [
        epsilon_ladder(j * config.num_actors + slot, total, config.eps_base, config.eps_alpha) for j in range(exploring)
    ]
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


def _expand(arrays: dict) -> dict:
    """Everything a lazy decode left compressed but the frames: the replay decompresses
    those straight into its ring."""
    return materialize(arrays, keep_compressed=("frames",))


def check_batch(arrays: dict, num_actions: int) -> None:
    """Algorithm-level checks on a received batch (the replay checks its structure and
    priorities). On the ingest hot path: a few whole-array reductions, no per-element work."""
    action = arrays.get("action")
    if action is not None and action.size and (action.min() < 0 or action.max() >= num_actions):
        raise ValueError(f"actions must be in [0, {num_actions}), got [{action.min()}, {action.max()}]")
    reward = arrays.get("reward")
    if reward is not None and not np.isfinite(reward).all():
        raise ValueError("reward holds non-finite values")
    discount = arrays.get("discount")
    if discount is not None and not ((discount >= 0).all() and (discount <= 1).all()):  # NaN fails too
        raise ValueError("discounts must be in [0, 1]")


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
        self.samples_per_update = config.learner.batch_size

    def welcome(self, actor_index: int, num_envs: int) -> dict:
        epsilons, eval_mask = actor_epsilons(actor_index, num_envs, self.config.actor)
        return {"epsilons": epsilons, "eval_envs": eval_mask}

    def wait_to_insert(self, timeout: float) -> bool:
        return self.limiter.wait_to_insert(timeout)

    def insert(self, arrays: dict) -> int:
        """Stores a received batch; frames may still be lz4-compressed (decode(lazy=True)):
        the replay decompresses them straight into its frame ring."""
        arrays = _expand(arrays)
        check_batch(arrays, self.spec.num_actions)
        self.replay.add(arrays)
        count = len(arrays["priority"])
        self.limiter.inserted(count)
        return count

    def insert_many(self, batches: list[dict]) -> list[Exception | None]:
        """Inserts several batches; returns each one's error, or None. Batches with plain
        frames that pass their own checks go in merged, as one insert (the checks and
        bookkeeping of a small CartPole batch cost more than its data); compressed frames go
        in one by one, straight into the frame ring. A bad batch never costs the others."""
        batches = list(batches)
        errors: list[Exception | None] = [None] * len(batches)
        mergeable = []
        for i, batch in enumerate(batches):
            try:
                batch = batches[i] = _expand(batch)
                if isinstance(batch.get("frames"), Compressed):
                    continue
                check_batch(batch, self.spec.num_actions)
                self.replay.check_chunk(batch)  # its indices stay within its own frames
                mergeable.append(i)
            except Exception as e:  # whatever is wrong with it, it is this batch's fault
                errors[i] = e
        merged = False
        if len(mergeable) > 1:
            try:
                self.insert(merge_chunks([batches[i] for i in mergeable]))
                merged = True
            except (ValueError, KeyError, TypeError):
                pass  # e.g. together too large for the replay: one by one below
        for i, batch in enumerate(batches):
            if errors[i] is None and (isinstance(batch.get("frames"), Compressed) or not merged):
                try:
                    self.insert(batch)
                except Exception as e:
                    errors[i] = e
        return errors

    def wait_to_step(self, timeout: float) -> bool:
        return self.limiter.wait_to_sample(self.config.learner.batch_size, timeout)

    def step(self) -> dict[str, float]:
        """One update: sample, move to the device, train, write the priorities back."""
        cfg = self.config
        batch, indices, weights = self.replay.sample(cfg.learner.batch_size, cfg.replay.beta)
        tensors = self.to_device({**batch, "weights": weights})
        priorities, metrics = self.train_on(tensors)
        self.replay.update_priorities(indices, priorities.cpu().numpy())
        self.limiter.sampled(cfg.learner.batch_size)
        return metrics

    def to_device(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {name: to_device(array, self.device) for name, array in batch.items()}

    def train_on(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The gradient step on a batch already on the device: (new priorities, metrics)."""
        out = dqn_loss(self.online, self.target, batch["obs"], batch["action"], batch["reward"],
                       batch["discount"], batch["next_obs"], batch["weights"])
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.online.parameters(), self.config.learner.grad_clip)
        self.optimizer.step()
        self.updates += 1
        if self.updates % self.config.learner.target_update_interval == 0:
            self.target.load_state_dict(self.online.state_dict())
        loss, q_mean, td = torch.stack([out.loss.detach(), out.q_mean, out.td_abs_mean]).cpu().tolist()
        return out.priorities, {"loss": loss, "q_mean": q_mean, "td_abs_mean": td}

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
        }


# ---------------------------------------------------------------------------------------
# The actor core: epsilon-greedy over K environments, n-step chunks out.


class Actor:
    """K environments on the Ape-X ladder; ``act()`` is one step of all of them."""

    def __init__(self, config: Config, welcome: dict, seed: int) -> None:
        torch.set_num_threads(1)
        self.config = config
        self.epsilons = np.asarray(welcome["epsilons"])
        self.eval_mask = list(welcome["eval_envs"])
        self.envs = VectorEnv(config.env, len(self.epsilons), seed)
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
