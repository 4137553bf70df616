"""What Ape-X's learners share (Horgan et al. 2018, "Distributed Prioritized Experience
Replay"): a prioritized replay of frame-deduplicated n-step transitions that actors fill
(``apex.replay.StackedReplay``), its sample-to-insert rate limiter, initial priorities held to
a cap, batches whose loss was not finite dropped, and the prefetch pipeline's stages. An
algorithm adds its networks, its loss and its actors' setup: Ape-X DQN
(``apex.algos.apex_dqn.learner``) and Ape-X DDPG (``apex.algos.apex_ddpg.learner``).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from apex.algos.nstep import merge_chunks
from apex.config import ApexDdpgConfig, ApexDqnConfig, Config
from apex.envs.make import EnvSpec
from apex.errors import ProtocolError
from apex.nets.torch_nets import check_fits, numpy_weights
from apex.replay import RateLimiter, StackedReplay
from apex.training import optim
from apex.training.distributed import NO_BATCH, GradientAllReduce
from apex.training.pipeline import DeviceStager, Pending, Staged, collect
from apex.wire.compression import Compressed
from apex.wire.schema import FLOAT32_MAX, ArrayRule, BatchSchema, Range, below, frame_rule, mask_rule

NetworkT = TypeVar("NetworkT", bound=torch.nn.Module)


def batch_schema(
    spec: EnvSpec, config: Config, n_step: int | None = None, action: ArrayRule | None = None
) -> BatchSchema:
    """What an Ape-X batch holds: frames, then per transition where its observation and
    bootstrap stacks start in them, its action, n-step return, discount and priority.
    ``n_step`` and ``action``: Ape-X DDPG's (default: apex_dqn.n_step, an action index)."""
    stack_starts = below("frames", 1 - spec.stack)
    max_return = config.transport.max_abs_reward * (n_step or config.apex_dqn.n_step)
    transitions = ("transitions",)
    return BatchSchema(
        (
            frame_rule(spec.frame_shape, spec.frame_dtype, spec.obs_bound(config.transport.max_abs_obs)),
            ArrayRule("obs_frame", "iu", np.dtype(np.int32), transitions, stack_starts),
            ArrayRule("next_obs_frame", "iu", np.dtype(np.int32), transitions, stack_starts),
            action or ArrayRule("action", "iu", np.dtype(np.int64), transitions, below(spec.num_actions)),
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


def batch_limits(
    num_envs: int, spec: EnvSpec, config: Config, settings: ApexDqnConfig | ApexDdpgConfig | None = None
) -> dict[str, int]:
    """The most transitions and frames one batch of an actor with ``num_envs`` environments
    can hold: it sends once it holds chunk_transitions (C) or more, and one step adds at
    most two chunks per environment (a full one and an episode's end, each up to C + n
    transitions, with the n + stack frames around them). ``settings``: the section of
    n-step chunks (Ape-X DDPG's; default apex_dqn)."""
    s = settings or config.apex_dqn
    chunk, n = s.chunk_transitions, s.n_step
    chunks = chunk + 2 * num_envs
    transitions = chunk + num_envs * (2 * chunk + n)
    return {
        "transitions": min(transitions, s.replay.capacity),
        "frames": min(transitions + chunks * (n + spec.stack), s.frame_capacity),
    }


# ---------------------------------------------------------------------------------------
# The learner core: owns the networks, the replay and its rate limiter.


class ReplayLearner(Generic[NetworkT]):
    """An Ape-X learner over its prioritized replay: everything but the networks (``online``
    and ``target``, of the algorithm's type), the optimizer, the update and the actors' setup,
    which each algorithm's ``__init__``, ``train``, ``train_without_batch``, ``_stepped`` and
    ``actor_setup`` add.

    The generic learner process calls ``insert`` from its ingest thread, ``prepare`` from its
    prefetch thread and ``train`` / ``finish`` from its main loop (``apex.training.pipeline``);
    ``wait_to_insert`` and ``prepare`` apply the sample-to-insert limit.
    """

    config: Config
    settings: ApexDqnConfig | ApexDdpgConfig  # the algorithm's section: what the shared methods read
    spec: EnvSpec
    device: torch.device
    online: NetworkT
    target: NetworkT
    optimizer: torch.optim.Optimizer
    # What a step's results row holds between ``skipped`` and ``grad_norm`` (priority_sum:
    # finite only if every new priority is; not a metric)
    figures: tuple[str, ...] = ("loss", "q_mean", "td_abs_mean", "priority_sum")

    def train(self, staged: Staged) -> Pending:
        raise NotImplementedError

    def _stepped(self) -> None:
        raise NotImplementedError

    def _replay_and_counters(self, extra_fields: dict[str, tuple[tuple[int, ...], Any]] | None) -> None:
        """The prioritized replay of ``self.settings``, its rate limiter and the counters (shared
        with Ape-X DDPG, whose actions are vectors of the spec's action dtype)."""
        spec, settings, replay = self.spec, self.settings, self.settings.replay
        self.replay = StackedReplay(
            spec.frame_shape,
            spec.frame_dtype,
            spec.stack,
            replay.capacity,
            settings.frame_capacity,
            alpha=replay.alpha,
            eps=replay.eps,
            seed=self.config.seed,
            extra_fields=extra_fields,
            action_field=(spec.action_shape, spec.action_dtype),
        )
        self.limiter = RateLimiter(settings.replay_ratio, replay.min_size, replay.rate_slack)
        self.stager = DeviceStager(self.device)
        self.prefetch_batches = settings.prefetch_batches or prefetch_depth(spec, settings.batch_size)
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
        self.samples_per_update = settings.batch_size

    def batch_limits(self, num_envs: int) -> dict[str, int]:
        return batch_limits(num_envs, self.spec, self.config)

    @staticmethod
    def env_steps(sizes: dict[str, int]) -> int:
        """Env steps a validated batch stands for: one transition per step."""
        return sizes["transitions"]

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
        size = self.settings.batch_size
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
        size = self.settings.batch_size
        start = time.perf_counter()
        batch, indices, weights = self.replay.sample(size, self.settings.replay.beta, batches=count)
        self.limiter.sampled(count * size)
        batch["weights"] = weights
        seconds = (time.perf_counter() - start) / count
        return self.stager.stage_batches(batch, np.split(indices, count), seconds)

    def finish(self, pending: list[Pending]) -> list[dict[str, float]]:
        """Reads the results of trained steps, in order: writes their new priorities back
        (together: one update of the tree) and returns each one's metrics; a skipped step is
        counted, the transitions it trained on are dropped (never sampled again), and its
        metrics are {}."""
        values = collect(pending)  # a row a step: skipped, *FIGURES, grad_norm, priorities
        first_priority = len(self.figures) + 2
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
            priorities = values[trained & sampled, first_priority:].reshape(-1)
            self.replay.update_priorities(indices, priorities)
            self.largest_td = max(self.largest_td, float(priorities.max()))
        names = (*self.figures, "grad_norm")
        return [
            {} if bad or not own else {name: value for name, value in zip(names, row) if name != "priority_sum"}
            for bad, own, row in zip(skipped.tolist(), sampled.tolist(), values[:, 1:first_priority].tolist())
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
        return self.replay if self.settings.checkpoint_replay else None

    @property
    def memory_nbytes(self) -> int:
        return self.replay.nbytes

    def replay_ratio(self) -> float | None:
        """Transitions trained per transition inserted since training could start (None
        before): the ratio the limiter holds, as the updates saw it (steps skipped for a
        non-finite loss count: their samples were drawn)."""
        trained_on = self.limiter.inserts - self.limiter.min_size
        return round(self.steps * self.settings.batch_size / trained_on, 3) if trained_on > 0 else None

    def metrics(self) -> dict[str, Any]:
        return {
            "replay_size": len(self.replay),
            "replay_capacity": self.replay.capacity,
            **self.replay.priority_stats(),
            "replay_bytes_per_transition": round(self.replay.bytes_per_transition, 1),
            "replay_nbytes_mb": round(self.replay.nbytes / 2**20, 1),
            "inserted": self.limiter.inserts,
            "replay_ratio": self.replay_ratio(),
            "replay_ratio_target": self.limiter.samples_per_insert,
            "skipped_updates": self.skipped_updates,
            "dropped_transitions": self.dropped_transitions,
            "capped_priorities": self.capped_priorities,
            "stale_priority_updates": self.replay.stale_priority_updates,
        }


PREFETCH_BYTES = 256 << 20  # staged batches at most, when apex_dqn.prefetch_batches is null


def prefetch_depth(spec: EnvSpec, batch_size: int) -> int:
    """Batches to keep staged: as many as PREFETCH_BYTES hold, 2 to 64. Each refill costs the
    training thread GIL hand-overs, so the more batches one refill draws the better, as long
    as they fit (CartPole's batches of 512: 16 KiB, 64; Atari's: 29 MiB, 9)."""
    observation = spec.stack * int(np.prod(spec.frame_shape)) * np.dtype(spec.frame_dtype).itemsize
    batch_bytes = batch_size * (2 * observation + 32)  # obs, next_obs; action, reward, discount, weight
    return int(min(64, max(2, PREFETCH_BYTES // batch_bytes)))
