"""The learner process: control loop, weight broadcasts, metrics, checkpoints and stop
conditions around the algorithm's learner core (``apex.algos.<algo>.Learner``), which trains
and knows nothing of sockets, fed by the ingest thread (``apex.learner.ingest``)."""

from __future__ import annotations

import contextlib
import io
import logging
import shlex
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from apex import algos
from apex.checkpoint import (
    Checkpoint,
    CheckpointWriter,
    CorruptCheckpoint,
    RunCheckpoints,
    best_and_newest,
    first_loadable,
)
from apex.config import Config, StopConditions
from apex.errors import ApexError
from apex.learner.ingest import Ingest, RunCounters
from apex.learner.metrics import EpisodeStats, MetricsWriter, Rate, closing_line, write_json_atomic
from apex.learner.runtime import (
    GROUP_SYNC_S,
    IDLE_WAIT_S,
    STOP_LINGER_S,
    actor_seed,
    all_finite,
    learner_runtime,
    peak_rss_bytes,
    rss_bytes,
)
from apex.system.logs import RateLimitedLog
from apex.system.signals import StopSignals
from apex.training.distributed import GradientAllReduce, GroupBroken, LearnerGroup, train_steps
from apex.training.pipeline import Pipeline, SectionTimes, Wakeup
from apex.transport import MAX_ENVS_PER_ACTOR, LearnerEndpoint, Rejected, is_loopback
from apex.transport.sessions import SessionSigner
from apex.wire.protocol import Message
from apex.wire.schema import UNKNOWN_STEP_LIMIT

log = logging.getLogger(__name__)


# Longest the main loop sleeps when it cannot train: its clocks (metrics, checkpoints, stop
# conditions, silent actors) and signals are looked at no later than this.
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
        self.config = config
        self.group = group
        self.bind_host = bind_host
        # What the closing line tells the user to run to go on.
        self.resume_command = resume_command or shlex.join(["apex", "learner", "--resume", str(logdir)])
        self.logdir = Path(logdir)
        self.stop = stop
        self.spec, self.device = learner_runtime(config)
        if not is_loopback(bind_host) and not config.transport.curve_dir:
            log.warning(
                "listening on %s without CURVE: anyone who can reach ports %d-%d can join this run and send "
                "it data; create keys with `apex keygen DIR` and pass --curve-dir DIR",
                bind_host,
                port or config.transport.port,
                (port or config.transport.port) + 2,
            )
        # Bind before building the core: a taken port fails at once, not after the replay
        # (gigabytes for Atari) has been allocated. Hellos wait for the first poll().
        self.endpoint = LearnerEndpoint(
            bind_host,
            port if port is not None else config.transport.port,
            self._actor_setup,
            config.transport,
            signer=SessionSigner(group.secret) if group is not None else None,
            # Where each rank takes trajectories: the endpoint routes each new session to one.
            routes=[None, *({"host": host, "port": port} for host, port in group.addresses[1:])] if group else None,
        )
        try:
            self.learner = algos.get(self.config.algo).learner().Learner(self.config, self.spec, self.device)
        except BaseException:
            self.endpoint.close()
            raise
        if group is not None:
            self.learner.all_reduce = GradientAllReduce(group.world_size)
        # The cores decompress frames themselves, straight into their storage.
        self.endpoint.receiver.lazy = True
        self.group_replay_size = 0  # the other ranks' replays (or queues), as of the last sync
        # Each rank's group steps taken without a batch of its own (rank 0's now, the others' as of the last sync).
        self.steps_without_batch = [0] * group.world_size if group is not None else []
        self._group_broken = False
        self.counters = RunCounters()
        self._metrics: MetricsWriter | None = None
        self.nonfinite_weights = 0  # publishes and checkpoints refused for non-finite weights
        self.prefetch_errors = 0  # our own bugs met while sampling: logged with a traceback
        self._bad_log = RateLimitedLog(log)
        self._bug_log = RateLimitedLog(log, interval_s=10.0)
        self._wakeup = Wakeup()
        self._version = 0  # of the weights last published
        self.ingest = Ingest(
            self.endpoint.receiver,
            self.learner,
            config,
            self.spec.max_episode_steps or UNKNOWN_STEP_LIMIT,
            self.counters,
            lambda: self._version,
        )
        self.times = SectionTimes()
        self.pipeline = Pipeline(self.learner, self.times, on_ready=self._wakeup.notify, on_error=self._prefetch_failed)
        self._signals = StopSignals()
        self._elapsed_before = 0.0  # run time of the checkpoint resumed from
        self.resumed_from: str | None = None
        try:
            self.checkpoints = CheckpointWriter(self.logdir / "checkpoints", config.learner.keep_checkpoints)
            if resume is not None:
                self._resume(resume)
            if group is not None:  # the other ranks start from this one's state (and its checkpoint's shards)
                buffer = io.BytesIO()
                torch.save(self.learner.state_dict(), buffer)
                group.broadcast(
                    msgpack.packb(
                        {"logdir": str(self.logdir), "resumed": self.resumed_from or "", "state": buffer.getvalue()}
                    )
                )
        except BaseException:
            self.endpoint.close()
            raise

    def _resume(self, newest: Checkpoint) -> None:
        """Restores the newest checkpoint that loads; one that cannot be loaded (forged,
        corrupt, inconsistent: CorruptCheckpoint) is set aside and the one before tried (a
        failed load changes nothing: the state is read before anything is applied, and the
        replay is left empty). One that does not fit this run's configuration stops the
        resume with an ApexError: every one would say the same."""
        first_loadable(newest.manifest_path.parent, self._restore, first=newest)

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

    def _restore(self, checkpoint: Checkpoint) -> None:
        """Continues from a verified checkpoint: networks, optimizer, counters, episode
        returns and, when it holds one, the replay. Raises CorruptCheckpoint if it cannot
        be loaded, ApexError if it does not fit this run's configuration."""
        start = time.monotonic()
        state = checkpoint.load_state()
        # Held to what actors' episode records are (a forged return would stop the run as solved).
        problem = EpisodeStats.problem(
            state["episode_stats"], self.ingest.step_limit, self.config.transport.max_abs_reward
        )
        if problem is not None:
            raise CorruptCheckpoint(f"{checkpoint.state_path.name}: {problem}")
        with self._fitting(checkpoint):
            self.learner.check_state(state)  # before the replay: a refused checkpoint leaves it empty
        replay = self.learner.checkpoint_replay
        if replay is not None and checkpoint.replay_path is not None:
            checkpoint.load_replay(replay, self.learner.schema)  # IncompatibleCheckpoint (the user's to fix) goes up
        with self._fitting(checkpoint):
            self.learner.load_state_dict(state)
        self.counters.load_state_dict(state)
        self._elapsed_before = state["time"]
        self._version = self.learner.updates
        self.resumed_from = checkpoint.name
        log.info(
            "resumed from %s in %.1fs: %d updates, %d env steps, replay of %d",
            checkpoint.name,
            time.monotonic() - start,
            self.learner.updates,
            self.counters.env_steps,
            len(replay) if replay is not None else 0,
        )

    # -- actors

    def _actor_setup(self, hello: Message, index: int) -> dict[str, Any]:
        """What a joining actor is told in its welcome: the run's config, its environments
        and seed, and the algorithm's part (``LearnerCore.actor_setup``)."""
        num_envs = hello.fields["num_envs"] or self.config.actor.num_envs
        if not 1 <= num_envs <= MAX_ENVS_PER_ACTOR:
            raise Rejected(f"num_envs must be in 1..{MAX_ENVS_PER_ACTOR}, got {num_envs}")
        largest = self.learner.schema.max_bytes(self.learner.batch_limits(num_envs))
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

    # -- main loop

    def run(self) -> int:
        """Trains until a stop condition or a signal; returns the exit code."""
        with self._signals:
            return self._run()

    def _run(self) -> int:
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
            metrics = self._metrics = MetricsWriter(self.logdir)
        except BaseException:
            self.endpoint.close()
            raise
        self._publish(self._version)
        self.ingest.start()
        self.pipeline.start()
        # The run's clock goes on from the checkpoint's: metrics, stop conditions, summary.
        start = time.monotonic() - self._elapsed_before
        every_updates = self.config.learner.checkpoint_interval_updates
        next_metrics = time.monotonic() + self.config.learner.metrics_interval_s
        next_checkpoint = time.monotonic() + self.config.learner.checkpoint_interval_s
        next_checkpoint_updates = (self.learner.updates // every_updates + 1) * every_updates if every_updates else None
        step_rate, update_rate = Rate(self.counters.env_steps), Rate(self.learner.updates)
        last: dict[str, float] = {}
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
            f", resumed from {self.resumed_from}" if self.resumed_from else "",
        )
        if self.resumed_from is not None:
            # A row at the resume point: `apex plot` drops what a killed predecessor logged
            # after it (times at or past this one), a history that was rolled back.
            metrics.write(self._metrics_row(self._elapsed_before, step_rate, update_rate, last))
        stop_reason = None
        # Wall-clock times (Unix s) for what measures start-up and time to a threshold from
        # outside (`apex bench learn`): this process's first update and its stop.
        first_update_unix_s = stopped_unix_s = None
        best_every = self.config.learner.best_checkpoint_interval_s
        last_checkpoint = time.monotonic()
        interval = self.config.learner.publish_interval
        next_publish = (self.learner.updates // interval + 1) * interval
        next_sync = time.monotonic()
        # In a group: a checkpoint asked for in the next agreement, and agreed to in the last.
        checkpoint_asked = agreed_checkpoint = stopped_together = False
        try:
            while True:
                self.endpoint.poll(0)
                if self.group is None:
                    if stop_reason is not None:
                        break
                    steps = min(1, self.pipeline.staged())
                else:
                    now = time.monotonic()
                    agreed = self.group.agree(
                        self.pipeline.staged(),
                        stop=stop_reason is not None,
                        checkpoint=checkpoint_asked,
                        sync=now >= next_sync,
                    )
                    if agreed.sync:
                        next_sync = now + GROUP_SYNC_S
                        self._sync_group(self.group)
                    if agreed.stop:
                        stop_reason = stop_reason or "another rank of the group was told to stop"
                        stopped_together = True
                        break
                    agreed_checkpoint, checkpoint_asked = agreed.checkpoint, False
                    steps = agreed.steps
                started = time.perf_counter()
                if not steps:
                    self._wait_for_work()
                    self.times.add("idle", time.perf_counter() - started)
                if self.group is None:
                    for _ in range(steps):
                        # (taken: `steps` were staged, and only this thread takes them)
                        if (staged := self.pipeline.take()) is not None:
                            self.pipeline.submit(self.learner.train(staged))  # written back by the prefetch thread
                else:  # the group's steps: on this rank's batches while it has them, then without
                    self.steps_without_batch[0] += train_steps(self.pipeline, self.learner, steps)
                self.times.steps += steps
                if steps:
                    self.times.add("train", time.perf_counter() - started)
                for step_metrics in self.pipeline.results():
                    last = step_metrics or last  # {}: the update was skipped as non-finite
                if first_update_unix_s is None and self.learner.updates:
                    first_update_unix_s = time.time()
                if self.learner.updates >= next_publish:
                    next_publish = (self.learner.updates // interval + 1) * interval
                    started = time.perf_counter()
                    self._publish(self.learner.updates)
                    self.times.add("publish", time.perf_counter() - started)
                now = time.monotonic()
                new_best = False
                if now >= next_metrics:
                    next_metrics = now + self.config.learner.metrics_interval_s
                    metrics.write(self._metrics_row(now - start, step_rate, update_rate, last))
                    # A policy better than every checkpoint so far is kept (apex eval's default).
                    score = self._score()
                    best = self.checkpoints.best_score  # of every checkpoint of the run, resumed ones too
                    new_best = (
                        best_every > 0
                        and score is not None
                        and (best is None or score > best)
                        and now - last_checkpoint >= best_every
                    )
                stop_reason = self._stop_reason(now - start)
                due_by_updates = next_checkpoint_updates is not None and self.learner.updates >= next_checkpoint_updates
                due = now >= next_checkpoint or due_by_updates or new_best
                if self.group is not None:  # the ranks write theirs together, once they agree to
                    checkpoint_asked, due = (
                        due and not agreed_checkpoint and not self.checkpoints.busy,
                        agreed_checkpoint,
                    )
                    agreed_checkpoint = False
                if due and self.save_checkpoint(now - start, background=True):
                    last_checkpoint = now
                    next_checkpoint = now + self.config.learner.checkpoint_interval_s
                    if every_updates:
                        next_checkpoint_updates = (self.learner.updates // every_updates + 1) * every_updates
                if self._signals.received:
                    stop_reason = self._signals.reason()
        except GroupBroken as e:
            stop_reason = str(e)
            self._group_broken = True
            log.error(
                "%s: the learner stops (apex run, compose or k8s start the group again from the newest checkpoint)", e
            )
        finally:
            stopped_unix_s = time.time()
            run_over = not self._group_broken and stop_reason is not None
            if run_over and stop_reason is not None:
                # The run is over: every actor stops. Not when this learner fails (a broken
                # group, a bug): a restarted learner (apex run, compose, k8s) gets them back.
                self.endpoint.stop_actors(stop_reason)
            self.pipeline.stop()
            for step_metrics in self.pipeline.results():
                last = step_metrics or last
            self.ingest.stop()
            wall = time.monotonic() - start
            metrics.write(self._metrics_row(wall, step_rate, update_rate, last))
            metrics.close()
            self.checkpoints.wait()
            if self.group is None or stopped_together:  # every rank is at this point: the shards too
                try:
                    self.save_checkpoint(wall)
                except GroupBroken as e:  # a rank died at the very end: the checkpoint before stands
                    log.error("%s: the last checkpoint was not written", e)
            stats = self.counters.stats
            summary: dict[str, Any] = {
                "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
                "data_nbytes_mb": round(self.learner.memory_nbytes / 2**20, 1),
                "env_steps": self.counters.env_steps,
                "learner_updates": self.learner.updates,
                "wall_seconds": round(wall, 2),
                "return_mean_100": stats.return_mean,
                "best_return_mean_100": stats.best_return_mean if stats.full_window else None,
                "stop_reason": stop_reason or "error",
                "resumed_from": self.resumed_from,
                "checkpoints_written": self.checkpoints.written,
                "env_steps_by_host": dict(self.counters.env_steps_by_host),
                "first_update_unix_s": first_update_unix_s,
                "stopped_unix_s": stopped_unix_s,
            }
            self._write_summary(summary)
            if run_over:
                self._linger_for_stops()
            self.endpoint.close()
            self._wakeup.close()
            if self.group is not None:
                self.group.close()
            self._say_goodbye(summary)
        return 1 if self._group_broken else self._signals.exit_code()

    def _sync_group(self, group: LearnerGroup) -> None:
        """Takes in what the other ranks counted since the last sync (env steps, episodes,
        policy lags, refusals) and tells them the sessions closed since and the weights
        version published."""
        reports = [msgpack.unpackb(data, strict_map_key=False) for data in group.gather(b"")[1:]]
        with self.counters.lock:
            counters = self.counters
            for report in reports:
                counters.env_steps += report["env_steps"]
                for host, steps in report["by_host"].items():
                    counters.env_steps_by_host[host] = counters.env_steps_by_host.get(host, 0) + steps
                for episode_return, is_eval in report["episodes"]:
                    counters.stats.add(episode_return, is_eval)
                counters.lags.extend(report["lags"])
        for report in reports:
            for reason, count in report["rejected"].items():
                self.endpoint.rejected.add(reason, count)
        self.group_replay_size = sum(report["replay_size"] for report in reports)
        self.steps_without_batch[1:] = [report["steps_without_batch"] for report in reports]
        group.broadcast(msgpack.packb({"version": self._version, "closed": self.endpoint.sessions.take_closed()}))

    def _prefetch_failed(self, error: BaseException) -> None:
        """Called by the prefetch thread inside its ``except``: our own bug, loud and counted."""
        self.prefetch_errors += 1
        self._bug_log.exception("sampling a batch failed (a bug in apex, please report it); continuing")

    def _wait_for_work(self) -> None:
        """Sleeps until a batch is staged (the prefetch thread's wake-up), a control message
        comes, or IDLE_WAIT_S passes."""
        self._wakeup.waiting = True
        try:
            if not self.pipeline.staged():  # staged before `waiting` was set
                self.endpoint.wait(int(IDLE_WAIT_S * 1000), self._wakeup.fileno())
        finally:
            self._wakeup.waiting = False
            self._wakeup.drain()

    def _say_goodbye(self, summary: dict[str, Any]) -> None:
        """The closing line: why the run stopped, its returns, its checkpoints, how to go on."""
        try:
            checkpoints = best_and_newest(self.logdir)
        except OSError:
            checkpoints = RunCheckpoints(None, None, None)
        log.info("%s", closing_line(summary, checkpoints, self.resume_command))

    def _write_summary(self, summary: dict[str, Any]) -> None:
        try:
            write_json_atomic(self.logdir / "summary.json", summary)
        except OSError as e:  # a full disk: the run's end is logged all the same
            log.error("could not write %s: %s", self.logdir / "summary.json", e)

    def _publish(self, version: int) -> None:
        """Sends the weights to the actors, unless they are not finite (then never)."""
        weights = self.learner.weights()
        if not all_finite(weights):
            self.nonfinite_weights += 1
            self._bad_log.warning(
                "weights hold NaN or infinity: not published (%d times so far)", self.nonfinite_weights
            )
            return
        self._version = version
        self.endpoint.publish_weights(version, weights)

    def _linger_for_stops(self, seconds: float = STOP_LINGER_S) -> None:
        """Answers heartbeats with stop for a moment, so that every actor hears it."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.endpoint.actors_connected:
            self.endpoint.poll(int(IDLE_WAIT_S * 1000))

    def _stop_reason(self, elapsed: float) -> str | None:
        s = self.stop
        with self.counters.lock:
            mean, full = self.counters.stats.return_mean, self.counters.stats.full_window
        if s.return_mean is not None and full and mean is not None and mean >= s.return_mean:
            return f"return_mean_100 {mean:.1f} >= {s.return_mean}"
        if s.seconds is not None and elapsed >= s.seconds:
            return f"{s.seconds} seconds"
        if s.env_steps is not None and self.counters.env_steps >= s.env_steps:
            return f"{s.env_steps} env steps"
        return None

    def _metrics_row(
        self, elapsed: float, step_rate: Rate, update_rate: Rate, last: dict[str, float]
    ) -> dict[str, Any]:
        counters = self.counters
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
        row.update(self.learner.metrics())
        row.update(self.times.take())
        row.update(
            {
                "actors_connected": self.endpoint.actors_connected,
                **(
                    {
                        "ranks": self.group.world_size,
                        "group_replay_size": self.group_replay_size + row.get("replay_size", 0),
                        "steps_without_batch_by_rank": list(self.steps_without_batch),
                    }
                    if self.group is not None
                    else {}
                ),
                "weights_version": self._version,
                "policy_lag_mean": round(float(np.mean(lags)), 1) if lags else None,
                "policy_lag_max": int(max(lags)) if lags else None,
                "rejected_messages": self.endpoint.rejected_messages,
                "metrics_write_failures": self._metrics.write_failures if self._metrics is not None else 0,
                "rejected_by_reason": self.endpoint.rejected.by_reason(),
                "internal_errors": self.ingest.internal_errors + self.prefetch_errors,
                "nonfinite_weights": self.nonfinite_weights,
                "checkpoints_written": self.checkpoints.written,
                "checkpoint_seconds": round(self.checkpoints.last_seconds, 2),
                "checkpoint_failures": self.checkpoints.failures,
                "learner_rss_mb": round(rss_bytes() / 2**20, 1),
                "learner_peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
                **{k: round(v, 5) for k, v in last.items()},
            }
        )
        return row

    def _score(self) -> float | None:
        """return_mean_100 once it is over a full window of evaluation episodes (a mean of a
        few lucky episodes is no measure of a policy), else None."""
        with self.counters.lock:
            stats = self.counters.stats
            return stats.return_mean if stats.full_window else None

    def save_checkpoint(self, elapsed: float, background: bool = False) -> bool:
        """Writes a checkpoint (in the background: the replay is copied piece by piece while
        training and ingest go on). False if the previous one is still being written (try
        again soon); a network that is not finite is never written (counted, logged). In a
        learner group every rank calls its part at once (``FollowerProcess._checkpoint``): the
        other ranks write their replay shards beside it, and the manifest lists them."""
        if self.checkpoints.busy:
            written = False
        elif not all_finite(self.learner.weights()):
            self.nonfinite_weights += 1
            self._bad_log.warning(
                "weights hold NaN or infinity: checkpoint not written (%d refused so far)", self.nonfinite_weights
            )
            written = True
        else:
            written = None
        name = f"ckpt-{self.learner.updates:09d}"
        shards = None
        if self.group is not None:
            self.group.broadcast(name.encode() if written is None else b"")  # "": nothing to write
            shards = [e for e in (msgpack.unpackb(entry) for entry in self.group.gather(b"")[1:]) if e]
            if written is None and (failed := [e["error"] for e in shards if "error" in e]):
                self.checkpoints.failures += 1
                log.error("checkpoint %s not written: a rank could not write its replay shard (%s)", name, failed[0])
                return True
        if written is not None:
            return written
        with self.counters.lock:
            state = {
                **self.learner.state_dict(),
                **self.counters.state_dict(),
                "time": elapsed,
                "config": self.config.to_dict(),
            }
            stats = self.counters.stats
            score = stats.return_mean if stats.full_window else None  # as _score, with the same stats
        return self.checkpoints.save(
            name, state, self.learner.checkpoint_replay, background=background, score=score, shards=shards
        )
