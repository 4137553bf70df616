"""The learner process: ingest thread, control loop, weight broadcasts, metrics,
checkpoints and stop conditions around the algorithm's learner core
(``apex.algos.<algo>.Learner``), which trains and knows nothing of sockets."""

from __future__ import annotations

import logging
import os
import resource
import shlex
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import torch

from apex import algos
from apex.checkpoint import Checkpoint, CheckpointWriter, RunCheckpoints, best_and_newest, first_loadable
from apex.config import Config, StopConditions
from apex.envs import env_spec
from apex.errors import ApexError, ProtocolError
from apex.malloc import keep_large_blocks
from apex.metrics import EpisodeStats, MetricsWriter, Rate, closing_line, write_json_atomic
from apex.logs import RateLimitedLog
from apex.protocol import Message
from apex.schema import UNKNOWN_STEP_LIMIT, check_episodes
from apex.signals import StopSignals
from apex.transport import MAX_ENVS_PER_ACTOR, LearnerEndpoint, Rejected, Session, is_loopback

log = logging.getLogger(__name__)

INGEST_GROUP = 8  # batches already waiting that are inserted together
# Longest the main loop sleeps when it cannot train: its clocks (metrics, checkpoints, stop
# conditions, silent actors) and signals are looked at no later than this.
IDLE_WAIT_S = 0.05
INGEST_WAIT_S = 0.05  # longest the ingest thread waits (for room, for a batch) before looking at its stop flag
STOP_LINGER_S = 0.5  # heartbeats answered with stop after the run ends, so that every actor hears it
# An actor's seed from the run's and its index: far apart for neighbouring indices and runs
# (two primes), so that no two actors' environments share a seed sequence.
SEED_RUN_FACTOR = 1_000_003
SEED_ACTOR_FACTOR = 10_007


def actor_seed(run_seed: int, actor_index: int) -> int:
    return (run_seed * SEED_RUN_FACTOR + SEED_ACTOR_FACTOR * (actor_index + 1)) % 2**63


class Wakeup:
    """A pipe that the ingest thread writes a byte to when data lands while the main loop
    waits, so that the loop blocks on one ZeroMQ poller for control messages and data alike
    (instead of polling both in turn every few milliseconds)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self.waiting = False  # set by the main loop around its wait; the ingest thread writes only then

    def fileno(self) -> int:
        return self._read

    def notify(self) -> None:
        if self.waiting:
            try:
                os.write(self._write, b"\0")
            except BlockingIOError:  # the pipe is full of wake-ups already
                pass

    def drain(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self._read)
        os.close(self._write)


def all_finite(arrays: dict[str, np.ndarray]) -> bool:
    """Whether every floating-point array holds only finite values."""
    return all(np.isfinite(a).all() for a in arrays.values() if a.dtype.kind == "f")


def rss_bytes() -> int:
    """Resident memory of this process now."""
    return psutil.Process().memory_info().rss


def peak_rss_bytes() -> int:
    # psutil has no peak resident size on Linux; getrusage has (in KiB there).
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ApexError(f"learner.device={name} but CUDA is not available: use learner.device=auto or cpu")
    return device


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
    ) -> None:
        self.config = config
        self.bind_host = bind_host
        # What the closing line tells the user to run to go on.
        self.resume_command = resume_command or shlex.join(["apex", "learner", "--resume", str(logdir)])
        self.logdir = Path(logdir)
        self.stop = stop
        self.spec = env_spec(config.env, config.algo)
        self.device = pick_device(config.learner.device)
        torch.set_num_threads(config.learner.torch_threads)
        keep_large_blocks()
        if not is_loopback(bind_host) and not config.transport.curve_dir:
            log.warning("listening on %s without CURVE: anyone who can reach ports %d-%d can join this run and send "
                        "it data; create keys with `apex keygen DIR` and pass --curve-dir DIR", bind_host,
                        port or config.transport.port, (port or config.transport.port) + 2)
        # Bind before building the core: a taken port fails at once, not after the replay
        # (gigabytes for Atari) has been allocated. Hellos wait for the first poll().
        self.endpoint = LearnerEndpoint(
            bind_host, port if port is not None else config.transport.port, self._welcome,
            config.transport,
        )
        try:
            self.learner = algos.get(self.config.algo).learner().Learner(self.config, self.spec, self.device)
        except BaseException:
            self.endpoint.close()
            raise
        # The cores decompress frames themselves, straight into their storage.
        self.endpoint.receiver.lazy = True
        self.stats = EpisodeStats()
        self._stats_lock = threading.Lock()
        self.env_steps = 0
        self.env_steps_by_host: dict[str, int] = {}  # by the sending actor's address
        self._metrics: MetricsWriter | None = None
        self.internal_errors = 0  # our own bugs met while ingesting: logged with a traceback
        self.nonfinite_weights = 0  # publishes and checkpoints refused for non-finite weights
        self._step_limit = self.spec.max_episode_steps or UNKNOWN_STEP_LIMIT
        self._lags: list[int] = []
        self._bad_log = RateLimitedLog(log)
        self._bug_log = RateLimitedLog(log, interval_s=10.0)
        self._stop_ingest = threading.Event()
        self._ingest_thread: threading.Thread | None = None
        self._wakeup = Wakeup()
        self._version = 0  # of the weights last published
        self._signals = StopSignals()
        self._elapsed_before = 0.0  # run time of the checkpoint resumed from
        self.resumed_from = None
        try:
            self.checkpoints = CheckpointWriter(self.logdir / "checkpoints", config.learner.keep_checkpoints)
            if resume is not None:
                self._resume(resume)
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

    def _restore(self, checkpoint: Checkpoint) -> None:
        """Continues from a verified checkpoint: networks, optimizer, counters, episode
        returns and, when it holds one, the replay. Raises CorruptCheckpoint if it cannot
        be loaded, ApexError if it does not fit this run's configuration."""
        start = time.monotonic()
        state = checkpoint.load_state()
        replay = self.learner.checkpoint_replay
        if replay is not None and checkpoint.replay_path is not None:
            checkpoint.load_replay(replay)  # IncompatibleCheckpoint (the user's to fix) goes up as it is
        try:
            self.learner.load_state_dict(state)
        except (KeyError, RuntimeError, ValueError) as e:
            raise ApexError(f"checkpoint {checkpoint.name} does not fit this run's algorithm and model "
                            f"({str(e).splitlines()[0]}): resume without changing algo, env or model") from None
        self.env_steps = state["env_steps"]
        self.env_steps_by_host = dict(state.get("env_steps_by_host", {}))
        self.stats.load_state_dict(state["episode_stats"])
        self._elapsed_before = state["time"]
        self._version = self.learner.updates
        self.resumed_from = checkpoint.name
        log.info("resumed from %s in %.1fs: %d updates, %d env steps, replay of %d",
                 checkpoint.name, time.monotonic() - start, self.learner.updates, self.env_steps,
                 len(replay) if replay is not None else 0)

    # -- actors

    def _welcome(self, hello: Message, index: int) -> dict:
        num_envs = hello.fields["num_envs"] or self.config.actor.num_envs
        if not 1 <= num_envs <= MAX_ENVS_PER_ACTOR:
            raise Rejected(f"num_envs must be in 1..{MAX_ENVS_PER_ACTOR}, got {num_envs}")
        largest = self.learner.schema.max_bytes(self.learner.batch_limits(num_envs))
        if largest > self.config.transport.max_message_bytes:
            raise Rejected(f"with {num_envs} environments a batch may reach {largest / 2**20:.0f} MiB, over "
                           f"transport.max_message_bytes ({self.config.transport.max_message_bytes / 2**20:.0f} MiB): "
                           "use fewer environments per actor or raise transport.max_message_bytes")
        try:
            core = self.learner.welcome(index, num_envs)
        except ApexError as e:
            raise Rejected(str(e)) from None
        return {
            "config": self.config.to_dict(),
            "num_envs": num_envs,
            "seed": actor_seed(self.config.seed, index),
            **core,
        }

    def start_ingest(self) -> None:
        """Starts the ingest thread: batches from the trajectory stream into the learner core.
        (One thread: a second one that decoded while this one inserted measured slower,
        the two fighting over the GIL.)"""
        self._stop_ingest.clear()
        self._ingest_thread = threading.Thread(target=self._ingest, name="ingest", daemon=True)
        self._ingest_thread.start()

    def stop_ingest(self) -> None:
        self._stop_ingest.set()
        if self._ingest_thread is not None:
            self._ingest_thread.join(timeout=5)

    def _ingest(self) -> None:
        while not self._stop_ingest.is_set():
            try:
                self._ingest_some()
            except Exception:  # our own bug, not the sender's: loud, counted apart, and ingest goes on
                self.internal_errors += 1
                self._bug_log.exception("ingest failed (a bug in apex, please report it); continuing")

    def _ingest_some(self) -> None:
        receiver = self.endpoint.receiver
        while not self._stop_ingest.is_set():
            if not self.learner.wait_to_insert(timeout=INGEST_WAIT_S):
                continue
            msg = receiver.recv(timeout_ms=int(INGEST_WAIT_S * 1000))
            if msg is None:
                continue
            # Whatever else is already waiting goes in with it: one insert for several
            # small batches pays the bookkeeping once.
            group = [msg]
            while len(group) < INGEST_GROUP and (more := receiver.recv(timeout_ms=0)) is not None:
                group.append(more)
            accepted = []
            for m in group:
                try:
                    accepted.append((m, *self._validate(m)))
                except ProtocolError as e:
                    receiver.reject(e)
            errors = self.learner.insert_many([arrays for _, arrays, *_ in accepted])
            self._wakeup.notify()
            with self._stats_lock:
                for (m, _, env_steps, episodes, used), error in zip(accepted, errors):
                    session: Session = m.session
                    if error is not None:
                        session.step_budget -= env_steps - used  # what _validate granted it
                        receiver.reject(error)
                        continue
                    session.env_steps += env_steps
                    session.episodes += len(episodes)
                    self.env_steps += env_steps
                    host = m.peer or "unknown"
                    self.env_steps_by_host[host] = self.env_steps_by_host.get(host, 0) + env_steps
                    for episode_return, _length, is_eval in episodes:
                        self.stats.add(episode_return, is_eval)
                    if 0 <= m.fields["weights_version"] <= self._version:  # an older learner's versions say nothing
                        self._lags.append(self._version - m.fields["weights_version"])

    def _validate(self, msg: Message) -> tuple[dict, int, list, int]:
        """A batch checked against the algorithm's schema and its session's limits: (arrays
        as stored, env steps it stands for, its episode records, their steps). Raises
        ProtocolError."""
        session: Session = msg.session
        if not session.limits:
            session.limits = self.learner.batch_limits(session.num_envs)
            # Episodes under way when the session began were partly played before it.
            session.step_budget = session.num_envs * self._step_limit
        arrays, sizes = self.learner.schema.validate(msg.arrays, session.limits, msg.layout)
        env_steps = self.learner.env_steps(sizes)
        episodes, used = check_episodes(msg.fields["info"], max_episodes=env_steps, step_limit=self._step_limit,
                                        max_abs_reward=self.config.transport.max_abs_reward,
                                        step_budget=session.step_budget + env_steps)
        session.step_budget += env_steps - used
        return arrays, env_steps, episodes, used

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
        self.start_ingest()
        # The run's clock goes on from the checkpoint's: metrics, stop conditions, summary.
        start = time.monotonic() - self._elapsed_before
        every_updates = self.config.learner.checkpoint_interval_updates
        next_metrics = time.monotonic() + self.config.learner.metrics_interval_s
        next_checkpoint = time.monotonic() + self.config.learner.checkpoint_interval_s
        next_checkpoint_updates = (self.learner.updates // every_updates + 1) * every_updates if every_updates else None
        step_rate, update_rate = Rate(self.env_steps), Rate(self.learner.updates)
        last: dict[str, float] = {}
        log.info("starting %s on %s: device %s, ports %d-%d on %s, logdir %s, %.1f MB for data%s",
                 self.config.algo, self.config.env.id, self.device, self.endpoint.ports.control,
                 self.endpoint.ports.weights, self.bind_host, self.logdir, self.learner.memory_nbytes / 1e6,
                 f", resumed from {self.resumed_from}" if self.resumed_from else "")
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
        try:
            while stop_reason is None:
                self.endpoint.poll(0)
                if not self.learner.wait_to_step(timeout=0):
                    self._wait_for_work()
                else:
                    updates = self.learner.updates
                    last = self.learner.step() or last  # {}: the update was skipped as non-finite
                    if first_update_unix_s is None and self.learner.updates != updates:
                        first_update_unix_s = time.time()
                    if self.learner.updates != updates and self.learner.updates % self.config.learner.publish_interval == 0:
                        self._publish(self.learner.updates)
                now = time.monotonic()
                new_best = False
                if now >= next_metrics:
                    next_metrics = now + self.config.learner.metrics_interval_s
                    metrics.write(self._metrics_row(now - start, step_rate, update_rate, last))
                    # A policy better than every checkpoint so far is kept (apex eval's default).
                    score = self._score()
                    best = self.checkpoints.best_score  # of every checkpoint of the run, resumed ones too
                    new_best = (best_every > 0 and score is not None and (best is None or score > best)
                                and now - last_checkpoint >= best_every)
                stop_reason = self._stop_reason(now - start)
                due_by_updates = next_checkpoint_updates is not None and self.learner.updates >= next_checkpoint_updates
                if (now >= next_checkpoint or due_by_updates or new_best) and self.save_checkpoint(now - start, background=True):
                    last_checkpoint = now
                    next_checkpoint = now + self.config.learner.checkpoint_interval_s
                    if every_updates:
                        next_checkpoint_updates = (self.learner.updates // every_updates + 1) * every_updates
                if self._signals.received:
                    stop_reason = self._signals.reason()
        finally:
            stopped_unix_s = time.time()
            self.endpoint.stop_actors(stop_reason or "learner error")
            self.stop_ingest()
            wall = time.monotonic() - start
            metrics.write(self._metrics_row(wall, step_rate, update_rate, last))
            metrics.close()
            self.checkpoints.wait()
            self.save_checkpoint(wall)
            summary = {
                "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
                "data_nbytes_mb": round(self.learner.memory_nbytes / 2**20, 1),
                "env_steps": self.env_steps,
                "learner_updates": self.learner.updates,
                "wall_seconds": round(wall, 2),
                "return_mean_100": self.stats.return_mean,
                "best_return_mean_100": self.stats.best_return_mean if self.stats.full_window else None,
                "stop_reason": stop_reason or "error",
                "resumed_from": self.resumed_from,
                "checkpoints_written": self.checkpoints.written,
                "env_steps_by_host": dict(self.env_steps_by_host),
                "first_update_unix_s": first_update_unix_s,
                "stopped_unix_s": stopped_unix_s,
            }
            self._write_summary(summary)
            self._linger_for_stops()
            self.endpoint.close()
            self._wakeup.close()
            self._say_goodbye(summary)
        return self._signals.exit_code()

    def _wait_for_work(self) -> None:
        """Sleeps until data lands (the ingest thread's wake-up), a control message comes,
        or IDLE_WAIT_S passes."""
        self._wakeup.waiting = True
        try:
            if not self.learner.wait_to_step(timeout=0):  # data that landed before `waiting` was set
                self.endpoint.wait(int(IDLE_WAIT_S * 1000), self._wakeup.fileno())
        finally:
            self._wakeup.waiting = False
            self._wakeup.drain()

    def _say_goodbye(self, summary: dict) -> None:
        """The closing line: why the run stopped, its returns, its checkpoints, how to go on."""
        try:
            checkpoints = best_and_newest(self.logdir)
        except OSError:
            checkpoints = RunCheckpoints(None, None, None)
        log.info("%s", closing_line(summary, checkpoints, self.resume_command))

    def _write_summary(self, summary: dict) -> None:
        try:
            write_json_atomic(self.logdir / "summary.json", summary)
        except OSError as e:  # a full disk: the run's end is logged all the same
            log.error("could not write %s: %s", self.logdir / "summary.json", e)

    def _publish(self, version: int) -> None:
        """Sends the weights to the actors, unless they are not finite (then never)."""
        weights = self.learner.weights()
        if not all_finite(weights):
            self.nonfinite_weights += 1
            self._bad_log.warning("weights hold NaN or infinity: not published (%d times so far)", self.nonfinite_weights)
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
        with self._stats_lock:
            mean, full = self.stats.return_mean, self.stats.full_window
        if s.return_mean is not None and full and mean >= s.return_mean:
            return f"return_mean_100 {mean:.1f} >= {s.return_mean}"
        if s.seconds is not None and elapsed >= s.seconds:
            return f"{s.seconds} seconds"
        if s.env_steps is not None and self.env_steps >= s.env_steps:
            return f"{s.env_steps} env steps"
        return None

    def _metrics_row(self, elapsed: float, step_rate: Rate, update_rate: Rate, last: dict) -> dict:
        with self._stats_lock:
            lags, self._lags = self._lags, []
            row = {
                "time": round(elapsed, 2),
                "env_steps": self.env_steps,
                "learner_updates": self.learner.updates,
                "env_steps_per_s": round(step_rate(self.env_steps), 1),
                "updates_per_s": round(update_rate(self.learner.updates), 1),
                "episodes": self.stats.episodes,
                "return_mean_100": self.stats.return_mean,
                "eval_episodes_in_window": len(self.stats.eval_returns),
                "train_return_mean_100": self.stats.train_return_mean,
            }
        row["samples_per_s"] = round(row["updates_per_s"] * self.learner.samples_per_update, 1)
        row.update(self.learner.metrics())
        row.update({
            "actors_connected": self.endpoint.actors_connected,
            "weights_version": self._version,
            "policy_lag_mean": round(float(np.mean(lags)), 1) if lags else None,
            "policy_lag_max": int(max(lags)) if lags else None,
            "rejected_messages": self.endpoint.rejected_messages,
            "metrics_write_failures": self._metrics.write_failures if self._metrics is not None else 0,
            "rejected_by_reason": self.endpoint.rejected.by_reason(),
            "internal_errors": self.internal_errors,
            "nonfinite_weights": self.nonfinite_weights,
            "checkpoints_written": self.checkpoints.written,
            "checkpoint_seconds": round(self.checkpoints.last_seconds, 2),
            "checkpoint_failures": self.checkpoints.failures,
            "learner_rss_mb": round(rss_bytes() / 2**20, 1),
            "learner_peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
            **{k: round(v, 5) for k, v in last.items()},
        })
        return row

    def _score(self) -> float | None:
        """return_mean_100 once it is over a full window of evaluation episodes (a mean of a
        few lucky episodes is no measure of a policy), else None."""
        with self._stats_lock:
            return self.stats.return_mean if self.stats.full_window else None

    def save_checkpoint(self, elapsed: float, background: bool = False) -> bool:
        """Writes a checkpoint (in the background: the replay is copied piece by piece while
        training and ingest go on). False if the previous one is still being written (try
        again soon); a network that is not finite is never written (counted, logged)."""
        if self.checkpoints.busy:
            return False
        if not all_finite(self.learner.weights()):
            self.nonfinite_weights += 1
            self._bad_log.warning("weights hold NaN or infinity: checkpoint not written (%d refused so far)",
                                  self.nonfinite_weights)
            return True
        with self._stats_lock:
            state = {
                **self.learner.state_dict(),
                "env_steps": self.env_steps,
                "env_steps_by_host": dict(self.env_steps_by_host),
                "episode_stats": self.stats.state_dict(),
                "time": elapsed,
                "config": self.config.to_dict(),
            }
            score = self.stats.return_mean if self.stats.full_window else None  # as _score, with the same stats
        name = f"ckpt-{self.learner.updates:09d}"
        return self.checkpoints.save(name, state, self.learner.checkpoint_replay, background=background, score=score)
