"""Real learner and actor processes on localhost, started the way a user starts them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from apex.bench.transport import free_base_port
from apex.wire import protocol
from tests.support.paths import ROOT
from tests.support.processes import apex, kill_leftovers, processes_mentioning, wait_for
from tests.support.runs import FAST, metrics

CONTRACT_METRICS = {
    "time",
    "env_steps",
    "learner_updates",
    "env_steps_per_s",
    "updates_per_s",
    "episodes",
    "return_mean_100",
    "replay_size",
    "actors_connected",
    "weights_version",
    "rejected_messages",
}


def test_run_writes_the_run_output_and_leaves_nothing_behind(tmp_path):
    logdir = tmp_path / "run"
    # Rows every 0.1 s: the run may reach its 20,000 env steps within the first 0.5 s.
    proc = apex(
        "run",
        "--actors",
        "2",
        "--logdir",
        str(logdir),
        "--port",
        str(free_base_port()),
        "--stop-env-steps",
        "20000",
        *FAST,
        "--set",
        "learner.metrics_interval_s=0.1",
    )
    _out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["stop_reason"] == "20000 env steps"
    assert summary["env_steps"] >= 20000 and summary["learner_updates"] > 0
    assert {"wall_seconds", "return_mean_100", "best_return_mean_100"} <= summary.keys()
    rows = metrics(logdir)
    assert len(rows) >= 2 and all(row.keys() >= CONTRACT_METRICS for row in rows)
    assert max(r["actors_connected"] for r in rows) == 2
    assert rows[-1]["env_steps"] == summary["env_steps"]
    # the pipelined learner's time per step by section, in every row that covers steps
    stepped = [r for r in rows if "time_train_ms" in r]
    assert stepped and all(
        r["time_train_ms"] > 0 and r["time_sample_ms"] >= 0 and r["time_write_back_ms"] >= 0 and r["time_idle_ms"] >= 0
        for r in stepped
    )
    assert any(r["time_sample_ms"] > 0 for r in stepped)  # a row may train on batches a refill staged before it
    assert list((logdir / "checkpoints").glob("ckpt-*.pt"))
    time.sleep(0.5)
    assert processes_mentioning(str(logdir)) == []


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_killed_run_leaves_no_process_and_its_ports_serve_the_next_run(tmp_path, ranks):
    port = str(free_base_port())
    logdir = tmp_path / "run"
    args = ["run", "--actors", "2", "--ranks", str(ranks), "--port", port, *FAST]
    proc = apex(*args, "--logdir", str(logdir), "--stop-seconds", "120", stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: (logdir / "metrics.jsonl").exists(), 90, "the first metrics row")
        assert len(processes_mentioning(str(logdir))) >= ranks + 3  # apex run, its ranks, 2 actors
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        wait_for(lambda: processes_mentioning(str(logdir)) == [], 5, "no process of the killed run")
    finally:
        kill_leftovers([proc])
        for line in processes_mentioning(str(logdir)):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    again = apex(*args, "--logdir", str(tmp_path / "again"), "--stop-env-steps", "2000", stdout=subprocess.DEVNULL)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-2000:]
    assert json.loads((tmp_path / "again" / "summary.json").read_text())["env_steps"] >= 2000


def test_a_child_whose_parent_died_before_it_could_be_told_and_that_ignores_sigterm_still_ends(tmp_path):
    """The watchdog's two cases: no parent-death signal was set (the parent died first) and
    the child's main path never reaches its stop (here: SIGTERM ignored)."""
    child = (
        "import signal, sys, time; from apex.system.parent import watch_parent; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); watch_parent(); print('up', flush=True); time.sleep(60)"
    )
    parent = (
        "import subprocess, sys; from apex.system.parent import child_environment; "
        f"c = subprocess.Popen([sys.executable, '-c', {child!r}], env=child_environment(), stdout=subprocess.PIPE); "
        "assert c.stdout.readline() == b'up\\n'; print(c.pid, flush=True)"
    )  # exits at once: the child is left with no parent-death signal, as in the race
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout)

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"

    wait_for(gone, 8, "the orphaned child's end")
    assert time.monotonic() - started < 10


def test_impala_run_reports_policy_lag(tmp_path):
    logdir = tmp_path / "impala"
    config = ROOT / "configs" / "cartpole_impala.yaml"
    proc = apex(
        "run",
        "--config",
        str(config),
        "--actors",
        "1",
        "--logdir",
        str(logdir),
        "--port",
        str(free_base_port()),
        "--stop-env-steps",
        "20000",
        *FAST,
    )
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    rows = metrics(logdir)
    assert all(row.keys() >= CONTRACT_METRICS for row in rows)
    trained = [r for r in rows if r["learner_updates"] > 0 and r["policy_lag_mean"] is not None]
    assert trained and all(r["policy_lag_max"] >= r["policy_lag_mean"] >= 0 for r in trained)
    assert {"queue_unrolls", "queue_dropped_unrolls", "entropy"} <= rows[-1].keys()
    assert any(r.get("time_train_ms", 0) > 0 and r["time_sample_ms"] > 0 for r in rows)  # IMPALA's pipeline too
    assert json.loads((logdir / "summary.json").read_text())["stop_reason"] == "20000 env steps"


def test_processes_by_hand_survive_a_killed_actor_and_a_bad_sender(tmp_path):
    logdir = tmp_path / "hand"
    port = free_base_port()
    learner = apex(
        "learner",
        "--logdir",
        str(logdir),
        "--bind-host",
        "127.0.0.1",
        "--port",
        str(port),
        "--stop-seconds",
        "120",
        *FAST,
    )
    actor_args = ["actor", "--learner", f"127.0.0.1:{port}", *FAST[:4]]
    actors = [apex(*actor_args) for _ in range(2)]
    try:
        wait_for(lambda: any(r["actors_connected"] == 2 for r in metrics(logdir)), 60, "two actors")
        actors[0].send_signal(signal.SIGKILL)
        actors[0].wait()
        wait_for(lambda: metrics(logdir)[-1]["actors_connected"] == 1, 30, "the killed actor to be dropped")

        # A hostile sender on the trajectory port: garbage, and a well-formed batch with a bad action.
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        push.send_multipart([b"\x00garbage", b"x"])
        push.send_multipart(
            protocol.encode(
                "batch",
                {"actor_index": 9, "weights_version": 0, "info": {}, "session": bytes(16), "seq": 0},
                {
                    "frames": np.zeros((2, 4), np.float32),
                    "obs_frame": np.array([0], np.int32),
                    "next_obs_frame": np.array([1], np.int32),
                    "action": np.array([7]),
                    "reward": np.ones(1, np.float32),
                    "discount": np.ones(1, np.float32),
                    "priority": np.ones(1, np.float32),
                },
            )
        )
        push.close(linger=1000)

        actors[0] = apex(*actor_args)  # restarted: it rejoins
        wait_for(lambda: metrics(logdir)[-1]["actors_connected"] == 2, 60, "the restarted actor")
        wait_for(lambda: metrics(logdir)[-1]["rejected_messages"] >= 2, 30, "the bad messages to be counted")
        steps = metrics(logdir)[-1]["env_steps"]
        wait_for(lambda: metrics(logdir)[-1]["env_steps"] > steps, 30, "training to go on")
        assert learner.poll() is None

        learner.send_signal(signal.SIGTERM)
        learner.wait(timeout=60)
        assert learner.returncode == 0
        assert json.loads((logdir / "summary.json").read_text())["stop_reason"] == "signal SIGTERM"
        for actor in actors:  # told to stop by the learner
            actor.wait(timeout=30)
            assert actor.returncode == 0
    finally:
        kill_leftovers([learner, *actors])


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--set", "env.id=CartPole-v9"],
            "env.id 'CartPole-v9' is not a registered Gymnasium environment; did you mean CartPole-v1?",
        ),
        (["--set", "replay.capacty=5"], "unknown key apex_dqn.replay.capacty; did you mean apex_dqn.replay.capacity?"),
        (["--config", "no/such.yaml"], "config no/such.yaml not found"),
    ],
)
def test_learner_bad_input_is_one_clear_line(args, message, tmp_path):
    proc = apex("learner", "--logdir", str(tmp_path / "x"), "--port", str(free_base_port()), *args)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert message in err
    assert "Traceback" not in err


def test_actor_without_learner_address_is_a_clear_error():
    env = {k: v for k, v in os.environ.items() if k != "APEX_LEARNER"}
    proc = apex("actor", env=env)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--learner HOST[:PORT] is required" in err
