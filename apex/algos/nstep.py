"""Ape-X's n-step transitions (Horgan et al. 2018, Sec. 3, Alg. 1), which every Ape-X actor
sends (Ape-X DQN's and Ape-X DDPG's): ``NStepChunker`` turns one environment's steps into
transitions with initial priorities from the actor's own values,

    G_t = sum_{k<n} gamma^k r_{t+k},   target_t = G_t + gamma^n V(s_{t+n})
    priority_t = |target_t - Q(s_t, a_t)|

bootstrapping on truncation (time limits) and not on termination (V: max_a Q for DQN,
Q(s, mu(s)) for DDPG), in chunks whose frames are stored once; ``merge_chunks`` makes one
batch of several.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from apex.algos.chunks import FrameTrack, frame_offsets

# An n-step chunk, or a batch of merged ones: frames and per-transition arrays by name.
Chunk = dict[str, np.ndarray]


class NStepChunker:
    """Builds one environment's n-step transitions and hands them out in chunks.

    Frames are stored once (``apex.algos.chunks.FrameTrack``): a chunk carries the frames its
    transitions need plus, per transition, where its observation stack and its bootstrap
    stack start.

    Call order per step: ``record_action`` (when acting on s_t, with Q(s_t, a_t) and
    max_a Q(s_t, a)), then ``record_step`` (reward r_t and the next frame), then, if the
    episode ended, ``end_episode``.
    """

    def __init__(
        self,
        stack: int,
        n_step: int,
        gamma: float,
        chunk_transitions: int,
        clip_rewards: bool,
        reward_scale: float = 1.0,
        mask_actions: int | None = None,
        action_dtype: type[np.generic] = np.int64,
    ) -> None:
        """``mask_actions``: each step's legal actions (of that many) are recorded, and a
        chunk carries those of each transition's bootstrap observation (``next_mask``).
        ``action_dtype``: np.int64 for an index, np.float32 for a continuous action (a vector:
        Ape-X DDPG's)."""
        self.stack, self.n, self.gamma = stack, n_step, gamma
        self.action_dtype = action_dtype
        self.mask_actions = mask_actions
        self.chunk_transitions = chunk_transitions
        self.clip_rewards = clip_rewards
        self.reward_scale = reward_scale
        self._powers = gamma ** np.arange(n_step + 1)

    def start(self, frame: np.ndarray) -> None:
        """Begins an episode whose first frame is ``frame``."""
        self.track = FrameTrack(self.stack)  # from the stack of step c on
        self.track.begin(frame)
        self.actions: list[Any] = []
        self.q_taken: list[float] = []
        self.values: list[float] = []  # max_a Q(s_t, a) for t = c, c+1, ...
        self.rewards: list[float] = []
        self.masks: list[np.ndarray] = []  # the legal actions at s_t (with mask_actions)
        self.c = 0  # step index of the chunk's first transition
        self.t = 0  # current step index
        self.episode_return = 0.0

    def record_action(self, action: Any, q_taken: float, value: float, mask: np.ndarray | None = None) -> Chunk | None:
        """Acting on s_t (with its legal actions ``mask``, where they are recorded); returns
        a chunk when enough transitions have their bootstrap value. ``value``: the state's
        bootstrap value, max_a Q(s_t, a) (DDPG: Q(s_t, mu(s_t)))."""
        self.actions.append(action)
        self.q_taken.append(float(q_taken))
        self.values.append(float(value))
        if self.mask_actions is not None:
            self.masks.append(np.ones(self.mask_actions, np.uint8) if mask is None else mask.astype(np.uint8))
        complete = self.t - self.n + 1 - self.c  # transitions t' with t' + n <= t
        if complete >= self.chunk_transitions:
            return self._emit(self.chunk_transitions, end=None, terminated=False, final_value=0.0)
        return None

    def record_step(self, reward: float, next_frame: np.ndarray) -> None:
        self.episode_return += reward
        self.rewards.append((float(np.sign(reward)) if self.clip_rewards else float(reward)) * self.reward_scale)
        self.track.push(next_frame)
        self.t += 1

    def end_episode(self, terminated: bool, final_value: float) -> Chunk | None:
        """The episode ended at step t (``final_value``: max_a Q of the final observation,
        used only on truncation). Returns a chunk of every remaining transition."""
        count = self.t - self.c
        return self._emit(count, end=self.t, terminated=terminated, final_value=final_value) if count else None

    def _emit(self, count: int, *, end: int | None, terminated: bool, final_value: float) -> Chunk:
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
        frames, starts = self.track.take(int(horizon.max()) - c)
        chunk = {
            "frames": np.stack(frames),
            "obs_frame": starts[steps - c],
            "next_obs_frame": starts[horizon - c],
            "action": np.asarray(self.actions[:count], self.action_dtype),
            "reward": returns.astype(np.float32),
            "discount": discount.astype(np.float32),
            "priority": priority.astype(np.float32),
        }
        if self.mask_actions is not None:  # the final observation's is unknown: all legal (discount 0 or its value)
            final = [np.ones(self.mask_actions, np.uint8)] if end is not None else []
            chunk["next_mask"] = np.stack(self.masks + final)[horizon - c]
            del self.masks[:count]
        self.track.drop(count)
        del self.actions[:count], self.q_taken[:count], self.values[:count], self.rewards[:count]
        self.c += count
        return chunk


def merge_chunks(chunks: list[Chunk]) -> Chunk:
    """Concatenates chunks into one batch, offsetting frame indices."""
    if len(chunks) == 1:
        return chunks[0]
    offsets = frame_offsets([c["frames"] for c in chunks])
    indices = ("obs_frame", "next_obs_frame")
    merged = {name: np.concatenate([c[name] for c in chunks]) for name in chunks[0] if name not in indices}
    for name in indices:
        merged[name] = np.concatenate([c[name] + off for c, off in zip(chunks, offsets)]).astype(np.int32, copy=False)
    return merged
