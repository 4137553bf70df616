"""Hostile input against a real learner process: one regression test per numbered item of
the hostile-input issue (12), hostile peers as real sockets, honest actors as real processes.

Each test asserts the outcome: the learner alive and still updating, the bad input counted
by reason, no non-finite weight published or checkpointed, memory growth bounded, stop
conditions untouched by forged data, no code run by a forged checkpoint.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import resource
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import lz4.block
import msgpack
import numpy as np
import pytest
import torch
import zmq

from apex import config as config_module
from apex.bench.transport import free_base_port, free_port
from apex.transport import ActorConnection, generate_keys
from apex.wire import protocol
from tests.support.peers import OPTIONS, honest_batch
from tests.support.processes import processes_mentioning, wait_for
from tests.support.runs import FAST, metrics

# Small batches, and ingest that the sample-to-insert ratio does not hold back on a loaded machine.
QUICK_START = [
    "--set",
    "apex_dqn.replay.min_size=500",
    "--set",
    "apex_dqn.batch_size=64",
    "--set",
    "impala.batch_unrolls=8",
    "--set",
    "apex_dqn.replay_ratio=0.5",
]


def start(*args: str, log: Path, **kwargs) -> subprocess.Popen:
    """An apex process with its output in a file (a pipe nobody reads would block it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "apex", *args], stdout=log.open("w"), stderr=subprocess.STDOUT, text=True, **kwargs
    )


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Run:
    """A real learner and (unless ``actors=0``) an honest actor, on a port of their own."""

    def __init__(self, tmp: Path, algo: str, *extra: str, actors: int = 1, preexec_fn=None) -> None:
        self.tmp, self.algo = tmp, algo
        tmp.mkdir(parents=True, exist_ok=True)
        self.logdir, self.port = tmp / f"run-{algo}", free_base_port()
        self.learner_log = tmp / f"learner-{algo}.log"
        self.learner = start(
            "learner",
            "--logdir",
            str(self.logdir),
            "--port",
            str(self.port),
            "--set",
            f"algo={algo}",
            *FAST,
            *QUICK_START,
            *extra,
            log=self.learner_log,
            preexec_fn=preexec_fn,
        )
        self.actors = [
            start(
                "actor",
                "--learner",
                f"127.0.0.1:{self.port}",
                "--actor-index",
                str(i),
                *FAST[:4],
                log=tmp / f"actor-{algo}-{i}.log",
            )
            for i in range(actors)
        ]
        if actors:
            self.wait_updating(90)

    def row(self) -> dict:
        rows = metrics(self.logdir)
        return rows[-1] if rows else {}

    def updates(self) -> int:
        return self.row().get("learner_updates", 0)

    def wait_updating(self, timeout: float = 30) -> None:
        """Waits until the learner has updated more than it had when called."""
        before = self.updates()
        wait_for(lambda: self.updates() > before, timeout, f"the {self.algo} learner to go on updating")
        assert self.learner.poll() is None

    def rejected(self, reason: str) -> int:
        return self.row().get("rejected_by_reason", {}).get(reason, 0)

    def wait_rejected(self, reason: str, at_least: int, timeout: float = 20) -> None:
        wait_for(
            lambda: self.rejected(reason) >= at_least, timeout, f"{at_least} rejected for {reason!r}: {self.row()}"
        )

    def stop(self, timeout: float = 30) -> int:
        # The peers' sockets too, whatever the test did: a context left to the garbage
        # collector with a socket open blocked CI's pytest in its finalizer for good.
        for client in getattr(self, "peers", []):
            if not client.context.closed:
                client.close()
        for proc in [self.learner, *self.actors]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [self.learner, *self.actors]:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return self.learner.returncode

    def session(self, **kwargs) -> ActorConnection:
        """A hostile peer with a real session: it said hello like any actor."""
        client = ActorConnection("127.0.0.1", self.port, num_envs=4, options=OPTIONS, **kwargs)
        self.peers = [*getattr(self, "peers", []), client]
        client.handshake(timeout_s=20)
        return client


def send(client: ActorConnection, batch: dict, info: dict | None = None) -> None:
    client.tick()
    assert client.send_batch(batch, weights_version=0, info=info or {}, timeout_s=20)


def checkpoint_is_finite(logdir: Path) -> str:
    """The newest checkpoint's name, after asserting every tensor in it is finite."""
    newest = sorted((logdir / "checkpoints").glob("ckpt-*.pt"))[-1]
    state = torch.load(newest, map_location="cpu", weights_only=True)
    for key in ("online", "target", "net", "policy"):
        for name, tensor in state.get(key, {}).items():
            assert torch.isfinite(tensor).all(), f"{newest.name}: {key}.{name} is not finite"
    return newest.stem


def forged(batch: dict, name: str, value) -> dict:
    """``batch`` with the first value of ``name`` set to ``value`` (a copy)."""
    array = batch[name].copy()
    array.flat[0] = value
    return {**batch, name: array}


def trains_on_with_finite_weights(run: Run, peer: ActorConnection) -> str:
    """After hostile input: the learner still updates, publishes finite weights and exits 0
    with a finite checkpoint, whose name this returns."""
    run.wait_updating()
    time.sleep(0.5)
    peer.tick()
    weights = peer.take_weights()
    assert weights is not None and all(np.isfinite(a).all() for a in weights.arrays.values())
    peer.close()
    assert run.stop() == 0
    return checkpoint_is_finite(run.logdir)


@pytest.fixture(scope="module")
def apex_run(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("apex"), "apex_dqn")
    yield run
    run.stop()


@pytest.fixture(scope="module")
def impala_run(tmp_path_factory):
    run = Run(tmp_path_factory.mktemp("impala"), "impala")
    yield run
    run.stop()


# -- 1, 2: poison


@pytest.mark.parametrize("algo", ["apex_dqn", "impala", "appo"])
def test_poisoned_batches_never_reach_the_weights_and_the_run_resumes(tmp_path, algo):
    # Observations up to float32's limit let in (the default, the space's bounds and 1e6, refuses
    # them: test_finite_poison_is_refused_by_the_learner_and_by_apex_serve): the defence behind
    # it, skipped updates, is what is tested here.
    run = Run(tmp_path, algo, "--set", "learner.checkpoint_interval_s=2", "--set", "transport.max_abs_obs=3.3e38")
    try:
        peer = run.session()
        batch = honest_batch(peer)
        nan_frames = {**batch, "frames": batch["frames"].copy()}
        nan_frames["frames"][0, 0] = np.nan
        send(peer, nan_frames)
        send(peer, {**batch, "reward": batch["reward"].astype(np.float64) + 1e300})  # inf as float32
        run.wait_rejected("nonfinite", 2)
        # uint8 actions (which crashed IMPALA's loss) are cast; 3e38 frames are finite, so they
        # pass the schema and blow up the network's activations: those updates are skipped.
        send(peer, {**batch, "action": batch["action"].astype(np.uint8)})
        huge = {**batch, "frames": np.full_like(batch["frames"], 3e38)}
        if algo == "apex_dqn":
            huge["priority"] = np.full_like(batch["priority"], 1e30)  # sampled at once
        for _ in range(3):
            send(peer, huge)
        wait_for(lambda: run.row().get("skipped_updates", 0) >= 1, 30, "a skipped update")
        if algo == "apex_dqn":
            assert run.row()["dropped_transitions"] >= 1  # never sampled again
        name = trains_on_with_finite_weights(run, peer)
        # The exit checkpoint resumes into a learner that trains.
        resumed = Run(tmp_path / "resumed", algo, "--resume", str(run.logdir), "--stop-seconds", "600")
        try:
            assert f"resumed from {name}" in resumed.learner_log.read_text()
        finally:
            resumed.stop()
    finally:
        run.stop()


def test_a_recurrent_continuous_learner_counts_forged_states_and_actions_and_trains_on(tmp_path):
    """IMPALA with an LSTM core on Pendulum: what only such a run receives (the core's state at
    each unroll's start, done flags, Gaussian samples and densities), forged but well formed,
    is refused and counted by reason while the learner lives and trains; a finite but absurd
    cell state (1e30) passes the schema and leaves the weights finite."""
    run = Run(
        tmp_path,
        "impala",
        "--set",
        "env.id=Pendulum-v1",
        "--set",
        "model.recurrent=lstm",
        "--set",
        "model.lstm_size=16",
    )
    try:
        peer = run.session()
        batch = honest_batch(peer)
        assert {"core_h", "core_c", "done"} <= set(batch) and batch["action"].dtype == np.float32

        for name, value in (("core_c", np.nan), ("action", np.inf)):
            send(peer, forged(batch, name, value))
        run.wait_rejected("nonfinite", 2)
        for name, value in (("core_h", 1.5), ("done", 2), ("action", 1e7), ("behaviour_logp", 50.0)):
            send(peer, forged(batch, name, value))
        run.wait_rejected("out_of_range", 4)
        send(peer, {name: a for name, a in batch.items() if name != "core_h"})
        run.wait_rejected("fields", 1)
        for _ in range(3):
            send(peer, {**batch, "core_c": np.full_like(batch["core_c"], 1e30)})
        trains_on_with_finite_weights(run, peer)
    finally:
        run.stop()


def test_an_appo_learner_refuses_forged_actions_and_densities_and_trains_on(tmp_path):
    """APPO's batches are IMPALA's unrolls: an action out of CartPole's two, a behaviour
    log-probability above 0 (a forged density, which would shrink every importance weight), a
    NaN reward are refused and counted by reason; the learner trains on with finite weights."""
    run = Run(tmp_path, "appo")
    try:
        peer = run.session()
        batch = honest_batch(peer)
        assert {"behaviour_logp", "obs_frame"} <= set(batch)

        send(peer, forged(batch, "reward", np.nan))
        run.wait_rejected("nonfinite", 1)
        for name, value in (("action", 2), ("action", -1), ("behaviour_logp", 1.0)):
            send(peer, forged(batch, name, value))
        run.wait_rejected("out_of_range", 3)
        assert {"kl", "clip_fraction"} <= run.row().keys()
        trains_on_with_finite_weights(run, peer)
    finally:
        run.stop()


def test_an_apex_ddpg_learner_refuses_forged_actions_drops_poison_and_resumes(tmp_path):
    """Ape-X DDPG on Pendulum: a torque outside [-2, 2], a NaN one, a forged infinite priority
    are refused and counted by reason; 3e38 observations (let in here) blow up the critics'
    activations: those updates are skipped and their transitions never sampled again. The
    learner trains on with finite weights, and its exit checkpoint resumes."""
    ddpg = ["--set", "env.id=Pendulum-v1", "--set", "apex_ddpg.replay.min_size=500"]
    ddpg += ["--set", "apex_ddpg.batch_size=64", "--set", "apex_ddpg.replay_ratio=0.5"]
    ddpg += ["--set", "transport.max_abs_obs=3.3e38", "--set", "apex_ddpg.eval_envs=1"]
    run = Run(tmp_path, "apex_ddpg", *ddpg)
    try:
        peer = run.session()
        batch = honest_batch(peer)
        assert batch["action"].dtype == np.float32 and batch["action"].shape[1:] == (1,)

        send(peer, forged(batch, "action", np.nan))
        send(peer, forged(batch, "priority", np.inf))
        run.wait_rejected("nonfinite", 2)
        send(peer, forged(batch, "action", 2.5))
        send(peer, forged(batch, "action", -7.0))
        run.wait_rejected("out_of_range", 2)
        huge = {**batch, "frames": np.full_like(batch["frames"], 3e38)}
        huge["priority"] = np.full_like(batch["priority"], 1e30)  # sampled at once (capped, still first)
        for _ in range(3):
            send(peer, huge)
        wait_for(lambda: run.row().get("skipped_updates", 0) >= 1, 30, "a skipped update")
        assert run.row()["dropped_transitions"] >= 1
        name = trains_on_with_finite_weights(run, peer)
        resumed = Run(tmp_path / "resumed", "apex_ddpg", *ddpg, "--resume", str(run.logdir), "--stop-seconds", "600")
        try:
            assert f"resumed from {name}" in resumed.learner_log.read_text()
        finally:
            resumed.stop()
    finally:
        run.stop()


# -- 4: code execution by checkpoint


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def forge(pt: Path, marker: Path) -> None:
    """Replaces a checkpoint's state with a pickle that would create ``marker`` if run."""
    rewrite(pt, pickle.dumps({"config": {}, "x": _Marker(str(marker))}))


def rewrite(pt: Path, data: bytes) -> None:
    """Replaces a checkpoint's state and makes its manifest match (size and CRC-32 detect
    accidents, not attackers)."""
    pt.write_bytes(data)
    manifest_path = pt.with_suffix(".json")
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["state"] = {"bytes": len(data), "crc32": zlib.crc32(data)}
    manifest_path.write_text(json.dumps(manifest))


def stopped_run_with_two_checkpoints(tmp_path: Path) -> tuple[Run, list[Path]]:
    """An Ape-X run that wrote two checkpoints or more and stopped; their state files."""
    run = Run(tmp_path, "apex_dqn", "--set", "learner.checkpoint_interval_s=1")
    wait_for(lambda: len(list((run.logdir / "checkpoints").glob("ckpt-*.json"))) >= 2, 30, "two checkpoints")
    assert run.stop() == 0
    return run, sorted((run.logdir / "checkpoints").glob("ckpt-*.pt"))


def test_a_forged_checkpoint_runs_no_code_and_resume_falls_back(tmp_path):
    run, checkpoints = stopped_run_with_two_checkpoints(tmp_path)
    marker = tmp_path / "pwned"
    forge(checkpoints[-1], marker)
    evaluated = subprocess.run(
        [sys.executable, "-m", "apex", "eval", "--checkpoint", str(checkpoints[-1])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert evaluated.returncode == 2 and len(evaluated.stderr.strip().splitlines()) == 1, evaluated.stderr
    resumed = Run(tmp_path / "resumed", "apex_dqn", "--resume", str(run.logdir), "--stop-seconds", "600")
    try:
        log = resumed.learner_log.read_text()
        assert f"{checkpoints[-1].stem} refused" in log or f"checkpoint {checkpoints[-1].stem}" in log
        assert f"resumed from {checkpoints[-2].stem}" in log
    finally:
        resumed.stop()
    assert not marker.exists()


def test_a_checkpoint_whose_optimizer_state_does_not_fit_is_set_aside_not_a_segfault(tmp_path):
    # torch loads an Adam moment of any shape, and fused Adam writes past one that is too
    # small: the resumed learner died of SIGSEGV at its first update, without a word.
    run, checkpoints = stopped_run_with_two_checkpoints(tmp_path)
    state = torch.load(checkpoints[-1], weights_only=True)
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(7)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    rewrite(checkpoints[-1], buffer.getvalue())
    resumed = Run(tmp_path / "resumed", "apex_dqn", "--resume", str(run.logdir), "--stop-seconds", "600")
    try:
        resumed.wait_updating()  # its first row: the checkpoint's updates
        resumed.wait_updating()  # then more: it trains
        log = resumed.learner_log.read_text()
        assert f"checkpoint {checkpoints[-1].stem} refused: optimizer state 'exp_avg' of parameter 0 is (7,)" in log
        assert f"resumed from {checkpoints[-2].stem}" in log
    finally:
        assert resumed.stop() == 0


# -- 6: frozen main loop


def test_a_hello_flood_neither_stalls_training_nor_delays_sigterm(tmp_path):
    run = Run(tmp_path, "apex_dqn")
    flooder = subprocess.Popen([sys.executable, "-c", FLOOD_HELLOS, str(run.port)])
    try:
        time.sleep(2)
        before = run.updates()
        time.sleep(4)
        assert run.updates() > before + 20, "the learner must keep training under a hello flood"
        assert run.rejected("hello_rate") > 0
        run.learner.send_signal(signal.SIGTERM)
        started = time.monotonic()
        run.learner.wait(timeout=10)
        assert time.monotonic() - started < 2.0 + 1.0  # acts within 2 s (+ the final checkpoint on 2 cores)
        assert run.learner.returncode == 0
    finally:
        flooder.kill()
        flooder.wait()
        run.stop()


FLOOD_HELLOS = """
import sys, zmq
from apex.wire import protocol
port = int(sys.argv[1])
frames = protocol.encode("hello", {"actor_index": None, "num_envs": 1, "host": "flood", "pid": 1})
sockets = []
for i in range(2):
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, b"flood-%d" % i)
    s.setsockopt(zmq.SNDHWM, 1000)
    s.connect(f"tcp://127.0.0.1:{port}")
    sockets.append(s)
while True:
    for s in sockets:
        try:
            s.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        while s.poll(0):
            s.recv_multipart()
"""


# -- 8: forged stop


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_forged_episodes_and_env_steps_do_not_stop_the_run(tmp_path, algo):
    # A learning rate too small to learn: CartPole's presets reach 450 in about 15 s of honest
    # training, so only the forged episodes could make this run stop on its return.
    run = Run(tmp_path, algo, "--stop-return", "450", "--stop-env-steps", "100000000", "--set", f"{algo}.lr=1e-9")
    try:
        peer = run.session()
        batch = honest_batch(peer)
        send(peer, batch, {"episodes": [[500.0, 500, True]] * 100})
        send(peer, batch, {"episodes": [], "env_steps": 10**18})
        send(peer, batch, {"episodes": [[500.0, 500, True]] * 2000})
        run.wait_rejected("episodes", 2)
        run.wait_rejected("info", 1)
        time.sleep(2)
        run.wait_updating()
        row = run.row()
        assert row["env_steps"] < 10**8 and (row["return_mean_100"] or 0) < 450
        peer.close()
    finally:
        run.stop()
    summary = json.loads((run.logdir / "summary.json").read_text())
    assert summary["stop_reason"] == "signal SIGTERM"


# -- 9: secure defaults


def test_learner_binds_loopback_by_default_and_warns_on_an_open_bind_without_curve(tmp_path):
    port = free_base_port()
    local = start(
        "learner", "--logdir", str(tmp_path / "a"), "--port", str(port), "--stop-seconds", "600", log=tmp_path / "a.log"
    )
    try:
        wait_for(lambda: "starting apex_dqn on" in (tmp_path / "a.log").read_text(), 60, "the learner to start")
        listening = Path("/proc/net/tcp").read_text()
        assert f"0100007F:{port:04X}" in listening and f"00000000:{port:04X}" not in listening
        assert "without CURVE" not in (tmp_path / "a.log").read_text()
    finally:
        local.send_signal(signal.SIGTERM)
        local.wait(30)
    open_bind = start(
        "learner",
        "--logdir",
        str(tmp_path / "b"),
        "--port",
        str(port),
        "--bind-host",
        "0.0.0.0",
        "--stop-seconds",
        "1",
        log=tmp_path / "b.log",
    )
    open_bind.wait(60)
    warnings = [line for line in (tmp_path / "b.log").read_text().splitlines() if "without CURVE" in line]
    assert len(warnings) == 1 and "apex keygen" in warnings[0]


# -- 11: disk full


def _small_files() -> None:  # in the child: writes past 256 KB fail (EFBIG; Python ignores SIGXFSZ)
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))


def test_write_errors_in_metrics_tensorboard_and_checkpoints_are_survived(tmp_path):
    run = Run(
        tmp_path,
        "apex_dqn",
        "--set",
        "learner.checkpoint_interval_s=1",
        "--set",
        "learner.metrics_interval_s=0.1",
        "--stop-seconds",
        "25",
        preexec_fn=_small_files,
    )
    assert run.learner.wait(timeout=90) == 0
    run.stop()
    log = run.learner_log.read_text()
    assert "checkpoint" in log and "failed" in log
    assert "metrics" in log.lower()
    assert not list(run.logdir.rglob("*.tmp"))
    summary = json.loads((run.logdir / "summary.json").read_text())
    assert summary["learner_updates"] > 0 and summary["stop_reason"] == "25.0 seconds"


# -- 12: small ones


def test_keygen_secret_keys_are_private_from_creation(tmp_path):
    paths = generate_keys(tmp_path / "keys")
    for name in ("learner_secret", "actor_secret"):
        assert stat.S_IMODE(paths[name].stat().st_mode) == 0o600
    assert stat.S_IMODE(paths["actor_public"].stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "keys").stat().st_mode) == 0o700


# -- 13: a restarted learner


def test_actors_adopt_a_new_learners_weights_whatever_their_version():
    from tests.support.endpoints import Learner  # an endpoint whose control loop runs in a thread

    port = free_base_port()
    first = Learner(port, options=OPTIONS)
    client = ActorConnection("127.0.0.1", port, options=OPTIONS)
    taken = []

    def holds(version):
        client.tick()
        if (weights := client.take_weights()) is not None:
            taken.append(weights)
        return bool(taken) and taken[-1].fields["version"] == version

    try:
        first.call(lambda e: e.publish_weights(500, {"w": np.ones(3, np.float32)}))
        client.handshake(timeout_s=10)
        wait_for(lambda: holds(500), 10, "version 500")
        first.close()
        second = Learner(port, options=OPTIONS)  # a fresh learner at the same address
        try:
            second.call(lambda e: e.publish_weights(3, {"w": np.full(3, 2.0, np.float32)}))
            wait_for(lambda: holds(3), 20, "the new learner's version 3")
            assert taken[-1].arrays["w"].tolist() == [2.0, 2.0, 2.0]
        finally:
            second.close()
    finally:
        client.close()


# -- 14: actor shutdown


def test_an_actor_waiting_for_a_learner_says_so_and_stops_on_a_signal_within_a_second(tmp_path):
    port = free_base_port()
    log = tmp_path / "actor.log"
    actor = start("actor", "--learner", f"127.0.0.1:{port}", log=log)
    try:
        wait_for(lambda: f"waiting for learner at 127.0.0.1:{port} (10 s)" in log.read_text(), 30, "a waiting line")
        actor.send_signal(signal.SIGTERM)
        started = time.monotonic()
        assert actor.wait(timeout=5) == 0
        assert time.monotonic() - started < 1.0
    finally:
        if actor.poll() is None:
            actor.kill()
            actor.wait()
    interrupted = start("actor", "--learner", f"127.0.0.1:{port}", log=tmp_path / "actor2.log")
    time.sleep(3)  # started, saying hello
    interrupted.send_signal(signal.SIGINT)
    started = time.monotonic()
    interrupted.wait(timeout=5)
    assert time.monotonic() - started < 1.0 and interrupted.returncode == 130


@pytest.mark.parametrize("problem", ["unknown env", "port taken", "learner failing"])
def test_apex_run_returns_a_learner_start_up_error_within_five_seconds(tmp_path, problem):
    port = free_base_port()
    args = ["--logdir", str(tmp_path / "run"), "--port", str(port)]
    taken = socket.socket()
    if problem == "unknown env":
        args += ["--set", "env.id=NoSuchEnv-v0"]
    elif problem == "port taken":
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
    else:  # found only by the learner process, after its own start-up (CUDA asked for, none here)
        args += (
            ["--set", "learner.device=cuda:7"] if not torch.cuda.is_available() else ["--set", "learner.device=cuda:99"]
        )
    started = time.monotonic()
    with taken:
        result = subprocess.run(
            [sys.executable, "-m", "apex", "run", *args], capture_output=True, text=True, timeout=60
        )
    elapsed = time.monotonic() - started
    assert result.returncode == 2, result.stderr
    expected = {"unknown env": "NoSuchEnv-v0", "port taken": f"port {port + 1}", "learner failing": "CUDA"}[problem]
    assert expected in result.stderr
    assert elapsed < 5.0, f"{elapsed:.1f}s"
    assert not processes_mentioning(str(tmp_path))


# -- 3: crash by hello


def test_hello_fields_are_bounded(apex_run):
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.ROUTING_ID, b"hostile-3")
    dealer.connect(f"tcp://127.0.0.1:{apex_run.port}")
    try:
        for fields, words in (
            ({"actor_index": 2**51}, "actor index must be in 0..65535"),
            ({"actor_index": -1}, "actor index must be in"),
            ({"pid": 2**63}, "pid in"),
            ({"host": "h" * 10_000}, "host must be at most"),
            ({"num_envs": 2**40}, "num_envs must be in"),
        ):
            hello = {"actor_index": None, "num_envs": 1, "host": "x", "pid": 1, **fields}
            dealer.send_multipart(protocol.encode("hello", hello))
            assert dealer.poll(5000)
            answer = protocol.decode(dealer.recv_multipart())
            assert answer.type == "reject" and words in answer.fields["reason"] and not answer.fields["retry"]
    finally:
        dealer.close(linger=0)
    apex_run.wait_rejected("hello_fields", 5)
    apex_run.wait_updating()


# -- 5: memory by subscription


def test_weights_port_keeps_no_state_a_peer_can_grow(apex_run):
    before = rss_mb(apex_run.learner.pid)
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{apex_run.port + 2}")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.SNDHWM, 100_000)
    dealer.connect(f"tcp://127.0.0.1:{apex_run.port + 2}")
    try:
        for _ in range(20 * 1024):  # 20 MiB of random 1 KiB subscriptions, and as many registrations
            sub.setsockopt(zmq.SUBSCRIBE, os.urandom(1024))
            dealer.send(os.urandom(1024), flags=zmq.NOBLOCK)
        # (ZeroMQ drops a connection sending more than a registration's size: a fresh one)
        small = context.socket(zmq.DEALER)
        small.connect(f"tcp://127.0.0.1:{apex_run.port + 2}")
        for _ in range(2000):  # registrations with made-up tokens: read, counted, not kept
            small.send(os.urandom(16))
        apex_run.wait_rejected("no_session", 1000)
        small.close(linger=0)
        time.sleep(2)
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
    assert rss_mb(apex_run.learner.pid) - before < 200
    apex_run.wait_updating()


# -- 10: identity


def test_batches_need_a_live_session_once_each_and_an_index_cannot_be_taken(apex_run):
    peer = apex_run.session()
    batch = honest_batch(peer)
    no_session = apex_run.rejected("no_session")
    stranger = zmq.Context.instance().socket(zmq.PUSH)
    stranger.connect(f"tcp://127.0.0.1:{apex_run.port + 1}")
    forged = {"actor_index": 0, "weights_version": 0, "info": {}, "session": os.urandom(16), "seq": 1}
    stranger.send_multipart(protocol.encode("batch", forged, batch))
    apex_run.wait_rejected("no_session", no_session + 1)
    # One captured batch sent 200 times: in once.
    replayed = apex_run.rejected("replayed")
    inserted = apex_run.row()["inserted"]
    frames = protocol.encode(
        "batch",
        {"actor_index": peer.actor_index, "weights_version": 0, "info": {}, "session": peer._session, "seq": peer._seq},
        batch,
    )
    for _ in range(200):
        stranger.send_multipart(frames)
    # (the peer keeps its session alive meanwhile, as a live actor would)
    wait_for(lambda: (peer.tick(), apex_run.rejected("replayed") >= replayed + 199)[-1], 60, "199 replays refused")
    stranger.close(linger=0)
    # A peer saying hello as actor 0 every 200 ms cannot take the honest actor's index.
    actor_log = apex_run.tmp / "actor-apex_dqn-0.log"
    handshakes = actor_log.read_text().count("handshake") + actor_log.read_text().count("reconnecting")
    thief = ActorConnection("127.0.0.1", apex_run.port, actor_index=0, num_envs=4, options=OPTIONS)
    answers = []
    for _ in range(10):
        thief._send_control("hello", {"actor_index": 0, "num_envs": 4, "host": "thief", "pid": 1})
        if thief.control.poll(1000):
            answers.append(thief._recv_control())
        time.sleep(0.2)
    thief.close()
    assert answers and all(a.type == "reject" and "held by a live actor" in a.fields["reason"] for a in answers)
    peer.close()
    apex_run.wait_updating()
    assert actor_log.read_text().count("handshake") + actor_log.read_text().count("reconnecting") == handshakes
    assert apex_run.row()["inserted"] >= inserted  # the replayed batch counted once at most


# -- 12: garbage senders


def test_ten_garbage_senders_do_not_stop_an_honest_actor(apex_run):
    script = (
        "import os, sys, zmq\ns = zmq.Context().socket(zmq.PUSH)\n"
        "s.connect(f'tcp://127.0.0.1:{int(sys.argv[1]) + 1}')\n"
        "while True: s.send_multipart([b'\\x81\\xa1v\\x03' + os.urandom(64), os.urandom(512)])\n"
    )
    garbage = [subprocess.Popen([sys.executable, "-c", script, str(apex_run.port)]) for _ in range(10)]
    try:
        malformed = apex_run.rejected("malformed")
        time.sleep(2)
        steps = apex_run.row()["env_steps"]
        time.sleep(4)
        assert apex_run.row()["env_steps"] > steps  # the honest actor's batches still get in
        assert apex_run.rejected("malformed") > malformed
        apex_run.wait_updating()
    finally:
        for p in garbage:
            p.kill()
            p.wait()


# -- 7: memory by small messages


@functools.lru_cache
def _zeros_lz4(nbytes: int) -> bytes:
    return lz4.block.compress(bytes(nbytes), store_size=False)


def lz4_bomb(msg_type: str, fields: dict, name: str, shape: tuple, dtype=np.float32) -> list[bytes]:
    """A message declaring a large array of zeros whose lz4 payload is small."""
    payload = _zeros_lz4(int(np.prod(shape)) * np.dtype(dtype).itemsize)
    layout = msgpack.packb([[name, np.dtype(dtype).str, list(shape), "lz4"]])
    header = msgpack.packb({"v": protocol.PROTOCOL, "type": msg_type, **fields, "layout": layout}, use_bin_type=True)
    return [header, payload]


@pytest.mark.parametrize("fixture", ["apex_run", "impala_run"])
def test_small_messages_declaring_large_arrays_cost_no_memory(fixture, request):
    run = request.getfixturevalue(fixture)
    _zeros_lz4(512 * 2**20), _zeros_lz4(3_200_000)  # made before the session, which must not go silent
    before = rss_mb(run.learner.pid)
    peer = run.session()

    def fields() -> dict:
        return {
            "actor_index": peer.actor_index,
            "weights_version": 0,
            "info": {},
            "session": peer._session,
            "seq": peer._seq,
        }

    rejected = run.rejected("too_large") + run.rejected("fields")
    for name in ("frames", "unknown"):  # four 2.1 MB payloads declaring 512 MB each
        for _ in range(2):
            assert peer.send_frames(lz4_bomb("batch", fields(), name, (128 * 2**20, 1)), timeout_s=20)
            peer._seq += 1
    batch = honest_batch(peer)
    many = {k: np.repeat(v, 5000, axis=0) for k, v in batch.items()}  # 500,000 unrolls (IMPALA)
    send(peer, many)
    wait_for(
        lambda: run.rejected("too_large") + run.rejected("fields") + run.rejected("malformed") >= rejected + 5,
        20,
        f"the bombs to be rejected: {run.row().get('rejected_by_reason')}",
    )
    control = zmq.Context.instance().socket(zmq.DEALER)
    control.connect(f"tcp://127.0.0.1:{run.port}")
    malformed = run.rejected("malformed")
    for _ in range(10):  # 3.2 MB weights on the control port
        control.send_multipart(lz4_bomb("weights", {"version": 1, "incarnation": b"x"}, "w", (800_000,)))
    run.wait_rejected("malformed", malformed + 10)
    control.close(linger=0)
    peer.close()
    row = run.row()
    assert row.get("queue_unrolls", 0) <= 2 * 128
    assert rss_mb(run.learner.pid) - before < 200
    run.wait_updating()


# -- Round two (issue 30). 1, 2: code named by a config from elsewhere


def pipepager_wrapper(marker: Path) -> dict:
    """A wrapper that runs a shell command when called: pydoc.pipepager(env, cmd)."""
    return {"type": "pydoc.pipepager", "kwargs": {"cmd": f"touch {marker}"}}


def forge_config(pt: Path, edit) -> None:
    """Edits the config saved in a checkpoint (its state and its manifest), manifest made to match."""
    state = torch.load(pt, map_location="cpu", weights_only=True)
    edit(state["config"])
    buffer = io.BytesIO()
    torch.save(state, buffer)
    rewrite(pt, buffer.getvalue())
    manifest_path = pt.with_suffix(".json")
    manifest = json.loads(manifest_path.read_text())
    edit(manifest["config"])
    manifest_path.write_text(json.dumps(manifest))


def apex_command(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "apex", *args], capture_output=True, text=True, timeout=timeout, **kwargs
    )


def refused_import(result: subprocess.CompletedProcess, command: str, module: str) -> None:
    """The command exited 2 with one line naming the module and the flag that allows it."""
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"apex {command}: error: ") and f"module {module!r}" in last, last
    assert f"--allow-import {module}" in last, last


def test_a_checkpoint_whose_config_names_code_runs_none_of_it(tmp_path):
    import apex

    run, checkpoints = stopped_run_with_two_checkpoints(tmp_path)
    marker = tmp_path / "pwned"
    forge_config(checkpoints[-1], lambda config: config["env"].update(wrappers=[pipepager_wrapper(marker)]))

    evaluated = apex_command("eval", "--checkpoint", str(checkpoints[-1]), "--episodes", "1")
    refused_import(evaluated, "eval", "pydoc")
    assert len(evaluated.stderr.strip().splitlines()) == 1, evaluated.stderr
    refused_import(apex_command("eval", "--checkpoint", str(run.logdir), "--which", "newest"), "eval", "pydoc")
    with pytest.raises(config_module.ConfigError, match="module 'pydoc'.*--allow-import pydoc"):
        apex.load_policy(checkpoints[-1])
    refused_import(
        apex_command("learner", "--resume", str(run.logdir), "--port", str(free_base_port()), "--stop-seconds", "600"),
        "learner",
        "pydoc",
    )
    refused_import(
        apex_command("run", "--resume", str(run.logdir), "--port", str(free_base_port()), "--stop-seconds", "600"),
        "run",
        "pydoc",
    )
    assert not marker.exists()
    # The same checkpoint, allowed by the one who loads it: the wrapper runs (the check above
    # is what stopped it, not something else on the way).
    allowed = apex_command("eval", "--checkpoint", str(checkpoints[-1]), "--allow-import", "pydoc")
    assert marker.exists(), allowed.stderr[-2000:]


class ForgedLearner:
    """A learner's control channel (apex's own endpoint) whose welcome carries ``config``, and
    ``setup`` where given (the whole of the welcome's setup)."""

    def __init__(self, config: dict, setup: dict | None = None) -> None:
        from apex.transport import LearnerEndpoint

        self.port = free_base_port()
        setup = setup if setup is not None else {"config": config, "num_envs": 1, "seed": 0}
        self.endpoint = LearnerEndpoint("127.0.0.1", self.port, lambda hello, index: setup, OPTIONS)
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping:
            self.endpoint.poll(50)

    def close(self) -> None:
        self.stopping = True
        self.thread.join(5)
        self.endpoint.close()


EVIL_MODULE = "from pathlib import Path\nPath({marker!r}).touch()\n"


@pytest.mark.parametrize("forgery", ["wrapper", "imports", "env_id"])
def test_a_forged_welcome_makes_actors_and_serve_run_no_code(tmp_path, forgery):
    marker = tmp_path / "pwned"
    (tmp_path / "evil_module.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    config = config_module.load(None, ["algo=impala"]).to_dict()
    module = {"wrapper": "pydoc", "imports": "evil_module", "env_id": "evil_module"}[forgery]
    if forgery == "wrapper":
        config["env"]["wrappers"] = [pipepager_wrapper(marker)]
    elif forgery == "imports":
        config["env"]["imports"] = ["evil_module"]
    else:
        config["env"]["id"] = "evil_module:Evil-v0"
    config["env"]["allow_imports"] = [module]  # the other side's word: ignored here
    environment = {**os.environ, "PYTHONPATH": str(tmp_path)}
    learner = ForgedLearner(config)
    try:
        link = ["--learner", f"127.0.0.1:{learner.port}", "--set", "transport.give_up_after_s=20"]
        refused_import(apex_command("actor", *link, env=environment), "actor", module)
        refused_import(
            apex_command("serve", *link, "--http", f"127.0.0.1:{free_port()}", env=environment), "serve", module
        )
        assert not marker.exists()
        # Allowed by the actor's own side, the same welcome runs the code: the check stopped it.
        allowed = subprocess.Popen(
            [sys.executable, "-m", "apex", "actor", *link, "--allow-import", module],
            env=environment,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_for(marker.exists, 60, "the allowed module's code to run")
        finally:
            allowed.kill()
            allowed.wait()
    finally:
        learner.close()


def forged_setup(algo: str, edit) -> dict:
    """A genuine welcome's setup (Ape-X: the ladder of one environment), changed by ``edit``."""
    setup = {"config": config_module.load(None, [f"algo={algo}"]).to_dict(), "num_envs": 1, "seed": 0}
    if algo == "apex_dqn":
        setup.update(epsilons=[0.4], eval_envs=[False])
    edit(setup)
    return setup


FORGED_SIZES = {  # a welcome's sizes before: a traceback, or an actor making 10**9 environments
    "frame_stack": (
        "impala",
        lambda s: s["config"]["env"].update(frame_stack=10**9),
        "env.frame_stack must be in 1..64",
    ),
    "hidden": (
        "impala",
        lambda s: s["config"]["model"].update(hidden=[10**9]),
        "model.hidden must be at most 16 sizes",
    ),
    "num_envs": ("impala", lambda s: s.update(num_envs=10**9), "setup.num_envs must be in 1..4096"),
    "seed": ("impala", lambda s: s.update(seed="0"), "setup.seed must be a int"),
    "no_epsilons": ("apex_dqn", lambda s: s.pop("epsilons"), "setup.epsilons must be a list of 1 numbers in [0, 1]"),
    "nan_epsilon": ("apex_dqn", lambda s: s.update(epsilons=[float("nan")]), "setup.epsilons must be a list of 1"),
    "eval_envs": (
        "apex_dqn",
        lambda s: s.update(eval_envs=[False] * 5),
        "setup.eval_envs must be a list of 1 booleans",
    ),
}


@pytest.mark.parametrize("forgery", list(FORGED_SIZES))
def test_a_forged_welcomes_sizes_and_ladder_are_one_line_not_a_traceback(tmp_path, forgery):
    """Found by the pass after round two: env.frame_stack 1e9 gave a RuntimeError traceback,
    num_envs 10**9 had the actor try to make 10**9 environments, an Ape-X welcome without
    epsilons was a KeyError traceback. Each is now one line naming the field, exit 2, from
    apex actor and apex serve alike."""
    algo, edit, words = FORGED_SIZES[forgery]
    learner = ForgedLearner({}, forged_setup(algo, edit))
    try:
        link = ["--learner", f"127.0.0.1:{learner.port}", "--set", "transport.give_up_after_s=20"]
        commands = {"actor": [], "serve": ["--http", f"127.0.0.1:{free_port()}"]}
        for command in commands if forgery in ("frame_stack", "no_epsilons") else ["actor"]:
            result = apex_command(command, *link, *commands[command], timeout=60)
            assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
            # one error (a config's lists each problem on a line of its own below it)
            [error] = [
                i for i, line in enumerate(result.stderr.splitlines()) if line.startswith(f"apex {command}: error")
            ]
            assert words in "\n".join(result.stderr.splitlines()[error:]), result.stderr[-3000:]
    finally:
        learner.close()


# -- 3: finite poison


def http_json(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def update_rate(run: Run, during: Callable[[], None]) -> float:
    """The learner's updates a second while ``during`` runs, by its own metrics rows' clock
    (rows come every 0.5 s: timing them from here read rates off by a row's worth)."""
    first = run.row()
    during()
    wait_for(lambda: run.row().get("time", 0) > first.get("time", 0), 10, "a metrics row")
    last = run.row()
    return (last["learner_updates"] - first["learner_updates"]) / (last["time"] - first["time"])


def test_finite_poison_is_refused_by_the_learner_and_by_apex_serve(tmp_path):
    """1e30 in CartPole's unbounded velocity is finite as float32: before, most updates went
    non-finite while it came (3-29% applied) and after. Now it is refused at the door, by
    the batch schema (an admitted actor) and by apex serve (HTTP), counted, and the learner
    trains on while it comes."""
    run = Run(tmp_path, "apex_dqn")
    served = None
    try:
        # apex serve starts only after the rates are measured: its start-up (torch's import)
        # on a 2-core machine took the learner from 98 to 40 updates/s in CI, poison or not
        unloaded = update_rate(run, lambda: time.sleep(5))
        peer = run.session()
        batch = honest_batch(peer)
        poisoned = {**batch, "frames": batch["frames"].copy()}
        poisoned["frames"][:, 1] = 1e30
        before = run.rejected("out_of_range")
        sent = 0

        def poison() -> None:
            nonlocal sent
            started = time.monotonic()
            while time.monotonic() - started < 5:
                send(peer, poisoned)
                sent += 1
                time.sleep(0.05)

        loaded = update_rate(run, poison)
        run.wait_rejected("out_of_range", before + sent)
        # The sender shares the 2 cores with the run's actor, whose inserts pace the updates:
        # 0.73-0.93 of the unloaded rate on a quiet machine, 0.53 with one core busy (CI runs
        # the module's other learners beside it). A learner choking on the poison falls to ~0.
        assert loaded >= 0.25 * unloaded, (loaded, unloaded)
        assert run.row()["skipped_updates"] == 0
        # It would go silent while apex serve starts (seconds under load) and be dropped as a
        # silent session: the last check takes a fresh one.
        peer.close()

        serve_port = free_port()
        served = start(
            "serve",
            "--learner",
            f"127.0.0.1:{run.port}",
            "--http",
            f"127.0.0.1:{serve_port}",
            *FAST[:4],
            log=tmp_path / "serve.log",
        )
        wait_for(
            lambda: (tmp_path / "serve.log").exists() and "serving" in (tmp_path / "serve.log").read_text(),
            60,
            "apex serve to serve",
        )
        status, opened = http_json(serve_port, "POST", "/v1/episodes", {})
        assert status in (200, 201), opened
        action = f"/v1/episodes/{opened['episode_id']}/action"
        status, reply = http_json(serve_port, "POST", action, {"observation": [0.0, 1e30, 0.0, 0.0]})
        assert status == 400 and "over 1e+06 in size" in json.dumps(reply), reply
        assert http_json(serve_port, "POST", action, {"observation": [0.0, 0.5, 0.0, 0.0]})[0] == 200
        assert http_json(serve_port, "GET", "/v1/health")[1]["rejected_by_reason"].get("observation") == 1
        trains_on_with_finite_weights(run, run.session())
    finally:
        if served is not None:
            served.terminate()
            served.wait(30)
        run.stop()


# -- An admitted peer's priorities (found by the pass after round two)


def test_an_admitted_peers_huge_priorities_are_capped_and_do_not_take_every_sample(tmp_path):
    """Initial priorities of FLOAT32_MAX (in the schema's range) took almost every sample
    before, with importance weights near 0: the loss read 0.0 for every update while nothing
    was skipped or refused. They are now held to twice the learner's largest |td|, counted,
    and the honest replay goes on being learnt from (a loss that is not zero)."""
    run = Run(tmp_path, "apex_dqn")
    try:
        peer = run.session()
        batch = honest_batch(peer)
        flood = {**batch, "priority": np.full_like(batch["priority"], np.finfo(np.float32).max)}
        started, sent = time.monotonic(), 0
        while time.monotonic() - started < 6:
            send(peer, flood)
            sent += len(flood["priority"])
            time.sleep(0.02)
        wait_for(lambda: run.row().get("capped_priorities", 0) >= sent, 20, f"{sent} capped priorities: {run.row()}")
        run.wait_updating()
        row = run.row()
        assert row["skipped_updates"] == 0
        assert row["loss"] > 1e-6, row  # the broken cap: importance weights of ~1e-20, a loss of 0.0
        assert row["priority_mean"] < 1e6, row  # FLOAT32_MAX ** alpha is ~1e23
        trains_on_with_finite_weights(run, peer)
    finally:
        run.stop()
