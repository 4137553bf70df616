"""What every learner process sets up and runs, rank 0 and a group's other ranks alike: the
device and threads, the algorithm's core fed by the ingest thread and the prefetch pipeline
(``TrainingRuntime``), the seeds it hands actors, its memory figures, the loop's timings."""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable

import numpy as np
import psutil
import torch

from apex import algos
from apex.config import Config
from apex.core import LearnerCore, TrainingCore
from apex.envs.make import EnvSpec, env_spec
from apex.envs.multi_agent import is_multi_agent
from apex.envs.policy_map import MultiAgentSpec, multi_agent_spec
from apex.errors import ApexError
from apex.learner.ingest import Ingest, IngestTarget, RunCounters
from apex.multiagent.learner import MultiPolicyLearner
from apex.system.logs import RateLimitedLog
from apex.system.malloc import keep_large_blocks
from apex.training.distributed import GradientAllReduce
from apex.training.pipeline import Pipeline, SectionTimes, Wakeup
from apex.transport import TrajectoryReceiver
from apex.wire.schema import UNKNOWN_STEP_LIMIT

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
STOP_LINGER_S = 0.5  # heartbeats answered with stop after the run ends, so that every actor hears it
GROUP_SYNC_S = 0.25  # how often a learner group's ranks hand rank 0 their counts (episodes for stop-return)
# An actor's seed from the run's and its index: far apart for neighbouring indices and runs
# (two primes), so that no two actors' environments share a seed sequence.
SEED_RUN_FACTOR = 1_000_003
SEED_ACTOR_FACTOR = 10_007


def actor_seed(run_seed: int, actor_index: int) -> int:
    return (run_seed * SEED_RUN_FACTOR + SEED_ACTOR_FACTOR * (actor_index + 1)) % 2**63


def all_finite(arrays: dict[str, np.ndarray]) -> bool:
    """Whether every floating-point array holds only finite values."""
    return all(np.isfinite(a).all() for a in arrays.values() if a.dtype.kind == "f")


def rss_bytes() -> int:
    """Resident memory of this process now."""
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    # psutil has no peak resident size on Linux; getrusage has (in KiB there).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def learner_runtime(config: Config) -> tuple[EnvSpec | MultiAgentSpec, torch.device]:
    """What every learner process (a group's ranks alike) sets up first: (env spec, or a
    PettingZoo environment's and its policies', device), torch's CPU threads, and malloc
    keeping large blocks (decoded arrays off fresh pages)."""
    spec = multi_agent_spec(config) if is_multi_agent(config.env) else env_spec(config.env, config.algo)
    device = pick_device(config.learner.device)
    torch.set_num_threads(config.learner.torch_threads)
    keep_large_blocks()
    return spec, device


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ApexError(f"learner.device={name} but CUDA is not available: use learner.device=auto or cpu")
    return device


class TrainingRuntime:
    """The algorithm's learner core (``apex.algos.<algo>``), the ingest thread that feeds it
    from a trajectory receiver, the prefetch pipeline that stages its batches, the run's
    counters and the wake-up the loop sleeps on: what rank 0 (``LearnerProcess``) and a
    group's other ranks (``FollowerProcess``) both build and run."""

    def __init__(
        self,
        config: Config,
        spec: EnvSpec | MultiAgentSpec,
        device: torch.device,
        receiver: TrajectoryReceiver,
        world_size: int | None = None,
    ) -> None:
        """``world_size``: the core's gradients are all-reduced over a group of that many ranks."""
        self.learner: TrainingCore
        self.core: LearnerCore | None  # a single-agent run's one core (what a group's ranks and replays need)
        if isinstance(spec, MultiAgentSpec):
            multi = MultiPolicyLearner(config, spec, device)
            self.learner, self.policies, self.core = multi, multi.cores, None
            # Each batch to its policy's core, whose limits are for that policy's seats.
            targets: dict[str | None, IngestTarget] = {
                name: IngestTarget(multi.cores[name], multi.seats(name)) for name in spec.trained
            }
            step_limit = config.env.max_episode_steps or UNKNOWN_STEP_LIMIT
        else:
            core = algos.get(config.algo).learner().core(config, spec, device)
            self.learner, self.policies, self.core = core, {}, core
            targets = {None: IngestTarget(core, 1)}
            step_limit = spec.max_episode_steps or UNKNOWN_STEP_LIMIT
        if world_size is not None:
            self.learner.all_reduce = GradientAllReduce(world_size)
        receiver.lazy = True  # the cores decompress frames themselves, straight into their storage
        self.counters = RunCounters(tuple(self.policies))
        self.version = 0  # of the weights last published (on a group's other ranks: as of the last sync)
        matches = multi.check_matches if isinstance(self.learner, MultiPolicyLearner) and multi.pool else None
        self.ingest = Ingest(
            receiver,
            targets,
            config,
            step_limit,
            self.counters,
            lambda: self.version,
            self.learner.wait_to_insert,
            matches,
        )
        self.times = SectionTimes()
        self.wakeup = Wakeup()
        self.prefetch_errors = 0  # our own bugs met while sampling: logged with a traceback
        self._bug_log = RateLimitedLog(log, interval_s=10.0)
        self.pipeline = Pipeline(self.learner, self.times, on_ready=self.wakeup.notify, on_error=self._prefetch_failed)

    def largest_batch_bytes(self, num_envs: int) -> int:
        """The most an actor of ``num_envs`` environments may send in one batch, as stored."""
        return max(
            target.core.schema.max_bytes(target.core.batch_limits(num_envs * target.seats))
            for target in self.ingest.targets.values()
        )

    def start(self) -> None:
        self.ingest.start()
        self.pipeline.start()

    def stop(self) -> list[dict[str, float]]:
        """Stops the threads; the metrics of the steps whose results came in meanwhile."""
        self.pipeline.stop()
        results = list(self.pipeline.results())
        self.ingest.stop()
        return results

    def close(self) -> None:
        self.wakeup.close()

    def wait_for_work(self, wait: Callable[[int], object]) -> None:
        """Sleeps until a batch is staged (the prefetch thread's wake-up) or ``wait`` returns:
        ``wait(wake_fd)`` blocks on that file descriptor and whatever else its caller waits
        for (rank 0: control messages), at most IDLE_WAIT_S."""
        self.wakeup.waiting = True
        try:
            if not self.pipeline.staged():  # staged before `waiting` was set
                wait(self.wakeup.fileno())
        finally:
            self.wakeup.waiting = False
            self.wakeup.drain()

    def _prefetch_failed(self, error: BaseException) -> None:
        """Called by the prefetch thread inside its ``except``: our own bug, loud and counted."""
        self.prefetch_errors += 1
        self._bug_log.exception("sampling a batch failed (a bug in apex, please report it); continuing")
