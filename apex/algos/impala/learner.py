"""IMPALA (Espeholt et al. 2018, "IMPALA: Scalable Distributed Deep-RL with Importance
Weighted Actor-Learner Architectures").

V-trace and the loss are in ``apex.algos.impala.loss``.

Truncated episodes (time limits) are bootstrapped by the actor: the last reward gets
gamma * V(final observation) from the actor's own value head, and the discount is cut.

Where defaults differ from the paper (see configs/): unrolls of 20 and batches of 32 as in
the paper, but a small MLP and Adam for CartPole, and batches of 8 for a CPU Pong learner.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from apex.algos.impala.loss import impala_loss
from apex.algos.masks import MASKED_LOGIT
from apex.config import Config
from apex.core import Policy
from apex.envs.make import EnvSpec
from apex.errors import ApexError, ProtocolError
from apex.nets.gaussian import LOG_2PI, LOG_STD_MIN
from apex.nets.torch_nets import PolicyValueNetwork, State, check_fits, numpy_weights
from apex.replay import UnrollQueue, UnrollRing
from apex.replay.unrolls import Unroll
from apex.training import optim
from apex.training.distributed import NO_BATCH, GradientAllReduce, step_without_batch
from apex.training.pipeline import DeviceStager, Pending, Staged, collect, fetch
from apex.wire.compression import Compressed
from apex.wire.schema import (
    FINITE,
    FLOAT32_MAX,
    MAX_ABS_CONTINUOUS_ACTION,
    ArrayRule,
    BatchSchema,
    Range,
    below,
    below_each,
    frame_rule,
    mask_rule,
)

MAX_RETURN_HORIZON = 1e4  # a truncation bootstrap is at most this many rewards' worth


def batch_schema(spec: EnvSpec, config: Config) -> BatchSchema:
    """What an IMPALA batch holds: frames, then per unroll where each of its T + 1 stacks
    starts in them, and per step the action, reward, discount and behaviour log-probability.
    A reward may hold, at a time limit, gamma * V(final observation) (the actor's bootstrap):
    its bound is max_abs_reward times 1 + gamma / (1 - gamma), at most MAX_RETURN_HORIZON.

    Continuous actions are the Gaussian's samples (float32) and their log-densities, which
    may be positive: at most D (-LOG_STD_MIN - log(2 pi) / 2). A recurrent model's unrolls
    also carry the core's state at their first observation (``core_h`` in [-1, 1], ``core_c``)
    and ``done`` (step t ended its episode: the core starts afresh at observation t + 1)."""
    T = config.impala.unroll_length
    gamma = config.impala.gamma
    horizon = 1 + (min(MAX_RETURN_HORIZON, gamma / (1 - gamma)) if gamma < 1 else MAX_RETURN_HORIZON)
    max_reward = config.transport.max_abs_reward * horizon
    steps = ("unrolls", T)
    if spec.continuous:  # D values a step
        action = ArrayRule(
            "action",
            "f",
            np.dtype(np.float32),
            (*steps, *spec.action_shape),
            Range(-MAX_ABS_CONTINUOUS_ACTION, MAX_ABS_CONTINUOUS_ACTION),
        )
        max_logp = spec.num_actions * (-LOG_STD_MIN - 0.5 * LOG_2PI) + 1e-3
    else:  # Discrete: one index per step; MultiDiscrete: one per component, each within its own n
        allowed = below(spec.num_actions) if spec.action_nvec is None else below_each(spec.action_nvec)
        action = ArrayRule("action", "iu", np.dtype(np.int64), (*steps, *spec.action_shape), allowed)
        max_logp = 1e-6  # probabilities: log <= 0 (with float32 rounding)
    rules = [
        frame_rule(spec.frame_shape, spec.frame_dtype, spec.obs_bound(config.transport.max_abs_obs)),
        ArrayRule("obs_frame", "iu", np.dtype(np.int32), ("unrolls", T + 1), below("frames", 1 - spec.stack)),
        action,
        ArrayRule("reward", "f", np.dtype(np.float32), steps, Range(-max_reward, max_reward)),
        ArrayRule("discount", "f", np.dtype(np.float32), steps, Range(0.0, 1.0)),
        ArrayRule("behaviour_logp", "f", np.dtype(np.float32), steps, Range(-FLOAT32_MAX, max_logp)),
    ]
    if config.model.recurrent == "lstm":
        L = config.model.lstm_size
        rules += [
            ArrayRule("core_h", "f", np.dtype(np.float32), ("unrolls", L), Range(-1.0, 1.0)),
            ArrayRule("core_c", "f", np.dtype(np.float32), ("unrolls", L), FINITE),
            ArrayRule("done", "iu", np.dtype(np.uint8), steps, Range(0, 1)),
        ]
    if spec.action_masked:  # each step's legal actions: the policy's logits of the others are masked
        rules.append(mask_rule("mask", (*steps, spec.num_actions)))
    return BatchSchema(tuple(rules))


def batch_limits(num_envs: int, spec: EnvSpec, config: Config) -> dict[str, int]:
    """An actor sends one unroll per environment, each T steps over at most stack * (T + 1)
    frames (every step may end an episode and start a new stack)."""
    T = config.impala.unroll_length
    return {"unrolls": num_envs, "frames": num_envs * spec.stack * (T + 1)}


# ---------------------------------------------------------------------------------------
# The learner core: a bounded queue of unrolls and V-trace updates.


class ImpalaLearner:
    def __init__(self, config: Config, spec: EnvSpec, device: torch.device) -> None:
        torch.manual_seed(config.seed)
        self.config = config
        self.spec = spec
        self.device = device
        im = config.impala
        self.net = PolicyValueNetwork(spec, config.model).to(device)
        adam = im.optimizer == "adam"
        self.optimizer = optim.make(
            im.optimizer,
            self.net.parameters(),
            config.impala.lr,
            config.impala.adam_eps if adam else im.rmsprop_eps,
            alpha=im.rmsprop_alpha,
            fused=adam,
        )
        self.queue: UnrollQueue | UnrollRing = UnrollQueue(im.queue_size, block=im.queue_policy == "block")
        self.stager = DeviceStager(device)
        self.prefetch_batches = 1  # the unrolls' age is the policy lag: none staged further ahead
        self.all_reduce: GradientAllReduce | None = (
            None  # set by a data-parallel group (apex.training.distributed): averages gradients over ranks
        )
        self.updates = 0
        self.skipped_updates = 0  # non-finite loss or gradient: not applied
        self.samples_per_update = im.batch_unrolls * im.unroll_length
        self.recurrent = self.net.recurrent
        self._per_step = (
            ("action", "reward", "discount", "behaviour_logp")
            + (("done",) if self.recurrent else ())
            + (("mask",) if spec.action_masked else ())
        )
        self._per_unroll = self._per_step + (("core_h", "core_c") if self.recurrent else ())  # what insert keeps
        self._offsets = np.arange(spec.stack)
        self.schema = batch_schema(spec, config)
        self.normalize_advantages = spec.resolve_auto(im.normalize_advantages)

    def batch_limits(self, num_envs: int) -> dict[str, int]:
        return batch_limits(num_envs, self.spec, self.config)

    def env_steps(self, sizes: dict[str, int]) -> int:
        """Env steps a validated batch stands for: T per unroll."""
        return sizes["unrolls"] * self.config.impala.unroll_length

    def actor_setup(self, actor_index: int, num_envs: int) -> dict[str, Any]:
        if num_envs > self.config.impala.queue_size:
            # one batch holds an unroll per environment: it must fit the queue
            raise ApexError(
                f"num_envs {num_envs} exceeds impala.queue_size ({self.config.impala.queue_size}): "
                "use fewer environments per actor or a larger queue"
            )
        return {}

    def wait_to_insert(self, timeout: float) -> bool:
        return self.queue.wait_for_room(timeout)

    def insert(self, arrays: dict[str, Any]) -> int:
        """Queues the unrolls of a batch validated by ``self.schema``, each with a view of the
        frames its stacks use (one decoded array per batch, nothing copied here; ``step``
        gathers the stacks): for Atari about T + stack frames an unroll instead of (T + 1) * stack."""
        unrolls = len(arrays["obs_frame"])
        frames = arrays["frames"]
        frames = frames.decompress() if isinstance(frames, Compressed) else frames
        obs_frame = arrays["obs_frame"]
        first, end = obs_frame.min(axis=1), obs_frame.max(axis=1) + self.spec.stack
        self.queue.put(
            [
                {
                    "frames": frames[first[k] : end[k]],
                    "obs_frame": obs_frame[k] - first[k],
                    **{name: arrays[name][k] for name in self._per_unroll},
                }
                for k in range(unrolls)
            ]
        )
        return unrolls * self.config.impala.unroll_length

    def _stacks(self, unrolls: list[Unroll]) -> np.ndarray:
        """The observation stacks of a batch of unrolls, time-major: [T+1, B, stack, ...]."""
        frames = np.concatenate([u["frames"] for u in unrolls])
        starts = np.cumsum([0] + [len(u["frames"]) for u in unrolls[:-1]])
        ids = np.stack([u["obs_frame"] for u in unrolls], axis=1) + starts  # [T+1, B]
        stacks: np.ndarray = np.take(frames, ids[..., None] + self._offsets, axis=0)
        return stacks

    def insert_many(self, batches: list[dict[str, Any]]) -> list[ProtocolError | None]:
        """Queues validated batches; each one's error (a corrupt lz4 payload), or None."""
        errors: list[ProtocolError | None] = []
        for batch in batches:
            try:
                self.insert(batch)
                errors.append(None)
            except ProtocolError as e:
                errors.append(e)
        return errors

    def prepare(self, timeout: float, most: int = 1) -> list[Staged]:
        """The prefetch stage: once ``batch_unrolls`` unrolls are queued (within ``timeout``),
        one batch of them staged on the device (``most`` is ignored: see
        ``prefetch_batches``); else []."""
        if not self.queue.wait_for(self.config.impala.batch_unrolls, timeout):
            return []
        return [self.sample()]

    def sample(self) -> Staged:
        """The oldest ``batch_unrolls`` queued unrolls (fewer if fewer are queued), their
        time-major arrays and observation stacks staged on the device."""
        start = time.perf_counter()
        unrolls = self.queue.take(self.config.impala.batch_unrolls)
        batch = {
            name: np.stack([u[name] for u in unrolls], axis=1)  # time-major
            for name in self._per_step
        }
        batch["obs"] = self._stacks(unrolls)  # [T+1, B, stack, ...]
        if self.recurrent:  # the core's state at each unroll's first observation: [B, L]
            batch["core_h"] = np.stack([u["core_h"] for u in unrolls])
            batch["core_c"] = np.stack([u["core_c"] for u in unrolls])
        return self.stager.stage(batch, None, time.perf_counter() - start)

    def train(self, staged: Staged) -> Pending:
        """Enqueues the V-trace update on a staged batch; its results come back with ``finish``."""
        im = self.config.impala
        staged.wait()
        batch = staged.tensors
        state = (batch["core_h"], batch["core_c"]) if self.recurrent else None
        params, values = self.net.unroll(batch["obs"], batch.get("done"), state)
        if "mask" in batch:  # illegal actions have probability 0 (the bootstrap step's are not used)
            params = torch.cat([params[:-1].masked_fill(batch["mask"] == 0, MASKED_LOGIT), params[-1:]])
        out = impala_loss(
            params,
            values,
            batch["action"],
            batch["behaviour_logp"],
            batch["reward"],
            batch["discount"],
            im.rho_bar,
            im.c_bar,
            im.baseline_cost,
            im.entropy_cost,
            self.spec,
            self.normalize_advantages,
        )
        results = optim.guarded_step(
            self.optimizer,
            out.loss,
            self.net.parameters(),
            self.config.impala.grad_clip,
            [out.loss, out.pg_loss, out.baseline_loss, out.entropy],
            self.all_reduce,
        )
        return fetch([results])

    def train_without_batch(self) -> Pending:
        """A learner group's step on this rank without a batch (``apex.training.distributed``): the
        other ranks' gradient applied."""
        if self.all_reduce is None:
            raise RuntimeError("a step without a batch is a learner group's: all_reduce is not set")
        results = step_without_batch(
            self.optimizer, self.net.parameters(), self.config.impala.grad_clip, 4, self.all_reduce
        )
        return fetch([results], NO_BATCH)

    def finish(self, pending: list[Pending]) -> list[dict[str, float]]:
        """The trained steps' metrics, in order: {} (counted) for one skipped as non-finite,
        {} for a group's step this rank took without a batch."""
        metrics: list[dict[str, float]] = []
        for step, (skipped, *figures) in zip(pending, collect(pending).tolist()):
            if skipped:
                self.skipped_updates += 1
                metrics.append({})
                continue
            self.updates += 1
            own = step.context is not NO_BATCH
            metrics.append(
                dict(zip(("loss", "pg_loss", "baseline_loss", "entropy", "grad_norm"), figures)) if own else {}
            )
        return metrics

    def step(self) -> dict[str, float]:
        """One whole update in a row (tests, benchmarks); call with unrolls queued."""
        return self.finish([self.train(self.sample())])[0]

    def weights(self) -> dict[str, np.ndarray]:
        return numpy_weights(self.net)

    def state_dict(self) -> dict[str, Any]:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.net.load_state_dict(state["net"])
        optim.load_state(self.optimizer, state["optimizer"])
        self.updates = state["updates"]

    def check_state(self, state: dict[str, Any]) -> None:
        """What load_state_dict checks before it changes anything (as Ape-X's)."""
        check_fits(self.net, state["net"], "net")
        optim.check_state(self.optimizer, state["optimizer"])

    checkpoint_replay = None  # the unroll queue is short-lived: not worth saving

    @property
    def memory_nbytes(self) -> int:
        """Upper bound of the queued unrolls' observations: the queue takes a batch while it
        has room for one unroll, and a batch holds at most queue_size unrolls."""
        frame = int(np.prod(self.spec.frame_shape)) * self.spec.frame_dtype.itemsize
        per_unroll = (self.config.impala.unroll_length + 1) * self.spec.stack * frame
        return per_unroll * 2 * self.queue.capacity

    def metrics(self) -> dict[str, Any]:
        return {
            "replay_bytes_per_transition": round(self.queue.bytes_per_transition(self.config.impala.unroll_length), 1),
            "queue_unrolls": len(self.queue),
            "queue_dropped_unrolls": self.queue.dropped,
            "inserted_unrolls": self.queue.inserted,
            "replay_size": len(self.queue),
            "replay_capacity": self.queue.capacity,
            "skipped_updates": self.skipped_updates,
        }


def _greedy(
    net: PolicyValueNetwork, obs: torch.Tensor, state: State | None = None, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, State | None]:
    params, _, state = net(obs, state)
    return net.greedy(params if mask is None else params.masked_fill(~mask, MASKED_LOGIT)), state


# `apex eval` and apex.load_policy take the policy's most likely action.
POLICY = Policy("net", "the policy network", PolicyValueNetwork, _greedy)
