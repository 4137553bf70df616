"""The learner process: ingest thread, control loop, weight broadcasts, metrics,
checkpoints and stop conditions around the algorithm's learner core
(``apex.algos.<algo>.Learner``), which trains and knows nothing of sockets."""

from __future__ import annotations

import logging
import math
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from apex import algos
from apex.checkpoint import Checkpoint, CheckpointWriter
from apex.config import Config
from apex.envs import env_spec
from apex.errors import ApexError
from apex.malloc import keep_large_blocks
from apex.metrics import EpisodeStats, MetricsWriter, Rate, write_json_atomic
from apex.protocol import Message
from apex.transport import LearnerEndpoint, RateLimitedLog, Rejected, options_from_config

log = logging.getLogger(__name__)

MAX_ENVS_PER_ACTOR = 4096
INGEST_GROUP = 8  # batches already waiting that are inserted together


def rss_bytes() -> int:
    """Resident memory of this process now (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ApexError(f"learner.device={name} but CUDA is not available: use learner.device=auto or cpu")
    return device


@dataclass
class StopConditions:
    return_mean: float | None = None
    seconds: float | None = None
    env_steps: int | None = None


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
    ) -> None:
        self.config = config
        self.logdir = Path(logdir)
        self.stop = stop
        self.spec = env_spec(config.env)
        self.device = pick_device(config.learner.device)
        torch.set_num_threads(config.learner.torch_threads)
        keep_large_blocks()
        # Bind before building the core: a taken port fails at once, not after the replay
        # (gigabytes for Atari) has been allocated. Hellos wait for the first poll().
        self.endpoint = LearnerEndpoint(
            bind_host, port if port is not None else config.transport.port, self._welcome,
            options_from_config(config.transport),
        )
        try:
            self.learner = algos.get(config.algo).Learner(config, self.spec, self.device)
        except BaseException:
            self.endpoint.close()
            raise
        # The cores decompress frames themselves, straight into their storage.
        self.endpoint.receiver.lazy = True
        self.stats = EpisodeStats()
        self._stats_lock = threading.Lock()
        self.env_steps = 0
        self.env_steps_by_host: dict[str, int] = {}  # by the sending actor's address
        self.bad_batches = 0
        self._lags: list[int] = []
        self._bad_log = RateLimitedLog(log)
        self._stop_ingest = threading.Event()
        self._ingest_thread: threading.Thread | None = None
        self._version = 0  # of the weights last published
        self._signal: int | None = None
        self._elapsed_before = 0.0  # run time of the checkpoint resumed from
        self.checkpoints = CheckpointWriter(self.logdir / "checkpoints", config.learner.keep_checkpoints)
        self.resumed_from = None
        if resume is not None:
            try:
                self._restore(resume)
            except BaseException:
                self.endpoint.close()
                raise

    def _restore(self, checkpoint: Checkpoint) -> None:
        """Continues from a verified checkpoint: networks, optimizer, counters, episode
        returns and, when it holds one, the replay."""
        start = time.monotonic()
        state = checkpoint.load_state()
        replay = self.learner.checkpoint_replay
        if replay is not None and checkpoint.replay_path is not None:
            try:
                checkpoint.load_replay(replay)
            except ValueError as e:
                raise ApexError(f"cannot restore the replay of {checkpoint.name}: {e}") from None
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
        return {
            "config": self.config.to_dict(),
            "num_envs": num_envs,
            "seed": self.config.seed * 1_000_003 + 10_007 * (index + 1),
            **self.learner.welcome(index, num_envs),
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
            except Exception:  # a bug must not silently end ingestion: log, count, go on
                self.bad_batches += 1
                log.exception("ingest failed; continuing")

    def _ingest_some(self) -> None:
        receiver = self.endpoint.receiver
        while not self._stop_ingest.is_set():
            if not self.learner.wait_to_insert(timeout=0.05):
                continue
            msg = receiver.recv(timeout_ms=50)
            if msg is None:
                continue
            # Whatever else is already waiting goes in with it: one insert for several
            # small batches pays the checks and bookkeeping once.
            group = [msg]
            while len(group) < INGEST_GROUP and (more := receiver.recv(timeout_ms=0)) is not None:
                group.append(more)
            accepted = []
            for m in group:
                try:
                    accepted.append((m, *self._check_info(m.fields["info"])))
                except (ValueError, KeyError, TypeError) as e:
                    self._reject(m, e)
            errors = self.learner.insert_many([m.arrays for m, _, _ in accepted])
            with self._stats_lock:
                for (m, episodes, env_steps), error in zip(accepted, errors):
                    if error is not None:
                        self._reject(m, error)
                        continue
                    self.env_steps += env_steps
                    host = m.peer or "unknown"
                    self.env_steps_by_host[host] = self.env_steps_by_host.get(host, 0) + env_steps
                    for episode_return, _length, is_eval in episodes:
                        self.stats.add(episode_return, is_eval)
                    self._lags.append(self._version - m.fields["weights_version"])

    def _reject(self, msg: Message, error: Exception) -> None:
        self.bad_batches += 1
        self._bad_log.warning("rejected a batch from actor %s: %s", msg.fields.get("actor_index"), error)

    @staticmethod
    def _check_info(info: dict) -> tuple[list, int]:
        episodes, env_steps = info.get("episodes", []), info.get("env_steps", 0)
        if not isinstance(env_steps, int) or env_steps < 0:
            raise ValueError(f"info.env_steps must be a non-negative integer, got {env_steps!r}")
        if not isinstance(episodes, list) or not all(
            isinstance(e, list) and len(e) == 3 and isinstance(e[0], (int, float)) and math.isfinite(e[0])
            and isinstance(e[2], bool) for e in episodes
        ):
            raise ValueError("info.episodes must be a list of [return, length, is_eval]")
        return episodes, env_steps

    # -- main loop

    def run(self) -> int:
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        self.logdir.mkdir(parents=True, exist_ok=True)
        metrics = MetricsWriter(self.logdir)
        self.endpoint.publish_weights(self._version, self.learner.weights())
        self.start_ingest()
        # The run's clock goes on from the checkpoint's: metrics, stop conditions, summary.
        start = time.monotonic() - self._elapsed_before
        every_updates = self.config.learner.checkpoint_interval_updates
        next_metrics = time.monotonic() + self.config.learner.metrics_interval_s
        next_checkpoint = time.monotonic() + self.config.learner.checkpoint_interval_s
        next_checkpoint_updates = (self.learner.updates // every_updates + 1) * every_updates if every_updates else None
        step_rate, update_rate = Rate(self.env_steps), Rate(self.learner.updates)
        last: dict[str, float] = {}
        if self.resumed_from is not None:
            # A row at the resume point: `apex plot` drops what a killed predecessor logged
            # after it (times at or past this one), a history that was rolled back.
            metrics.write(self._metrics_row(self._elapsed_before, step_rate, update_rate, last))
        stop_reason = None
        log.info("learner on %s: %s %s, ports %d-%d, %.1f MB for data", self.device, self.config.algo,
                 self.config.env.id, self.endpoint.ports.control, self.endpoint.ports.weights,
                 self.learner.memory_nbytes / 1e6)
        try:
            while stop_reason is None:
                self.endpoint.poll(0)
                if self.learner.wait_to_step(timeout=0.002):
                    last = self.learner.step()
                    if self.learner.updates % self.config.learner.publish_interval == 0:
                        self._version = self.learner.updates
                        self.endpoint.publish_weights(self._version, self.learner.weights())
                now = time.monotonic()
                if now >= next_metrics:
                    next_metrics = now + self.config.learner.metrics_interval_s
                    metrics.write(self._metrics_row(now - start, step_rate, update_rate, last))
                stop_reason = self._stop_reason(now - start)
                due_by_updates = next_checkpoint_updates is not None and self.learner.updates >= next_checkpoint_updates
                if (now >= next_checkpoint or due_by_updates) and self.save_checkpoint(now - start, background=True):
                    next_checkpoint = now + self.config.learner.checkpoint_interval_s
                    if every_updates:
                        next_checkpoint_updates = (self.learner.updates // every_updates + 1) * every_updates
                if self._signal is not None:
                    stop_reason = f"signal {signal.Signals(self._signal).name}"
        finally:
            self.endpoint.stop_actors(stop_reason or "learner error")
            self.stop_ingest()
            wall = time.monotonic() - start
            metrics.write(self._metrics_row(wall, step_rate, update_rate, last))
            metrics.close()
            self.checkpoints.wait()
            self.save_checkpoint(wall)
            write_json_atomic(self.logdir / "summary.json", {
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
            })
            self._linger_for_stops()
            self.endpoint.close()
        log.info("learner stopped: %s", stop_reason)
        return 130 if self._signal == signal.SIGINT else 0

    def _on_signal(self, signum: int, _frame) -> None:
        self._signal = signum

    def _linger_for_stops(self, seconds: float = 0.5) -> None:
        """Answers heartbeats with stop for a moment, so that every actor hears it."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.endpoint.actors_connected:
            self.endpoint.poll(20)

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
            "rejected_messages": (self.endpoint.rejected_messages + self.endpoint.receiver.rejected_messages
                                  + self.bad_batches),
            "checkpoints_written": self.checkpoints.written,
            "checkpoint_seconds": round(self.checkpoints.last_seconds, 2),
            "checkpoint_failures": self.checkpoints.failures,
            "learner_rss_mb": round(rss_bytes() / 2**20, 1),
            "learner_peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
            **{k: round(v, 5) for k, v in last.items()},
        })
        return row

    def save_checkpoint(self, elapsed: float, background: bool = False) -> bool:
        """Writes a checkpoint (in the background: the replay is copied piece by piece while
        training and ingest go on). False if the previous one is still being written."""
        with self._stats_lock:
            state = {
                **self.learner.state_dict(),
                "env_steps": self.env_steps,
                "env_steps_by_host": dict(self.env_steps_by_host),
                "episode_stats": self.stats.state_dict(),
                "time": elapsed,
                "config": self.config.to_dict(),
            }
        name = f"ckpt-{self.learner.updates:09d}"
        return self.checkpoints.save(name, state, self.learner.checkpoint_replay, background=background)
