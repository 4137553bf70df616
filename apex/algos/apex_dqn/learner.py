"""Ape-X DQN (Horgan et al. 2018, "Distributed Prioritized Experience Replay"): the learner
core. The actor core (the epsilon ladder, n-step chunks with initial priorities) is
``apex.algos.apex_dqn.actor``.

Its loss is ``apex.algos.apex_dqn.loss.dqn_loss``: double DQN with a target network.

Where defaults differ from the paper (see configs/): a smaller replay and batch, a much
shorter target-network period and a higher learning rate for CartPole on two cores; the
actors' envs also include ``apex_dqn.eval_envs`` near-greedy ones that report
return_mean_100.
"""

from __future__ import annotations

import copy
import itertools
import time
from typing import Any

import numpy as np
import torch

from apex.algos.apex_dqn.actor import merge_chunks
from apex.algos.apex_dqn.exploration import actor_epsilons
from apex.algos.apex_dqn.loss import dqn_loss
from apex.config import Config
from apex.core import Policy
from apex.envs.make import EnvSpec
from apex.envs.spaces import check_algo_actions
from apex.errors import ProtocolError
from apex.nets.torch_nets import QNetwork, check_fits, numpy_weights
from apex.replay import RateLimiter, StackedReplay
from apex.training import optim
from apex.training.distributed import NO_BATCH, GradientAllReduce, step_without_batch
from apex.training.pipeline import DeviceStager, Pending, Staged, collect, fetch
from apex.wire.compression import Compressed
from apex.wire.schema import FLOAT32_MAX, ArrayRule, BatchSchema, Range, below, frame_rule, mask_rule


def batch_schema(spec: EnvSpec, config: Config) -> BatchSchema:
    """What an Ape-X batch holds: frames, then per transition where its observation and
    bootstrap stacks start in them, its action, n-step return, discount and priority."""
    stack_starts = below("frames", 1 - spec.stack)
    max_return = config.transport.max_abs_reward * config.apex_dqn.n_step
    transitions = ("transitions",)
    return BatchSchema(
        (
            frame_rule(spec.frame_shape, spec.frame_dtype, spec.obs_bound(config.transport.max_abs_obs)),
            ArrayRule("obs_frame", "iu", np.dtype(np.int32), transitions, stack_starts),
            ArrayRule("next_obs_frame", "iu", np.dtype(np.int32), transitions, stack_starts),
            ArrayRule("action", "iu", np.dtype(np.int64), transitions, below(spec.num_actions)),
            ArrayRule("reward", "f", np.dtype(np.float32), transitions, Range(-max_return, max_return)),
            ArrayRule("discount", "f", np.dtype(np.float32), transitions, Range(0.0, 1.0)),
            # float32 and finite: however many there are, their sum in the tree stays finite
            ArrayRule("priority", "f", np.dtype(np.float32), transitions, Range(0.0, FLOAT32_MAX)),
            # the legal actions at each transition's bootstrap observation
            *((mask_rule("next_mask", (*transitions, spec.num_actions)),) if spec.action_masked else ()),
        )
    )


# How far over the learner's largest |td| an actor's initial priority may go (see ApexDqnLearner).
PRIORITY_SLACK = 2.0


def batch_limits(num_envs: int, spec: EnvSpec, config: Config) -> dict[str, int]:
    """The most transitions and frames one batch of an actor with ``num_envs`` environments
    can hold: it sends once it holds chunk_transitions (C) or more, and one step adds at
    most two chunks per environment (a full one and an episode's end, each up to C + n
    transitions, with the n + stack frames around them)."""
    chunk, n = config.apex_dqn.chunk_transitions, config.apex_dqn.n_step
    chunks = chunk + 2 * num_envs
    transitions = chunk + num_envs * (2 * chunk + n)
    return {
        "transitions": min(transitions, config.apex_dqn.replay.capacity),
        "frames": min(transitions + chunks * (n + spec.stack), config.apex_dqn.frame_capacity),
    }


# ---------------------------------------------------------------------------------------
# The learner core: owns the networks, the replay and its rate limiter.


class ApexDqnLearner:
    """Double dueling DQN over a prioritized replay of frame-deduplicated n-step transitions.

    The generic learner process calls ``insert`` from its ingest thread, ``prepare`` from its
    prefetch thread and ``train`` / ``finish`` from its main loop (``apex.training.pipeline``);
    ``wait_to_insert`` and ``prepare`` apply the sample-to-insert limit.
    """

    def __init__(self, config: Config, spec: EnvSpec, device: torch.device) -> None:
        torch.manual_seed(config.seed)
        if spec.action_nvec is not None or spec.continuous:  # env_spec(..., algo) says so first, in the parent
            check_algo_actions(
                "Box" if spec.continuous else "MultiDiscrete",
                spec.action_nvec or (spec.num_actions,),
                "apex_dqn",
                config.env.id,
            )
        self.config = config
        self.spec = spec
        self.device = device
        self.online = QNetwork(spec, config.model).to(device)
        self.target = copy.deepcopy(self.online).requires_grad_(False)
        # fused: one kernel for all parameters (measured: 2.3 -> 2.0 ms a CartPole update on CPU)
        self.optimizer = optim.make(
            "adam", self.online.parameters(), config.apex_dqn.lr, config.apex_dqn.adam_eps, fused=True
        )
        self.replay = StackedReplay(
            spec.frame_shape,
            spec.frame_dtype,
            spec.stack,
            config.apex_dqn.replay.capacity,
            config.apex_dqn.frame_capacity,
            alpha=config.apex_dqn.replay.alpha,
            eps=config.apex_dqn.replay.eps,
            seed=config.seed,
            extra_fields={"next_mask": ((spec.num_actions,), np.uint8)} if spec.action_masked else None,
        )
        replay = config.apex_dqn.replay
        self.limiter = RateLimiter(replay.samples_per_insert, replay.min_size, replay.rate_slack)
        self.stager = DeviceStager(device)
        self.prefetch_batches = config.apex_dqn.prefetch_batches or prefetch_depth(spec, config.apex_dqn.batch_size)
        self.all_reduce: GradientAllReduce | None = (
            None  # set by a data-parallel group (apex.training.distributed): averages gradients over ranks
        )
        self.updates = 0  # applied (known once finished)
        self.steps = 0  # trained, applied or skipped: the target network's clock
        self.skipped_updates = 0  # non-finite loss or gradient: not applied
        self.dropped_transitions = 0  # whose loss was not finite: never sampled again
        # An actor's initial priorities are held to PRIORITY_SLACK times the largest |td| this
        # learner has computed (1 before its first update): one admitted peer sending
        # FLOAT32_MAX priorities otherwise took almost every sample, with importance weights
        # near 0 (the loss read 0.0 for every update while the counts looked healthy).
        self.largest_td = 0.0
        self.capped_priorities = 0  # initial priorities an actor sent above that cap
        self.samples_per_update = config.apex_dqn.batch_size
        self.schema = batch_schema(spec, config)

    def batch_limits(self, num_envs: int) -> dict[str, int]:
        return batch_limits(num_envs, self.spec, self.config)

    @staticmethod
    def env_steps(sizes: dict[str, int]) -> int:
        """Env steps a validated batch stands for: one transition per step."""
        return sizes["transitions"]

    def actor_setup(self, actor_index: int, num_envs: int) -> dict[str, Any]:
        epsilons, eval_mask = actor_epsilons(actor_index, num_envs, self.config.apex_dqn)
        return {"epsilons": epsilons, "eval_envs": eval_mask}

    def wait_to_insert(self, timeout: float) -> bool:
        return self.limiter.wait_to_insert(timeout)

    @property
    def priority_cap(self) -> float:
        """The most an actor's initial priority may be: PRIORITY_SLACK times the largest |td|
        this learner computed (an actor's network lags the learner's, so its honest estimates
        may run over), and at least 1."""
        return max(1.0, PRIORITY_SLACK * self.largest_td)

    def insert(self, arrays: dict[str, Any]) -> int:
        """Stores a batch validated by ``self.schema``; frames may still be lz4-compressed
        (decode(lazy=True)): the replay decompresses them straight into its frame ring.
        Initial priorities above ``priority_cap`` are lowered to it (counted)."""
        priority, cap = arrays["priority"], self.priority_cap
        if priority.max(initial=0.0) > cap:
            self.capped_priorities += int(np.count_nonzero(priority > cap))
            arrays = {**arrays, "priority": np.minimum(priority, np.float32(cap))}
        self.replay.add(arrays)
        count = len(priority)
        self.limiter.inserted(count)
        return count

    def insert_many(self, batches: list[dict[str, Any]]) -> list[ProtocolError | None]:
        """Inserts several validated batches; returns each one's error (a ProtocolError for
        a corrupt lz4 payload), or None. Batches with plain frames go in merged, as one
        insert (the bookkeeping of a small CartPole batch costs more than its data), if
        together they fit the replay; compressed frames go in one by one, straight into
        the frame ring."""
        errors: list[ProtocolError | None] = [None] * len(batches)
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

    def prepare(self, timeout: float, most: int = 1) -> list[Staged]:
        """The prefetch stage: once the sample-to-insert limit allows a batch (within
        ``timeout``), as many batches as it allows up to ``most``, drawn together and staged
        on the device; else []."""
        size = self.config.apex_dqn.batch_size
        if not self.limiter.wait_to_sample(size, timeout):
            return []
        if not self.replay.sampleable:  # every transition dropped as poison: wait for more
            time.sleep(timeout)
            return []
        count = 1
        while count < most and self.limiter.can_sample((count + 1) * size):
            count += 1
        return self.sample(count)

    def sample(self, count: int = 1) -> list[Staged]:
        """``count`` prioritized batches drawn together, staged on the device (counted by the
        rate limiter, not held to it)."""
        cfg = self.config
        size = cfg.apex_dqn.batch_size
        start = time.perf_counter()
        batch, indices, weights = self.replay.sample(size, cfg.apex_dqn.replay.beta, batches=count)
        self.limiter.sampled(count * size)
        batch["weights"] = weights
        seconds = (time.perf_counter() - start) / count
        return self.stager.stage_batches(batch, np.split(indices, count), seconds)

    def train(self, staged: Staged) -> Pending:
        """Enqueues the update on a staged batch; its results come back with ``finish``.
        A non-finite loss, gradient or priority skips it (on the device where it can: see
        ``optim.guarded_step``)."""
        staged.wait()
        batch = staged.tensors
        out = dqn_loss(
            self.online,
            self.target,
            batch["obs"],
            batch["action"],
            batch["reward"],
            batch["discount"],
            batch["next_obs"],
            batch["weights"],
            batch.get("next_mask"),
        )
        # The priorities' sum: finite only if every priority is.
        results = optim.guarded_step(
            self.optimizer,
            out.loss,
            self.online.parameters(),
            self.config.apex_dqn.grad_clip,
            [out.loss, out.q_mean, out.td_abs_mean, out.priorities.sum()],
            self.all_reduce,
        )
        self._stepped()
        return fetch([results, out.priorities], staged.context)

    def train_without_batch(self) -> Pending:
        """A learner group's step on this rank without a batch (``apex.training.distributed``): the
        other ranks' gradient applied; finished with no priorities to write back."""
        if self.all_reduce is None:
            raise RuntimeError("a step without a batch is a learner group's: all_reduce is not set")
        results = step_without_batch(
            self.optimizer, self.online.parameters(), self.config.apex_dqn.grad_clip, 4, self.all_reduce
        )
        self._stepped()
        return fetch([results, results.new_zeros(self.config.apex_dqn.batch_size)], NO_BATCH)

    def _stepped(self) -> None:
        self.steps += 1
        if self.steps % self.config.apex_dqn.target_update_interval == 0:
            self.target.load_state_dict(self.online.state_dict())

    def finish(self, pending: list[Pending]) -> list[dict[str, float]]:
        """Reads the results of trained steps, in order: writes their new priorities back
        (together: one update of the tree) and returns each one's metrics; a skipped step is
        counted, the transitions it trained on are dropped (never sampled again), and its
        metrics are {}."""
        values = collect(
            pending
        )  # a row a step: skipped, loss, q_mean, td_abs_mean, priorities' sum, grad_norm, priorities
        skipped = values[:, 0] != 0
        sampled = np.array([step.context is not NO_BATCH for step in pending])
        # A step whose loss was not finite trained on a batch that poisons updates, and its
        # priorities need not say which transition did (a finite 1e30 observation may give a
        # finite, huge priority and be sampled first ever after): none of it is sampled again.
        for step in itertools.compress(pending, skipped & sampled):
            self.dropped_transitions += self.replay.drop(np.unique(step.context))
        trained = ~skipped
        self.skipped_updates += int(np.count_nonzero(skipped))
        self.updates += int(np.count_nonzero(trained))
        if (trained & sampled).any():  # a repeated index: the later step's priority wins, as if written one by one
            indices = np.concatenate([step.context for step in itertools.compress(pending, trained & sampled)])
            priorities = values[trained & sampled, 6:].reshape(-1)
            self.replay.update_priorities(indices, priorities)
            self.largest_td = max(self.largest_td, float(priorities.max()))
        return [
            {}
            if bad or not own
            else {"loss": loss, "q_mean": q_mean, "td_abs_mean": td_abs_mean, "grad_norm": grad_norm}
            for bad, own, (loss, q_mean, td_abs_mean, _, grad_norm) in zip(
                skipped.tolist(), sampled.tolist(), values[:, 1:6].tolist()
            )
        ]

    def step(self) -> dict[str, float]:
        """One whole update in a row, whatever the rate limiter says (tests, benchmarks)."""
        return self.finish([self.train(self.sample()[0])])[0]

    def weights(self) -> dict[str, np.ndarray]:
        return numpy_weights(self.online)

    def state_dict(self) -> dict[str, Any]:
        return {
            "online": self.online.state_dict(),
            "target": self.target.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
            "limiter": {"inserts": self.limiter.inserts, "samples": self.limiter.samples},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Networks, optimizer and counters of a checkpoint. Call after the replay was
        restored (if it was): the sample-to-insert limit then goes on where it was instead of
        waiting for apex_dqn.replay.min_size new transitions."""
        self.check_state(state)
        self.online.load_state_dict(state["online"])
        self.target.load_state_dict(state["target"])
        optim.load_state(self.optimizer, state["optimizer"])
        self.updates = self.steps = state["updates"]
        if len(self.replay) > 0:
            limiter, inserts = self.limiter, state["limiter"]["inserts"]
            # Samples within the slack of what the inserts allow: a checkpoint of other replay
            # settings (or a forged one) could otherwise stop sampling, or inserting, for good.
            allowed = (inserts - limiter.min_size) * limiter.samples_per_insert
            samples = min(max(state["limiter"]["samples"], allowed - limiter.slack), allowed + limiter.slack)
            limiter.inserts, limiter.samples = inserts, max(0, int(samples))

    def check_state(self, state: dict[str, Any]) -> None:
        """What load_state_dict checks before it changes anything (the learner calls it before
        restoring the replay, so that a refused checkpoint leaves that empty): networks that do
        not fit this run's model are ValueError, an optimizer state that does not fit them is
        CorruptCheckpoint."""
        check_fits(self.online, state["online"], "online")
        check_fits(self.target, state["target"], "target")
        optim.check_state(self.optimizer, state["optimizer"])

    @property
    def checkpoint_replay(self) -> StackedReplay | None:
        """The replay that checkpoints hold, or None when apex_dqn.checkpoint_replay is off."""
        return self.replay if self.config.apex_dqn.checkpoint_replay else None

    @property
    def memory_nbytes(self) -> int:
        return self.replay.nbytes

    def metrics(self) -> dict[str, Any]:
        return {
            "replay_size": len(self.replay),
            "replay_capacity": self.replay.capacity,
            **self.replay.priority_stats(),
            "replay_bytes_per_transition": round(self.replay.bytes_per_transition, 1),
            "replay_nbytes_mb": round(self.replay.nbytes / 2**20, 1),
            "inserted": self.limiter.inserts,
            "skipped_updates": self.skipped_updates,
            "dropped_transitions": self.dropped_transitions,
            "capped_priorities": self.capped_priorities,
            "stale_priority_updates": self.replay.stale_priority_updates,
        }


def _greedy(
    net: QNetwork, obs: torch.Tensor, state: None = None, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, None]:
    q = net(obs)
    return (q if mask is None else q.masked_fill(~mask, -torch.inf)).argmax(dim=1), None


# `apex eval` and apex.load_policy act with the online network, epsilon-greedy (0 by default).
POLICY = Policy("online", "the online Q network", QNetwork, _greedy)

PREFETCH_BYTES = 256 << 20  # staged batches at most, when apex_dqn.prefetch_batches is null


def prefetch_depth(spec: EnvSpec, batch_size: int) -> int:
    """Batches to keep staged: as many as PREFETCH_BYTES hold, 2 to 64. Each refill costs the
    training thread GIL hand-overs, so the more batches one refill draws the better, as long
    as they fit (CartPole's batches of 512: 16 KiB, 64; Atari's: 29 MiB, 9)."""
    observation = spec.stack * int(np.prod(spec.frame_shape)) * np.dtype(spec.frame_dtype).itemsize
    batch_bytes = batch_size * (2 * observation + 32)  # obs, next_obs; action, reward, discount, weight
    return int(min(64, max(2, PREFETCH_BYTES // batch_bytes)))
