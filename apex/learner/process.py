"""The learner process (rank 0): the control loop, weight broadcasts, metrics, checkpoints and
stop conditions around the algorithm's learner core (``apex.algos.<algo>``), which trains and
knows nothing of sockets, fed by the ingest thread (``apex.learner.runtime.TrainingRuntime``).
It welcomes the actors; in a data-parallel group it also routes their sessions to the other
ranks (``apex.learner.follower``), and decides for the group when to sync, checkpoint and stop
(``apex.learner.pace``)."""

from __future__ import annotations

import io
import logging
import shlex
import time
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from apex.checkpoint import Checkpoint
from apex.config import Config, StopConditions
from apex.errors import ApexError
from apex.learner.checkpointing import RunCheckpointer, Saved
from apex.learner.metrics import MetricsWriter, Rate, say_goodbye, write_summary
from apex.learner.pace import Clocks, GroupPace, Pace, SoloPace, stop_reason_now
from apex.learner.policy_figures import policy_metrics, policy_summary, replay_size
from apex.learner.runtime import (
    IDLE_WAIT_S,
    STOP_LINGER_S,
    TrainingRuntime,
    actor_seed,
    all_finite,
    learner_runtime,
    peak_rss_bytes,
    rss_bytes,
)
from apex.learner.tracking import Trackers
from apex.system.files import hold_run_directory
from apex.system.logs import RateLimitedLog
from apex.system.signals import StopSignals
from apex.training.distributed import Agreement, GroupBroken, LearnerGroup, store_refusals
from apex.transport import MAX_ENVS_PER_ACTOR, LearnerEndpoint, Rejected, is_loopback
from apex.transport.sessions import SessionSigner
from apex.wire.protocol import Message

log = logging.getLogger(__name__)


class LearnerProcess:
    """Owns the sockets, threads, signals and files around a learner core."""

    def __init__(
        self,
        config: Config,
        logdir: Path,
        bind_host: str,
        port: int | None,
        stop: StopConditions,
        resume: Checkpoint | None = None,
        resume_command: str | None = None,
        group: LearnerGroup | None = None,
    ) -> None:
        """``group``: this process is rank 0 of a data-parallel learner group (apex.training.distributed)."""
        self.config, self.group, self.bind_host, self.stop = config, group, bind_host, stop
        # What the closing line tells the user to run to go on.
        self.resume_command = resume_command or shlex.join(["apex", "learner", "--resume", str(logdir)])
        self.logdir = Path(logdir)
        self.spec, self.device = learner_runtime(config)
        base_port = port if port is not None else config.transport.port
        if not is_loopback(bind_host) and not config.transport.curve_dir:
            log.warning(
                "listening on %s without CURVE: anyone who can reach ports %d-%d can join this run and send "
                "it data; create keys with `apex keygen DIR` and pass --curve-dir DIR",
                bind_host,
                base_port,
                base_port + 2,
            )
        # Bind before building the core: a taken port fails at once, not after the replay
        # (gigabytes for Atari) has been allocated. Hellos wait for the first poll().
        self.endpoint = LearnerEndpoint(
            bind_host,
            base_port,
            self._actor_setup,
            config.transport,
            signer=SessionSigner(group.secret) if group is not None else None,
            # Where each rank takes trajectories: the endpoint routes each new session to one.
            routes=[None, *({"host": host, "port": port} for host, port in group.addresses[1:])] if group else None,
        )
        try:
            self._build(resume)
        except BaseException:
            self.endpoint.close()
            raise

    def _build(self, resume: Checkpoint | None) -> None:
        group = self.group
        self.runtime = TrainingRuntime(
            self.config, self.spec, self.device, self.endpoint.receiver, group.world_size if group else None
        )
        self.learner, self.ingest, self.times = self.runtime.learner, self.runtime.ingest, self.runtime.times
        self.pace: Pace = (
            GroupPace(group, self.runtime.pipeline, self.learner, lambda: self._sync_group(group), asks_sync=True)
            if group is not None
            else SoloPace(self.runtime.pipeline, self.learner)
        )
        self.group_replay_size = 0  # the other ranks' replays (or queues), as of the last sync
        # The group's steps the other ranks took without a batch of their own, as of the last sync.
        self.others_steps_without_batch = [0] * (group.world_size - 1) if group is not None else []
        self._group_broken = False
        self._metrics: MetricsWriter | None = None
        self._trackers = Trackers(None, self.logdir)  # logging.track's, once the run starts
        self._last: dict[str, float] = {}  # the metrics of the newest update
        self.first_update_unix_s: float | None = None
        self.nonfinite_published = 0  # publishes refused for non-finite weights
        self._bad_log = RateLimitedLog(log)
        self._signals = StopSignals()
        self.checkpointer = RunCheckpointer(self.config, self.runtime, self.logdir, group)
        self.checkpointer.start(resume, self.ingest.step_limit)
        if group is not None:  # the other ranks start from this one's state (and its checkpoint's shards)
            buffer = io.BytesIO()
            torch.save(self.learner.state_dict(), buffer)
            group.broadcast(
                msgpack.packb(
                    {
                        "logdir": str(self.logdir),
                        "resumed": self.checkpointer.resumed_from or "",
                        "state": buffer.getvalue(),
                    }
                )
            )

    @property
    def resumed_from(self) -> str | None:
        return self.checkpointer.resumed_from

    # -- actors

    def _actor_setup(self, hello: Message, index: int) -> dict[str, Any]:
        """What a joining actor is told in its welcome: the run's config, its environments
        and seed, and the algorithm's part (``LearnerCore.actor_setup``)."""
        num_envs = hello.fields["num_envs"] or self.config.actor.num_envs
        if not 1 <= num_envs <= MAX_ENVS_PER_ACTOR:
            raise Rejected(f"num_envs must be in 1..{MAX_ENVS_PER_ACTOR}, got {num_envs}")
        largest = self.runtime.largest_batch_bytes(num_envs)
        if largest > self.config.transport.max_message_bytes:
            raise Rejected(
                f"with {num_envs} environments a batch may reach {largest / 2**20:.0f} MiB, over "
                f"transport.max_message_bytes ({self.config.transport.max_message_bytes / 2**20:.0f} MiB): "
                "use fewer environments per actor or raise transport.max_message_bytes"
            )
        try:
            core = self.learner.actor_setup(index, num_envs)
        except ApexError as e:
            raise Rejected(str(e)) from None
        # (In a group the endpoint adds the rank its batches go to, which it chooses: not the hello.)
        return {
            "config": self.config.to_dict(),
            "num_envs": num_envs,
            "seed": actor_seed(self.config.seed, index),
            **core,
        }

    # -- the run

    def run(self) -> int:
        """Trains until a stop condition or a signal; returns the exit code."""
        with self._signals:
            try:
                self._lock_fd = hold_run_directory(self.logdir, lock=self.group is None or self.group.rank.is_leader)
                self._trackers = Trackers(self.config, self.logdir)
                self._metrics = MetricsWriter(self.logdir, trackers=self._trackers)
            except BaseException:
                self.endpoint.close()
                raise
            self._publish(self.runtime.version)
            self.runtime.start()
            # The run's clock goes on from the checkpoint's: metrics, stop conditions, summary.
            start = time.monotonic() - self.checkpointer.elapsed_before
            rates = Rate(self.runtime.counters.env_steps), Rate(self.learner.updates)
            self._say_hello(rates)
            stop_reason, stopped_together = None, False
            try:
                stop_reason, stopped_together = self._loop(start, rates)
            except GroupBroken as e:
                stop_reason, self._group_broken = str(e), True
                log.error(
                    "%s: the learner stops (apex run, compose or k8s start the group again from the newest checkpoint)",
                    e,
                )
            finally:
                self._finish(start, rates, stop_reason, stopped_together)
            return 1 if self._group_broken else self._signals.exit_code()

    def _say_hello(self, rates: tuple[Rate, Rate]) -> None:
        resumed = self.checkpointer.resumed_from
        log.info(
            "starting %s on %s: device %s, ports %d-%d on %s, logdir %s, %.1f MB for data%s",
            self.config.algo,
            self.config.env.id,
            self.device,
            self.endpoint.ports.control,
            self.endpoint.ports.weights,
            self.bind_host,
            self.logdir,
            self.learner.memory_nbytes / 1e6,
            f", resumed from {resumed}" if resumed else "",
        )
        if resumed is not None and self._metrics is not None:
            # A row at the resume point: `apex plot` drops what a killed predecessor logged
            # after it (times at or past this one), a history that was rolled back.
            self._metrics.write(self._metrics_row(self.checkpointer.elapsed_before, rates))

    def _loop(self, start: float, rates: tuple[Rate, Rate]) -> tuple[str, bool]:
        """Steps, publishes, writes metrics and checkpoints until this process or the group
        stops: (why, whether every rank stopped together)."""
        clocks = Clocks(self.config, self.learner.updates)
        stop_reason: str | None = None
        checkpoint_asked = False  # for the next agreement (alone: agreed at once)
        while True:
            self.endpoint.poll(0)
            agreed = self.pace.agree(
                self.runtime.pipeline.staged(), stop=stop_reason is not None, checkpoint=checkpoint_asked
            )
            if agreed.stop:
                return stop_reason or "another rank of the group was told to stop", True
            self._step(agreed)
            if clocks.publish_due(self.learner.updates):
                started = time.perf_counter()
                self._publish(self.learner.updates)
                self.times.add("publish", time.perf_counter() - started)
            now = time.monotonic()
            new_best = clocks.metrics_due(now) and self._write_metrics(now - start, rates, clocks)
            stop_reason = stop_reason_now(self.stop, self.runtime.counters, now - start)
            if self._signals.received:
                stop_reason = self._signals.reason()
            due = clocks.checkpoint_due(now, self.learner.updates) or new_best
            if agreed.checkpoint and self.checkpointer.save(now - start, background=True) is not Saved.BUSY:
                clocks.checkpointed(now, self.learner.updates)
            checkpoint_asked = due and not agreed.checkpoint and not self.checkpointer.writer.busy

    def _step(self, agreed: Agreement) -> None:
        """Trains the agreed steps, or sleeps until there is work when there are none."""
        started = time.perf_counter()
        if not agreed.steps:
            self.runtime.wait_for_work(lambda wake_fd: self.endpoint.wait(int(IDLE_WAIT_S * 1000), wake_fd))
            self.times.add("idle", time.perf_counter() - started)
        else:
            self.pace.train(agreed)
            self.times.steps += agreed.steps
            self.times.add("train", time.perf_counter() - started)
        for step_metrics in self.runtime.pipeline.results():
            self._last = step_metrics or self._last  # {}: the update was skipped as non-finite
        if self.first_update_unix_s is None and self.learner.updates:
            self.first_update_unix_s = time.time()

    def _write_metrics(self, elapsed: float, rates: tuple[Rate, Rate], clocks: Clocks) -> bool:
        """Writes a metrics row; whether the policy is better than every checkpoint so far
        (one is then written: apex eval's default)."""
        if self._metrics is not None:
            self._metrics.write(self._metrics_row(elapsed, rates))
        score, best = self.checkpointer.score(), self.checkpointer.writer.best_score  # of every checkpoint of the run
        return score is not None and (best is None or score > best) and clocks.best_may_be_saved(time.monotonic())

    def _finish(self, start: float, rates: tuple[Rate, Rate], stop_reason: str | None, stopped_together: bool) -> None:
        """Stops the actors (when the run is over), the threads, the metrics; writes the last
        checkpoint and the summary; says goodbye."""
        stopped_unix_s = time.time()
        run_over = not self._group_broken and stop_reason is not None
        if run_over and stop_reason is not None:
            # The run is over: every actor stops. Not when this learner fails (a broken
            # group, a bug): a restarted learner (apex run, compose, k8s) gets them back.
            self.endpoint.stop_actors(stop_reason)
        for step_metrics in self.runtime.stop():
            self._last = step_metrics or self._last
        wall = time.monotonic() - start
        if self._metrics is not None:
            self._metrics.write(self._metrics_row(wall, rates))
            self._metrics.close()
        self.checkpointer.writer.wait()
        if self.group is None or stopped_together:  # every rank is at this point: the shards too
            try:
                self.checkpointer.save(wall)
            except GroupBroken as e:  # a rank died at the very end: the checkpoint before stands
                log.error("%s: the last checkpoint was not written", e)
        summary = self._summary(wall, stop_reason, stopped_unix_s)
        write_summary(self.logdir, summary)
        self._trackers.finish(summary, self.logdir)
        if run_over:
            self._linger_for_stops()
        self.endpoint.close()
        self.runtime.close()
        if self.group is not None:
            self.group.close()
        say_goodbye(self.logdir, summary, self.resume_command)

    def _summary(self, wall: float, stop_reason: str | None, stopped_unix_s: float) -> dict[str, Any]:
        counters, stats = self.runtime.counters, self.runtime.counters.stats
        return {
            "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
            "data_nbytes_mb": round(self.learner.memory_nbytes / 2**20, 1),
            "env_steps": counters.env_steps,
            "learner_updates": self.learner.updates,
            "wall_seconds": round(wall, 2),
            "return_mean_100": stats.return_mean,
            "best_return_mean_100": stats.best_return_mean if stats.full_window else None,
            "stop_reason": stop_reason or "error",
            "resumed_from": self.checkpointer.resumed_from,
            "checkpoints_written": self.checkpointer.writer.written,
            "env_steps_by_host": dict(counters.env_steps_by_host),
            # Wall-clock times (Unix s) for what measures start-up and time to a threshold
            # from outside (`apex bench learn`): this process's first update and its stop.
            "first_update_unix_s": self.first_update_unix_s,
            "stopped_unix_s": stopped_unix_s,
            **({"policies": policy_summary(self.runtime)} if self.runtime.policies else {}),
        }

    def _sync_group(self, group: LearnerGroup) -> None:
        """Takes in what the other ranks counted since the last sync (env steps, episodes,
        policy lags, refusals) and tells them the sessions closed since and the weights
        version published."""
        reports = [msgpack.unpackb(data, strict_map_key=False) for data in group.gather(b"")[1:]]
        counters = self.runtime.counters
        with counters.lock:
            for report in reports:
                counters.add_rank_report(report)
        for report in reports:
            for reason, count in report["rejected"].items():
                self.endpoint.rejected.add(reason, count)
        self.group_replay_size = sum(report["replay_size"] for report in reports)
        self.others_steps_without_batch = [report["steps_without_batch"] for report in reports]
        group.broadcast(
            msgpack.packb({"version": self.runtime.version, "closed": self.endpoint.sessions.take_closed()})
        )

    def _publish(self, version: int) -> None:
        """Sends the weights to the actors, unless they are not finite (then never)."""
        weights = self.learner.weights()
        if not all_finite(weights):
            self.nonfinite_published += 1
            self._bad_log.warning(
                "weights hold NaN or infinity: not published (%d times so far)", self.nonfinite_published
            )
            return
        self.runtime.version = version
        self.endpoint.publish_weights(version, weights)

    def _linger_for_stops(self, seconds: float = STOP_LINGER_S) -> None:
        """Answers heartbeats with stop for a moment, so that every actor hears it."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.endpoint.actors_connected:
            self.endpoint.poll(int(IDLE_WAIT_S * 1000))

    def _metrics_row(self, elapsed: float, rates: tuple[Rate, Rate]) -> dict[str, Any]:
        counters, (step_rate, update_rate) = self.runtime.counters, rates
        with counters.lock:
            lags, stats = counters.take_lags(), counters.stats
            row: dict[str, Any] = {
                "time": round(elapsed, 2),
                "env_steps": counters.env_steps,
                "learner_updates": self.learner.updates,
                "env_steps_per_s": round(step_rate(counters.env_steps), 1),
                "updates_per_s": round(update_rate(self.learner.updates), 1),
                "episodes": stats.episodes,
                "return_mean_100": stats.return_mean,
                "eval_episodes_in_window": len(stats.eval_returns),
                "train_return_mean_100": stats.train_return_mean,
            }
        row["samples_per_s"] = round(row["updates_per_s"] * self.learner.samples_per_update, 1)
        row.update(policy_metrics(self.runtime) if self.runtime.policies else self.learner.metrics())
        row.update(self.times.take())
        if isinstance(self.pace, GroupPace) and self.group is not None:
            row["ranks"] = self.group.world_size
            row["group_replay_size"] = self.group_replay_size + replay_size(row)
            row["steps_without_batch_by_rank"] = [self.pace.steps_without_batch, *self.others_steps_without_batch]
            if (refusals := store_refusals()) is not None:
                row["group_store_refusals"] = refusals
        checkpoints = self.checkpointer.writer
        row.update(
            {
                "actors_connected": self.endpoint.actors_connected,
                "weights_version": self.runtime.version,
                "policy_lag_mean": round(float(np.mean(lags)), 1) if lags else None,
                "policy_lag_max": int(max(lags)) if lags else None,
                "rejected_messages": self.endpoint.rejected_messages,
                "metrics_write_failures": self._metrics.write_failures if self._metrics is not None else 0,
                "rejected_by_reason": self.endpoint.rejected.by_reason(),
                "internal_errors": self.ingest.internal_errors + self.runtime.prefetch_errors,
                "nonfinite_weights": self.nonfinite_published + self.checkpointer.nonfinite_refused,
                "checkpoints_written": checkpoints.written,
                "checkpoint_seconds": round(checkpoints.last_seconds, 2),
                "checkpoint_failures": checkpoints.failures,
                "learner_rss_mb": round(rss_bytes() / 2**20, 1),
                "learner_peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
                # a multi-agent run's are in its policies' figures
                **({} if self.runtime.policies else {k: round(v, 5) for k, v in self._last.items()}),
            }
        )
        return row
