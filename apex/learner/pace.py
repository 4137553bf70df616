"""How a learner's loop takes its steps and when it stops and checkpoints: alone (``SoloPace``:
one step a loop when a batch is staged), or in step with the other ranks of a data-parallel
group (``GroupPace``: one collective a loop agrees on how many steps every rank takes and
whether to stop, checkpoint or sync); and when it publishes, writes metrics and checkpoints
(``Clocks``)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from apex.config import Config, StopConditions
from apex.core import TrainingCore
from apex.learner.ingest import RunCounters
from apex.learner.runtime import GROUP_SYNC_S
from apex.multiagent.learner import MultiPolicyLearner
from apex.training.distributed import Agreement, LearnerGroup, train_steps
from apex.training.pipeline import Pipeline, Staged


class Pace(Protocol):
    def agree(self, staged: int, *, stop: bool, checkpoint: bool) -> Agreement:
        """This loop's steps, and whether to stop now and to checkpoint after the steps."""
        ...

    def train(self, agreed: Agreement) -> None:
        """Trains the agreed steps (handing their results to the pipeline)."""
        ...


class SoloPace:
    """One learner alone: a step when a batch is staged (one a loop, so that control
    messages, publishing and the clocks are looked at between steps); it stops and
    checkpoints when it asks to."""

    def __init__(self, pipeline: Pipeline, core: TrainingCore) -> None:
        self.pipeline, self.core = pipeline, core

    def agree(self, staged: int, *, stop: bool, checkpoint: bool) -> Agreement:
        return Agreement(min(1, staged), stop, checkpoint, False)

    def train(self, agreed: Agreement) -> None:
        for _ in range(agreed.steps):
            # (taken: `steps` were staged, and only this thread takes them)
            if (staged := self.pipeline.take()) is not None:
                self.pipeline.submit(self.core.train(staged))  # written back by the prefetch thread


class GroupPace:
    """A rank of a learner group: every rank takes the most steps any has staged (a rank
    without a batch steps without one, adding no gradient, and counts it); any rank's stop
    or checkpoint is every rank's; every GROUP_SYNC_S the ranks sync (``on_sync``: rank 0
    takes in the others' counts, they hear rank 0's news). With several policies the ranks
    agree on each policy's steps (``StagedByPolicy``): a step all-reduces one network's
    gradients, so every rank must step the same policy at the same time."""

    def __init__(
        self,
        group: LearnerGroup,
        pipeline: Pipeline,
        core: TrainingCore,
        on_sync: Callable[[], None],
        asks_sync: bool,
    ) -> None:
        """``asks_sync``: this rank keeps the sync's clock (rank 0; the others follow it)."""
        self.group, self.pipeline, self.core, self.on_sync = group, pipeline, core, on_sync
        self.asks_sync = asks_sync
        self.steps_without_batch = 0  # the group's steps this rank took without a batch of its own
        self.by_policy = StagedByPolicy(pipeline, core) if isinstance(core, MultiPolicyLearner) else None
        self._next_sync = time.monotonic()

    def agree(self, staged: int, *, stop: bool, checkpoint: bool) -> Agreement:
        now = time.monotonic()
        sync = self.asks_sync and now >= self._next_sync
        counts = self.by_policy.counts() if self.by_policy is not None else staged
        agreed = self.group.agree(counts, stop=stop, checkpoint=checkpoint, sync=sync)
        if agreed.sync:
            self._next_sync = now + GROUP_SYNC_S
            self.on_sync()
        return agreed

    def train(self, agreed: Agreement) -> None:
        if self.by_policy is not None:
            self.steps_without_batch += self.by_policy.train(agreed.by_policy)
        else:
            self.steps_without_batch += train_steps(self.pipeline, self.core, agreed.steps)


class StagedByPolicy:
    """A multi-policy rank's staged batches sorted by policy, for a group that agrees on each
    policy's steps: every loop the pipeline's staged batches move here (``counts``), and the
    agreed steps go policy by policy in the learner's order of trained policies, each on this
    rank's batch of that policy while it has one, then without (``train``). Every loop
    trains at least what was counted, so nothing stays here from one loop to the next."""

    def __init__(self, pipeline: Pipeline, learner: MultiPolicyLearner) -> None:
        self.pipeline, self.learner = pipeline, learner
        self.held: dict[str, deque[Staged]] = {name: deque() for name in learner.trained}

    def counts(self) -> list[int]:
        """Each trained policy's batches staged on this rank, in the learner's order."""
        while (staged := self.pipeline.take()) is not None:
            self.held[self.learner.policy_of(staged)].append(staged)
        return [len(batches) for batches in self.held.values()]

    def train(self, steps: tuple[int, ...]) -> int:
        """The agreed steps of each policy; returns how many had no batch of this rank's."""
        without = 0
        for (name, batches), count in zip(self.held.items(), steps, strict=True):
            for _ in range(count):
                if batches:
                    self.pipeline.submit(self.learner.train(batches.popleft()))
                else:
                    without += 1
                    self.pipeline.submit(self.learner.train_without_batch(name))
        return without


class Clocks:
    """When the loop next writes a metrics row, publishes weights and checkpoints (by time,
    by updates, and for a new best return)."""

    def __init__(self, config: Config, updates: int) -> None:
        now = time.monotonic()
        learner = config.learner
        self.metrics_every, self.best_every = learner.metrics_interval_s, learner.best_checkpoint_interval_s
        self.checkpoint_every, self.checkpoint_every_updates = (
            learner.checkpoint_interval_s,
            learner.checkpoint_interval_updates,
        )
        self.publish_every = config.algo_config.publish_interval
        self.next_metrics = now + self.metrics_every
        self.next_checkpoint, self.last_checkpoint = now + self.checkpoint_every, now
        self.next_checkpoint_updates = _next_multiple(updates, self.checkpoint_every_updates)
        self.next_publish = _next_multiple(updates, self.publish_every)

    def publish_due(self, updates: int) -> bool:
        if self.next_publish is None or updates < self.next_publish:
            return False
        self.next_publish = _next_multiple(updates, self.publish_every)
        return True

    def metrics_due(self, now: float) -> bool:
        if now < self.next_metrics:
            return False
        self.next_metrics = now + self.metrics_every
        return True

    def checkpoint_due(self, now: float, updates: int) -> bool:
        by_updates = self.next_checkpoint_updates is not None and updates >= self.next_checkpoint_updates
        return now >= self.next_checkpoint or by_updates

    def best_may_be_saved(self, now: float) -> bool:
        """A checkpoint for a new best is written at most every best_checkpoint_interval_s (0: never)."""
        return self.best_every > 0 and now - self.last_checkpoint >= self.best_every

    def checkpointed(self, now: float, updates: int) -> None:
        self.last_checkpoint, self.next_checkpoint = now, now + self.checkpoint_every
        self.next_checkpoint_updates = _next_multiple(updates, self.checkpoint_every_updates)


def _next_multiple(updates: int, every: int) -> int | None:
    """The first multiple of ``every`` past ``updates`` (None for every = 0: never)."""
    return (updates // every + 1) * every if every else None


def stop_reason_now(stop: StopConditions, counters: RunCounters, elapsed: float) -> str | None:
    """Why the run stops now (a return reached over a full window, its time, its steps), or None."""
    with counters.lock:
        mean, full = counters.stats.return_mean, counters.stats.full_window
    if stop.return_mean is not None and full and mean is not None and mean >= stop.return_mean:
        return f"return_mean_100 {mean:.4g} >= {stop.return_mean}"
    if stop.seconds is not None and elapsed >= stop.seconds:
        return f"{stop.seconds} seconds"
    if stop.env_steps is not None and counters.env_steps >= stop.env_steps:
        return f"{stop.env_steps} env steps"
    return None
