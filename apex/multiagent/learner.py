"""Several policies in one learner process: ``MultiPolicyLearner`` holds one learner core of the
run's algorithm a policy (its own network, optimizer, replay or unroll queue, priorities and
ladder) and is itself a ``TrainingCore`` to the process shell, the pipeline and checkpoints.

Updates interleave by the data each policy has: the prefetch thread asks the policies in turn
for a staged batch and takes the first that has one, so a policy without data never stalls
the others. A staged batch and its pending results carry their policy's name. Weights go out
in one message, each array named ``<policy>/<name>``; the ingest thread sends each batch to
its policy's core (``apex.learner.ingest``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from apex import algos
from apex.config import Config
from apex.config.multi_agent import WEIGHT_SEPARATOR
from apex.envs.policy_map import MultiAgentSpec
from apex.errors import CorruptCheckpoint
from apex.multiagent.selfplay import SnapshotPool, check_matches

if TYPE_CHECKING:
    from apex.core import LearnerCore
    from apex.replay import StackedReplay
    from apex.training.distributed import GradientAllReduce
    from apex.training.pipeline import Pending, Staged


class MultiPolicyLearner:
    """One learner core a policy of a ``MultiAgentSpec``, behind the ``TrainingCore`` seam (the
    ingest thread feeds each policy's ``LearnerCore`` itself)."""

    def __init__(self, config: Config, spec: MultiAgentSpec, device: torch.device) -> None:
        core = algos.get(config.algo).learner().core
        self.spec = spec
        self.cores: dict[str, LearnerCore] = {name: core(config, p.spec, device) for name, p in spec.policies.items()}
        self.trained = spec.trained
        first = self.cores[self.trained[0]] if self.trained else next(iter(self.cores.values()))
        self.samples_per_update = first.samples_per_update
        self.prefetch_batches = first.prefetch_batches
        self.last_metrics: dict[str, dict[str, float]] = {name: {} for name in self.cores}
        self._turn = 0  # the policy asked first for the next batch
        self_play = config.multi_agent.self_play
        # (validation holds self-play to the shared mapping: its one policy is the one that plays itself)
        self.pool = SnapshotPool(next(iter(self.cores)), self_play) if self_play.enabled else None

    @property
    def all_reduce(self) -> GradientAllReduce | None:
        """A learner group's gradient all-reduce, each policy's core's (the ranks step the
        same policy at the same time: ``apex.learner.pace.StagedByPolicy``)."""
        return next(iter(self.cores.values())).all_reduce

    @all_reduce.setter
    def all_reduce(self, value: GradientAllReduce | None) -> None:
        for core in self.cores.values():
            core.all_reduce = value

    def seats(self, policy: str) -> int:
        """Agents of ``policy`` in each environment: an actor's rows (or rungs) for it per environment."""
        return len(self.spec.policies[policy].agents)

    @property
    def updates(self) -> int:
        return sum(core.updates for core in self.cores.values())

    @property
    def checkpoint_replay(self) -> StackedReplay | None:
        return None  # several replays: checkpoints hold the networks, optimizers and counts

    @property
    def memory_nbytes(self) -> int:
        return sum(core.memory_nbytes for core in self.cores.values())

    def actor_setup(self, actor_index: int, num_envs: int) -> dict[str, Any]:
        """Each policy's part, for ``num_envs`` environments (the actor gives each of a
        policy's seats in an environment that environment's part: ``per_agent_setup``)."""
        for name, core in self.cores.items():  # what one batch of all its seats needs (IMPALA: room in the queue)
            core.actor_setup(actor_index, num_envs * self.seats(name))
        return {"policies": {name: core.actor_setup(actor_index, num_envs) for name, core in self.cores.items()}}

    def policy_limits(self, policy: str, num_envs: int) -> dict[str, int]:
        return self.cores[policy].batch_limits(num_envs * self.seats(policy))

    def largest_batch_bytes(self, num_envs: int) -> int:
        return max(
            (self.cores[name].schema.max_bytes(self.policy_limits(name, num_envs)) for name in self.trained), default=0
        )

    def wait_to_insert(self, timeout: float) -> bool:
        """Whether some trained policy has room (a full one must not hold back the others)."""
        share = timeout / max(1, len(self.trained))
        return any(self.cores[name].wait_to_insert(share) for name in self.trained)

    # -- training: the policies in turn, each batch tagged with its policy

    def prepare(self, timeout: float, most: int = 1) -> list[Staged]:
        names = self.trained
        if not names:
            return []
        share = timeout / len(names)
        for i in range(len(names)):
            name = names[(self._turn + i) % len(names)]
            staged = self.cores[name].prepare(share, most)
            if staged:
                self._turn = (self._turn + i + 1) % len(names)
                for batch in staged:
                    batch.context = (name, batch.context)
                return staged
        return []

    def train(self, staged: Staged) -> Pending:
        name, staged.context = staged.context
        pending = self.cores[name].train(staged)
        pending.context = (name, pending.context)
        return pending

    def policy_of(self, staged: Staged) -> str:
        """The policy a batch staged by ``prepare`` is for."""
        name: str = staged.context[0]
        return name

    def train_without_batch(self, policy: str | None = None) -> Pending:
        """A learner group's step of ``policy`` on a rank without a batch of it (the group
        agreed which policy steps: ``apex.learner.pace.StagedByPolicy``)."""
        if policy is None:
            raise ValueError("a step without a batch of a multi-agent run names its policy")
        pending = self.cores[policy].train_without_batch()
        pending.context = (policy, pending.context)
        return pending

    def finish(self, pending: list[Pending]) -> list[dict[str, float]]:
        results: list[dict[str, float]] = []
        for item in pending:
            name, item.context = item.context
            (metrics,) = self.cores[name].finish([item])
            if metrics:
                self.last_metrics[name] = metrics
            if self.pool is not None and name == self.pool.policy:
                self.pool.maybe_snapshot(self.cores[name].updates, self.cores[name].weights)
            results.append({f"{name}.{key}": value for key, value in metrics.items()})
        return results

    def step(self) -> dict[str, float]:
        """One update of the next policy that has data (tests, benchmarks)."""
        staged = self.prepare(timeout=1.0)
        return self.finish([self.train(staged[0])])[0] if staged else {}

    # -- weights, metrics, state

    def weights(self) -> dict[str, np.ndarray]:
        """Every policy's, and the self-play pool's snapshots."""
        return {
            **{
                f"{name}{WEIGHT_SEPARATOR}{key}": array
                for name, core in self.cores.items()
                for key, array in core.weights().items()
            },
            **(self.pool.weights() if self.pool is not None else {}),
        }

    def check_matches(self, raw: Any) -> list[tuple[int, int]]:
        """A batch's self-play matches (``info.matches``), checked; ValueError if malformed."""
        if self.pool is None:
            raise ValueError("this run plays no self-play matches")
        return check_matches(raw, self.pool.next_id)

    def record_matches(self, matches: list[tuple[int, int]]) -> None:
        if self.pool is not None:
            self.pool.record(matches)

    def metrics(self) -> dict[str, Any]:
        """Each policy's figures under ``policies.<name>``."""
        policies = {}
        for name, core in self.cores.items():
            own = core.metrics()
            own.update({key: round(value, 5) for key, value in self.last_metrics[name].items()})
            own["updates"] = core.updates
            own["trained"] = name in self.trained
            if self.pool is not None and name == self.pool.policy:
                own.update(self.pool.metrics())
            policies[name] = own
        return {"policies": policies}

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "updates": self.updates,
            "policies": {name: core.state_dict() for name, core in self.cores.items()},
        }
        if self.pool is not None:
            state["self_play_pool"] = self.pool.state_dict()
        return state

    def check_state(self, state: dict[str, Any]) -> None:
        saved = state.get("policies") if isinstance(state, dict) else None
        if not isinstance(saved, dict) or set(saved) != set(self.cores):
            found = sorted(saved) if isinstance(saved, dict) else None
            raise CorruptCheckpoint(
                f"the checkpoint holds the policies {found}, and this run has {sorted(self.cores)}: "
                "resume with the multi_agent.mapping it was written with"
            )
        for name, core in self.cores.items():
            core.check_state(saved[name])
        if self.pool is not None and "self_play_pool" in state:  # (a run that starts self-play has none)
            self.pool.check_state(state["self_play_pool"], set(self.cores[self.pool.policy].weights()))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, core in self.cores.items():
            core.load_state_dict(state["policies"][name])
        if self.pool is not None and "self_play_pool" in state:
            self.pool.load_state_dict(state["self_play_pool"])
