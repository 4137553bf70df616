"""A follower rank of a data-parallel learner group (``apex learner --rank R``, R > 0).

Rank 0 is the learner actors talk to (``apex.learner.process.LearnerProcess``): it welcomes them,
publishes weights, writes metrics, summary and checkpoints, and decides when to stop. A
follower binds one port, the trajectory stream of the actors rank 0 sends to it, keeps its own
replay shard (Ape-X) or unroll queue (IMPALA), and trains in step with the others: each loop,
one collective agrees how many steps every rank takes now (the most batches any has staged: a
rank with fewer takes the rest without a batch, adding no gradient), and whether to stop, sync
or checkpoint (this rank's replay shard beside rank 0's files); each
step all-reduces the gradients (``apex.training.distributed``). At a
sync it hands rank 0 what its ingest counted (env steps, episodes, policy lags, refusals) and
hears which sessions rank 0 closed and which weights it published.
"""

from __future__ import annotations

import io
import logging
import select
from pathlib import Path
from typing import Any

import msgpack
import torch

from apex.checkpoint import Checkpoint, CorruptCheckpoint, IncompatibleCheckpoint
from apex.checkpoint.manifest import read_manifest
from apex.checkpoint.writer import write_shard
from apex.config import Config
from apex.learner.ingest import RunCounters
from apex.learner.metrics import EpisodeStats
from apex.learner.pace import GroupPace
from apex.learner.policy_figures import replay_size
from apex.learner.runtime import IDLE_WAIT_S, TrainingRuntime, learner_runtime
from apex.system.signals import StopSignals
from apex.training.distributed import GroupBroken, LearnerGroup
from apex.transport import Ports
from apex.transport.learner_side import TrajectoryEndpoint
from apex.transport.sessions import RejectCounter, SessionSigner, SignedSessions

log = logging.getLogger(__name__)


class RecordedStats(EpisodeStats):
    """Episode statistics that also keep each episode until rank 0 has been told of it."""

    def __init__(self) -> None:
        super().__init__()
        self.unsent: list[tuple[float, bool]] = []

    def add(self, episode_return: float, is_eval: bool) -> None:
        super().add(episode_return, is_eval)
        self.unsent.append((float(episode_return), bool(is_eval)))


class RankCounts:
    """What a follower's ingest counted since the last sync (``take``), for rank 0."""

    def __init__(self, counters: RunCounters, rejected: RejectCounter) -> None:
        """Keeps ``counters``' episodes until rank 0 has been told of them."""
        self.counters = counters
        self.stats = counters.stats = RecordedStats()
        self.policy_stats = {name: RecordedStats() for name in counters.policy_stats}
        counters.policy_stats = dict(self.policy_stats)  # what ingest adds each policy's episodes to
        self.rejected = rejected
        self._sent_steps = 0
        self._sent_by_host: dict[str, int] = {}
        self._sent_rejected: dict[str, int] = {}

    def take(self, extra: dict[str, Any]) -> bytes:
        c = self.counters
        with c.lock:
            steps, by_host = c.env_steps, dict(c.env_steps_by_host)
            episodes, self.stats.unsent = self.stats.unsent, []
            by_policy = {name: stats.unsent for name, stats in self.policy_stats.items()}
            for stats in self.policy_stats.values():
                stats.unsent = []
            matches, c.matches = c.matches, []  # rank 0's self-play pool rates them
            lags = c.take_lags()
        rejected = self.rejected.by_reason()
        report = {
            "env_steps": steps - self._sent_steps,
            "by_host": {
                h: n - self._sent_by_host.get(h, 0) for h, n in by_host.items() if n != self._sent_by_host.get(h, 0)
            },
            "episodes": episodes,
            "policy_episodes": by_policy,
            "matches": matches,
            "lags": lags,
            "rejected": {
                r: n - self._sent_rejected.get(r, 0) for r, n in rejected.items() if n != self._sent_rejected.get(r, 0)
            },
            **extra,
        }
        self._sent_steps, self._sent_by_host, self._sent_rejected = steps, by_host, rejected
        packed: bytes = msgpack.packb(report)
        return packed


class FollowerProcess:
    """A rank > 0: its trajectory socket, ingest and prefetch threads, and the step loop."""

    def __init__(self, config: Config, logdir: Path, bind_host: str, port: int, group: LearnerGroup) -> None:
        self.config = config
        self.logdir = Path(logdir)
        self.group = group
        self.spec, self.device = learner_runtime(config)
        self.sessions = SignedSessions(SessionSigner(group.secret), group.rank.rank)
        base = port if port is not None else config.transport.port
        own_port = group.addresses[group.rank.rank][1]
        self.endpoint = TrajectoryEndpoint(bind_host, own_port, Ports.from_base(base), config.transport, self.sessions)
        try:
            self.runtime = TrainingRuntime(config, self.spec, self.device, self.endpoint.receiver, group.world_size)
            self.learner = self.runtime.learner
            # its stats keep episodes for rank 0
            self.counts = RankCounts(self.runtime.counters, self.endpoint.rejected)
            self.pace = GroupPace(group, self.runtime.pipeline, self.learner, self._sync, asks_sync=False)
            self._signals = StopSignals()
            self.checkpoint_dir = self.logdir / "checkpoints"
            self._start_as_rank_0()
        except BaseException:
            self.endpoint.close()
            raise

    def run(self) -> int:
        """Trains with the group until rank 0 says stop; 1 if the group broke."""
        rank = self.group.rank.rank
        log.info(
            "rank %d of %d: trajectories on port %d, device %s",
            rank,
            self.group.world_size,
            self.group.addresses[rank][1],
            self.device,
        )
        with self._signals:
            self.runtime.start()
            code, stopped_together = 0, False
            try:
                while True:
                    agreed = self.pace.agree(
                        self.runtime.pipeline.staged(), stop=self._signals.received, checkpoint=False
                    )
                    if agreed.stop:
                        stopped_together = True
                        break
                    self.pace.train(agreed)
                    self.runtime.pipeline.results()
                    if agreed.checkpoint:  # where rank 0 writes its part: after the steps
                        self._checkpoint()
                    if not agreed.steps:
                        self.runtime.wait_for_work(lambda wake_fd: select.select([wake_fd], [], [], IDLE_WAIT_S))
            except GroupBroken as e:
                log.error("%s; rank %d stops", e, rank)
                code = 1
            finally:
                self.runtime.stop()
                if stopped_together:  # rank 0 writes the last checkpoint: this rank's shard with it
                    try:
                        self._checkpoint()
                    except GroupBroken as e:
                        log.error("%s; the last checkpoint is rank 0's alone", e)
                        code = 1
                self.endpoint.close()
                self.runtime.close()
                self.group.close()
        log.info(
            "rank %d stopped: %d updates, %d env steps of its actors",
            rank,
            self.learner.updates,
            self.runtime.counters.env_steps,
        )
        return code

    def _checkpoint(self) -> None:
        """This rank's part of a group checkpoint: its replay shard beside rank 0's files
        (nothing when rank 0 writes nothing), its manifest entry (or the error) to rank 0."""
        name = self.group.broadcast(None).decode()
        entry: dict[str, Any] = {}  # none: nothing to write, or no replay to keep (IMPALA, checkpoint_replay off)
        replay = self.learner.checkpoint_replay
        if name and replay is not None:
            try:
                entry = write_shard(self.checkpoint_dir, name, self.group.rank.rank, replay)
            except OSError as e:
                entry = {"error": f"rank {self.group.rank.rank}: {e}"}
                log.error("could not write the replay shard of %s: %s", name, e)
        self.group.gather(msgpack.packb(entry))

    def _start_as_rank_0(self) -> None:
        """Takes rank 0's networks, optimizer and counters (its checkpoint's, when it resumed)
        and, after a resume, this rank's replay shard of the same checkpoint."""
        start = msgpack.unpackb(self.group.broadcast(None))
        self.checkpoint_dir = Path(start["logdir"]) / "checkpoints"
        if start["resumed"]:
            self._load_shard(start["resumed"])
        state = torch.load(io.BytesIO(start["state"]), weights_only=True)
        self.learner.load_state_dict(state)

    def _load_shard(self, name: str) -> None:
        rank = self.group.rank.rank
        replay, core = self.learner.checkpoint_replay, self.runtime.core
        if replay is None or core is None:  # nothing of this rank's is kept in checkpoints
            return
        try:
            checkpoint = Checkpoint(
                self.checkpoint_dir / f"{name}.json", read_manifest(self.checkpoint_dir / f"{name}.json")
            )
            if checkpoint.ranks != self.group.world_size:
                log.warning(
                    "%s was written by %d rank(s), this group has %d: rank %d starts with an empty replay",
                    name,
                    checkpoint.ranks,
                    self.group.world_size,
                    rank,
                )
                return
            checkpoint.load_shard(rank, replay, core.schema)
            log.info("rank %d restored its replay shard of %s: %d transitions", rank, name, len(replay))
        except (CorruptCheckpoint, IncompatibleCheckpoint) as e:
            log.warning("rank %d starts with an empty replay: its shard of %s cannot be loaded (%s)", rank, name, e)

    def _sync(self) -> None:
        """Tells rank 0 what was counted; hears the closed sessions and the weights version."""
        self.group.gather(
            self.counts.take(
                {
                    "replay_size": replay_size(self.learner.metrics()),
                    "steps_without_batch": self.pace.steps_without_batch,
                }
            )
        )
        news = msgpack.unpackb(self.group.broadcast(None))
        self.runtime.version = news["version"]
        self.sessions.close_tokens(news["closed"])
