"""Rank 0's checkpoints: resuming from the newest one that loads, and writing them (in a
learner group with every rank's replay shard beside them)."""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

from apex.checkpoint import Checkpoint, CheckpointWriter, CorruptCheckpoint, find, first_loadable, read_state
from apex.checkpoint.state import check_state
from apex.config import Config
from apex.errors import ApexError
from apex.learner.metrics import EpisodeStats
from apex.learner.runtime import TrainingRuntime, all_finite
from apex.multiagent.learner import MultiPolicyLearner
from apex.system.logs import RateLimitedLog
from apex.training.distributed import LearnerGroup

log = logging.getLogger("apex.learner.process")


class Saved(enum.Enum):
    """What became of a checkpoint asked for."""

    WRITTEN = "written"  # (or, in the background, begun)
    REFUSED = "refused"  # non-finite weights, or a rank's shard failed: counted; the next is at the next interval
    BUSY = "busy"  # the one before is still being written: ask again soon


class RunCheckpointer:
    """Writes and restores rank 0's checkpoints of a run (``LOGDIR/checkpoints``)."""

    def __init__(self, config: Config, runtime: TrainingRuntime, logdir: Path, group: LearnerGroup | None) -> None:
        self.config, self.runtime, self.group = config, runtime, group
        self.writer = CheckpointWriter(Path(logdir) / "checkpoints", config.learner.keep_checkpoints)
        self.nonfinite_refused = 0  # checkpoints not written for non-finite weights
        self.elapsed_before = 0.0  # run time of the checkpoint resumed from
        self.resumed_from: str | None = None
        self._bad_log = RateLimitedLog(log)

    # -- resuming

    def start(self, resume: Checkpoint | None, step_limit: int) -> None:
        """Resumes from ``resume``; a new multi-agent run starts its policies from the
        checkpoint that multi_agent.init names, where it names one."""
        if resume is not None:
            self.resume(resume, step_limit)
        elif self.config.multi_agent.init and isinstance(self.runtime.learner, MultiPolicyLearner):
            self._start_policies_from(Path(self.config.multi_agent.init), self.runtime.learner)

    def _start_policies_from(self, path: Path, learner: MultiPolicyLearner) -> None:
        """Loads each policy of the checkpoint at ``path`` (a file, or a run directory's
        newest) that this run has by name: networks, optimizer, counts; the others start afresh."""
        if path.is_dir():
            state = find(path, "newest").load_state()
        elif path.is_file():
            try:
                state = check_state(read_state(path), path.name)
            except CorruptCheckpoint as e:
                raise ApexError(f"multi_agent.init {path}: {e}") from None
        else:
            raise ApexError(f"multi_agent.init {path}: no such checkpoint file or run directory")
        found = state.get("policies")
        policies: dict[str, Any] = found if isinstance(found, dict) else {}
        shared = sorted(set(policies) & set(learner.cores))
        if not shared:
            names = ", ".join(sorted(policies)) or "none (a single-agent run's?)"
            raise ApexError(
                f"multi_agent.init {path} holds the policies {names}, and this run's are "
                f"{', '.join(learner.cores)}: none to start from"
            )
        for name in shared:
            core = learner.cores[name]
            try:
                core.check_state(policies[name])
                core.load_state_dict(policies[name])
            except (CorruptCheckpoint, KeyError, RuntimeError, ValueError) as e:
                raise ApexError(
                    f"multi_agent.init {path}: policy {name} does not fit this run's ({str(e).splitlines()[0]})"
                ) from None
        log.info("policies %s start from %s", ", ".join(shared), path)

    def resume(self, newest: Checkpoint, step_limit: int) -> None:
        """Restores the newest checkpoint that loads; one that cannot be loaded (forged,
        corrupt, inconsistent: CorruptCheckpoint) is set aside and the one before tried (a
        failed load changes nothing: the state is read before anything is applied, and the
        replay is left empty). One that does not fit this run's configuration stops the
        resume with an ApexError: every one would say the same."""
        first_loadable(newest.manifest_path.parent, lambda c: self._restore(c, step_limit), first=newest)

    @staticmethod
    @contextlib.contextmanager
    def _fitting(checkpoint: Checkpoint) -> Iterator[None]:
        """torch's errors of a state that does not fit this run's networks, as one line."""
        try:
            yield
        except (KeyError, RuntimeError, ValueError) as e:
            raise ApexError(
                f"checkpoint {checkpoint.name} does not fit this run's algorithm and model "
                f"({str(e).splitlines()[0]}): resume without changing algo, env or model"
            ) from None

    def _restore(self, checkpoint: Checkpoint, step_limit: int) -> None:
        """Continues from a verified checkpoint: networks, optimizer, counters, episode
        returns and, when it holds one, the replay. Raises CorruptCheckpoint if it cannot
        be loaded, ApexError if it does not fit this run's configuration."""
        start = time.monotonic()
        core, counters = self.runtime.learner, self.runtime.counters
        state = checkpoint.load_state()
        # Held to what actors' episode records are (a forged return would stop the run as solved).
        for stats in (state["episode_stats"], *state.get("policy_episode_stats", {}).values()):
            problem = EpisodeStats.problem(stats, step_limit, self.config.transport.max_abs_reward)
            if problem is not None:
                raise CorruptCheckpoint(f"{checkpoint.state_path.name}: {problem}")
        with self._fitting(checkpoint):
            core.check_state(state)  # before the replay: a refused checkpoint leaves it empty
        replay = core.checkpoint_replay
        if replay is not None and checkpoint.replay_path is not None and self.runtime.core is not None:
            checkpoint.load_replay(
                replay, self.runtime.core.schema
            )  # IncompatibleCheckpoint (the user's to fix) goes up
        with self._fitting(checkpoint):
            core.load_state_dict(state)
        counters.load_state_dict(state)
        self.elapsed_before = state["time"]
        self.runtime.version = core.updates
        self.resumed_from = checkpoint.name
        log.info(
            "resumed from %s in %.1fs: %d updates, %d env steps, replay of %d",
            checkpoint.name,
            time.monotonic() - start,
            core.updates,
            counters.env_steps,
            len(replay) if replay is not None else 0,
        )

    # -- writing

    def score(self) -> float | None:
        """return_mean_100 once it is over a full window of evaluation episodes (a mean of a
        few lucky episodes is no measure of a policy), else None."""
        with self.runtime.counters.lock:
            stats = self.runtime.counters.stats
            return stats.return_mean if stats.full_window else None

    def save(self, elapsed: float, background: bool = False) -> Saved:
        """Writes a checkpoint (in the background: the replay is copied piece by piece while
        training and ingest go on); a network that is not finite is never written (counted,
        logged). In a learner group every rank calls its part at once
        (``FollowerProcess._checkpoint``): the other ranks write their replay shards beside
        it, and the manifest lists them."""
        core = self.runtime.learner
        refusal = self._refusal()
        name = f"ckpt-{core.updates:09d}"
        shards = None
        if self.group is not None:  # the other ranks hear the name ("": nothing to write) whatever happens here
            self.group.broadcast(name.encode() if refusal is None else b"")
            shards = [e for e in (msgpack.unpackb(entry) for entry in self.group.gather(b"")[1:]) if e]
            if refusal is None and (failed := [e["error"] for e in shards if "error" in e]):
                self.writer.failures += 1
                log.error("checkpoint %s not written: a rank could not write its replay shard (%s)", name, failed[0])
                return Saved.REFUSED
        if refusal is not None:
            return refusal
        counters = self.runtime.counters
        with counters.lock:
            state: dict[str, Any] = {
                **core.state_dict(),
                **counters.state_dict(),
                "time": elapsed,
                "config": self.config.to_dict(),
            }
            stats = counters.stats
            score = stats.return_mean if stats.full_window else None  # as score(), with the same stats
        replay = core.checkpoint_replay
        written = self.writer.save(name, state, replay, background=background, score=score, shards=shards)
        return Saved.WRITTEN if written else Saved.BUSY

    def _refusal(self) -> Saved | None:
        """Why no checkpoint is written now, or None."""
        if self.writer.busy:
            return Saved.BUSY
        if not all_finite(self.runtime.learner.weights()):
            self.nonfinite_refused += 1
            self._bad_log.warning(
                "weights hold NaN or infinity: checkpoint not written (%d refused so far)", self.nonfinite_refused
            )
            return Saved.REFUSED
        return None
