"""IMPALA (Espeholt et al. 2018, "IMPALA: Scalable Distributed Deep-RL with Importance
Weighted Actor-Learner Architectures").

V-trace (Sec. 4.1, eq. 1), for an unroll x_s .. x_{s+n} with behaviour policy mu and
target policy pi, rho_t = min(rho_bar, pi/mu), c_t = min(c_bar, pi/mu):

    v_s = V(x_s) + sum_{t=s}^{s+n-1} gamma^{t-s} (prod_{i=s}^{t-1} c_i) delta_t V,
    delta_t V = rho_t (r_t + gamma V(x_{t+1}) - V(x_t)),

computed backwards as v_s - V(x_s) = delta_s V + gamma_s c_s (v_{s+1} - V(x_{s+1})), with
per-step discounts gamma_t (0 where the episode terminated). The policy gradient uses
rho_s (r_s + gamma_s v_{s+1} - V(x_s)) (Sec. 4.2). Targets carry no gradient.

Truncated episodes (time limits) are bootstrapped by the actor: the last reward gets
gamma * V(final observation) from the actor's own value head, and the discount is cut.

Where defaults differ from the paper (see configs/): unrolls of 20 and batches of 32 as in
the paper, but a small MLP and Adam for CartPole, and batches of 8 for a CPU Pong learner.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from apex.config import Config
from apex.envs import EnvSpec, FrameStacker, VectorEnv
from apex.models import PolicyValueNetwork, action_log_prob, entropy, load_numpy_weights, log_probs, numpy_weights, to_device
from apex.errors import ApexError, ProtocolError
from apex.protocol import Compressed, Message
from apex.replay import UnrollQueue
from apex.schema import FLOAT32_MAX, ArrayRule, BatchSchema, Range, below, below_each, frame_rule


class VTraceReturns(NamedTuple):
    vs: torch.Tensor  # [T, B] value targets
    pg_advantages: torch.Tensor  # [T, B] rho-clipped policy-gradient advantages


@torch.no_grad()
def vtrace(
    behaviour_logp: torch.Tensor,  # [T, B] log mu(a_t | x_t)
    target_logp: torch.Tensor,  # [T, B] log pi(a_t | x_t)
    rewards: torch.Tensor,  # [T, B]
    discounts: torch.Tensor,  # [T, B] gamma_t, 0 at termination
    values: torch.Tensor,  # [T, B] V(x_t)
    bootstrap_value: torch.Tensor,  # [B] V(x_T)
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
) -> VTraceReturns:
    rhos = torch.exp(target_logp - behaviour_logp)
    clipped_rhos = torch.clamp(rhos, max=rho_bar)
    cs = torch.clamp(rhos, max=c_bar)
    next_values = torch.cat([values[1:], bootstrap_value[None]])  # [T, B]
    deltas = clipped_rhos * (rewards + discounts * next_values - values)
    acc = torch.zeros_like(bootstrap_value)
    vs_minus_v = torch.empty_like(values)
    for t in reversed(range(values.shape[0])):
        acc = deltas[t] + discounts[t] * cs[t] * acc
        vs_minus_v[t] = acc
    vs = vs_minus_v + values
    next_vs = torch.cat([vs[1:], bootstrap_value[None]])
    pg_advantages = clipped_rhos * (rewards + discounts * next_vs - values)
    return VTraceReturns(vs, pg_advantages)


class LossOutput(NamedTuple):
    loss: torch.Tensor
    pg_loss: torch.Tensor
    baseline_loss: torch.Tensor
    entropy: torch.Tensor


def impala_loss(
    logits: torch.Tensor,  # [T+1, B, A] (the last step only bootstraps)
    values: torch.Tensor,  # [T+1, B]
    actions: torch.Tensor,  # [T, B], or [T, B, components] for MultiDiscrete
    behaviour_logp: torch.Tensor,  # [T, B]
    rewards: torch.Tensor,  # [T, B]
    discounts: torch.Tensor,  # [T, B]
    rho_bar: float,
    c_bar: float,
    baseline_cost: float,
    entropy_cost: float,
    nvec: tuple[int, ...] | None = None,  # MultiDiscrete: a factorised policy over these components
) -> LossOutput:
    """The V-trace actor-critic loss. A MultiDiscrete policy is a product of independent
    categoricals: log pi(a | x) and the entropy are sums over the components."""
    log_policies = log_probs(logits[:-1], nvec)  # per component [T, B, n_i]
    target_logp = action_log_prob(log_policies, actions, nvec)  # [T, B]
    returns = vtrace(behaviour_logp, target_logp.detach(), rewards, discounts, values[:-1].detach(),
                     values[-1].detach(), rho_bar, c_bar)
    pg_loss = -(target_logp * returns.pg_advantages).mean()
    baseline_loss = 0.5 * ((returns.vs - values[:-1]) ** 2).mean()
    policy_entropy = entropy(log_policies).mean()
    loss = pg_loss + baseline_cost * baseline_loss - entropy_cost * policy_entropy
    return LossOutput(loss, pg_loss.detach(), baseline_loss.detach(), policy_entropy.detach())


MAX_RETURN_HORIZON = 1e4  # a truncation bootstrap is at most this many rewards' worth


def batch_schema(spec: EnvSpec, config: Config) -> BatchSchema:
    """What an IMPALA batch holds: frames, then per unroll where each of its T + 1 stacks
    starts in them, and per step the action, reward, discount and behaviour log-probability.
    A reward may hold, at a time limit, gamma * V(final observation) (the actor's bootstrap):
    its bound is max_abs_reward times 1 + gamma / (1 - gamma), at most MAX_RETURN_HORIZON."""
    T = config.impala.unroll_length
    gamma = config.learner.gamma
    horizon = 1 + (min(MAX_RETURN_HORIZON, gamma / (1 - gamma)) if gamma < 1 else MAX_RETURN_HORIZON)
    max_reward = config.transport.max_abs_reward * horizon
    steps = ("unrolls", T)
    # Discrete: one index per step; MultiDiscrete: one per component, each within its own n
    actions = below(spec.num_actions) if spec.action_nvec is None else below_each(spec.action_nvec)
    return BatchSchema((
        frame_rule(spec.frame_shape, spec.frame_dtype),
        ArrayRule("obs_frame", "iu", np.dtype(np.int32), ("unrolls", T + 1),
                  below("frames", 1 - spec.stack)),
        ArrayRule("action", "iu", np.dtype(np.int64), (*steps, *spec.action_shape), actions),
        ArrayRule("reward", "f", np.dtype(np.float32), steps, Range(-max_reward, max_reward)),
        ArrayRule("discount", "f", np.dtype(np.float32), steps, Range(0.0, 1.0)),
        # log-probabilities: finite and <= 0 (with float32 rounding)
        ArrayRule("behaviour_logp", "f", np.dtype(np.float32), steps, Range(-FLOAT32_MAX, 1e-6)),
    ))


def batch_limits(num_envs: int, spec: EnvSpec, config: Config) -> dict[str, int]:
    """An actor sends one unroll per environment, each T steps over at most stack * (T + 1)
    frames (every step may end an episode and start a new stack)."""
    T = config.impala.unroll_length
    return {"unrolls": num_envs, "frames": num_envs * spec.stack * (T + 1)}


# ---------------------------------------------------------------------------------------
# The learner core: a bounded queue of unrolls and V-trace updates.


class Learner:
    def __init__(self, config: Config, spec: EnvSpec, device: torch.device) -> None:
        torch.manual_seed(config.seed)
        self.config = config
        self.spec = spec
        self.device = device
        im = config.impala
        self.net = PolicyValueNetwork(spec, config.model).to(device)
        if im.optimizer == "adam":
            self.optimizer = torch.optim.Adam(self.net.parameters(), lr=config.learner.lr, eps=config.learner.adam_eps, fused=True)
        else:
            self.optimizer = torch.optim.RMSprop(self.net.parameters(), lr=config.learner.lr, alpha=im.rmsprop_alpha, eps=im.rmsprop_eps)
        self.queue = UnrollQueue(im.queue_size, block=im.queue_policy == "block")
        self.updates = 0
        self.skipped_updates = 0  # non-finite loss or gradient: not applied
        self.samples_per_update = im.batch_unrolls * im.unroll_length
        self._offsets = np.arange(spec.stack)
        self.schema = batch_schema(spec, config)

    def batch_limits(self, num_envs: int) -> dict[str, int]:
        return batch_limits(num_envs, self.spec, self.config)

    def env_steps(self, sizes: dict[str, int]) -> int:
        """Env steps a validated batch stands for: T per unroll."""
        return sizes["unrolls"] * self.config.impala.unroll_length

    def welcome(self, actor_index: int, num_envs: int) -> dict:
        if num_envs > self.config.impala.queue_size:
            # one batch holds an unroll per environment: it must fit the queue
            raise ApexError(f"num_envs {num_envs} exceeds impala.queue_size ({self.config.impala.queue_size}): "
                             "use fewer environments per actor or a larger queue")
        return {}

    def wait_to_insert(self, timeout: float) -> bool:
        return self.queue.wait_for_room(timeout)

    def insert(self, arrays: dict) -> int:
        """Queues the unrolls of a batch validated by ``self.schema``."""
        unrolls = len(arrays["obs_frame"])
        frames = arrays["frames"]
        frames = frames.decompress() if isinstance(frames, Compressed) else frames
        obs = frames[arrays["obs_frame"][..., None] + self._offsets]  # [K, T+1, stack, ...]
        self.queue.put([
            {"obs": obs[k], "action": arrays["action"][k], "reward": arrays["reward"][k],
             "discount": arrays["discount"][k], "behaviour_logp": arrays["behaviour_logp"][k]}
            for k in range(unrolls)
        ])
        return unrolls * self.config.impala.unroll_length

    def insert_many(self, batches: list[dict]) -> list[Exception | None]:
        """Queues validated batches; each one's error (a corrupt lz4 payload), or None."""
        errors: list[Exception | None] = []
        for batch in batches:
            try:
                self.insert(batch)
                errors.append(None)
            except ProtocolError as e:
                errors.append(e)
        return errors

    def wait_to_step(self, timeout: float) -> bool:
        return self.queue.wait_for(self.config.impala.batch_unrolls, timeout)

    def step(self) -> dict[str, float]:
        im = self.config.impala
        unrolls = self.queue.take(im.batch_unrolls)
        batch = {name: np.stack([u[name] for u in unrolls], axis=1) for name in unrolls[0]}  # time-major
        to = lambda name: to_device(batch[name], self.device)  # noqa: E731
        obs = to("obs")  # [T+1, B, stack, ...]
        steps, size = obs.shape[:2]
        logits, values = self.net(obs.reshape(steps * size, *obs.shape[2:]))
        out = impala_loss(
            logits.reshape(steps, size, -1), values.reshape(steps, size), to("action"), to("behaviour_logp"),
            to("reward"), to("discount"), im.rho_bar, im.c_bar, im.baseline_cost, im.entropy_cost, self.spec.action_nvec,
        )
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.config.learner.grad_clip)
        # One host synchronisation: the metrics, and whether the update is finite.
        figures = torch.stack([out.loss.detach(), out.pg_loss, out.baseline_loss, out.entropy, grad_norm]).cpu().tolist()
        if not all(math.isfinite(x) for x in figures):
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            return {}
        self.optimizer.step()
        self.updates += 1
        return dict(zip(("loss", "pg_loss", "baseline_loss", "entropy", "grad_norm"), figures))

    def weights(self) -> dict[str, np.ndarray]:
        return numpy_weights(self.net)

    def state_dict(self) -> dict:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = state["updates"]

    checkpoint_replay = None  # the unroll queue is short-lived: not worth saving

    @property
    def memory_nbytes(self) -> int:
        """Upper bound of the queued unrolls' observations: the queue takes a batch while it
        has room for one unroll, and a batch holds at most queue_size unrolls."""
        frame = int(np.prod(self.spec.frame_shape)) * self.spec.frame_dtype.itemsize
        per_unroll = (self.config.impala.unroll_length + 1) * self.spec.stack * frame
        return per_unroll * 2 * self.queue.capacity

    def metrics(self) -> dict:
        return {
            "queue_unrolls": len(self.queue),
            "queue_dropped_unrolls": self.queue.dropped,
            "inserted_unrolls": self.queue.inserted,
            "replay_size": len(self.queue),
            "replay_capacity": self.queue.capacity,
            "skipped_updates": self.skipped_updates,
        }


# ---------------------------------------------------------------------------------------
# The actor core: K environments sampling from the policy, unrolls of T steps out.


class Actor:
    def __init__(self, config: Config, welcome: dict, seed: int, tick: Callable[[], None] = lambda: None) -> None:
        """``tick`` keeps the connection alive while the environments are made."""
        torch.set_num_threads(1)
        self.config = config
        self.envs = VectorEnv(config.env, welcome["num_envs"], seed, tick)
        self.spec = self.envs.spec
        self.net = PolicyValueNetwork(self.spec, config.model).eval()
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
        load_numpy_weights(self.net, msg.arrays)
        self.weights_version = msg.fields["version"]

    def _forward(self, obs: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """(log-policy of each action component [K, n_i], values [K])."""
        with torch.no_grad():
            logits, values = self.net(torch.from_numpy(obs))
            return [lp.numpy() for lp in log_probs(logits, self.spec.action_nvec)], values.numpy()

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
        train_rewards = np.sign(rewards) if self.clip_rewards else rewards
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
