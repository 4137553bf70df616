"""Observation and action spaces in real runs: `apex run` with learner and actor processes on
the environments of tests/envs.py, on Catch from pixels and on MinAtar, and a refusal in
the parent."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apex.bench.transport import free_base_port
from tests.support.learning import assert_reached
from tests.support.paths import ROOT

# -- actions


def test_apex_run_refuses_multidiscrete_actions_for_apex_dqn_in_the_parent(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "apex",
            "run",
            "--env",
            "tests.envs:apex-test/MultiDial-v0",
            "--logdir",
            str(tmp_path / "run"),
            "--port",
            str(free_base_port()),
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--algo impala" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


# -- real runs: `apex run` with learner and actor processes


FAST = ["--actors", "1", "--set", "learner.metrics_interval_s=0.5", "--set", "transport.heartbeat_interval_s=0.2"]
APEX_SMALL = [
    "--set",
    "actor.num_envs=4",
    "--set",
    "apex_dqn.replay.capacity=20000",
    "--set",
    "apex_dqn.replay.min_size=500",
    "--set",
    "apex_dqn.batch_size=64",
]
# CartPole's preset scales rewards by 0.1 against its returns near 500; these tasks pay at most 1,
# so they keep their rewards as they are (at 0.1 the entropy bonus outweighed the Corridor's goal).
IMPALA_SMALL = [
    "--config",
    "cartpole_impala",
    "--set",
    "env.reward_scale=1.0",
    "--set",
    "actor.num_envs=8",
    "--set",
    "impala.batch_unrolls=8",
    "--set",
    "impala.unroll_length=10",
    "--set",
    "impala.queue_size=32",
]


def apex_run(
    logdir: Path, env_id: str, stop_return: float, seconds: float, *args: str
) -> tuple[dict, list[dict], float]:
    """`python -m apex run` from the repository root; (summary.json, metrics rows, wall seconds)."""
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "apex",
            "run",
            "--env",
            env_id,
            "--logdir",
            str(logdir),
            "--port",
            str(free_base_port()),
            "--stop-return",
            str(stop_return),
            "--stop-seconds",
            str(seconds),
            *FAST,
            *args,
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=seconds + 90,
    )
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((logdir / "summary.json").read_text())
    rows = [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    print(
        f"{env_id}: {summary['stop_reason']}, return_mean_100 {summary['return_mean_100']}, "
        f"{summary['env_steps']} env steps, {summary['wall_seconds']} s (wall {wall:.1f} s)"
    )
    return summary, rows, wall


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
@pytest.mark.parametrize("env_id", ["apex-test/Corridor-v0", "apex-test/DictGoal-v0"])
def test_vector_adapters_train_to_the_optimum(tmp_path, env_id, algo):
    """Discrete observations (one-hot) and Dict ones (flattened): the optimum is 1.0, the
    Corridor's trap 0.1."""
    small = APEX_SMALL if algo == "apex_dqn" else IMPALA_SMALL
    summary, _, _ = apex_run(tmp_path / "run", f"tests.envs:{env_id}", 0.95, 120, *small)
    assert_reached(summary, 0.95)


def test_impala_trains_a_multidiscrete_policy_to_the_optimum(tmp_path):
    summary, _, _ = apex_run(tmp_path / "run", "tests.envs:apex-test/MultiDial-v0", 0.95, 120, *IMPALA_SMALL)
    assert_reached(summary, 0.95)


CATCH_FRAME_BYTES = 40 * 40  # one uint8 frame


def test_apex_dqn_learns_catch_from_pixels_storing_each_frame_once(tmp_path):
    summary, rows, _ = apex_run(
        tmp_path / "run",
        "tests.envs:apex-test/Catch-v0",
        0.9,
        180,
        "--set",
        "actor.num_envs=8",
        "--set",
        "apex_dqn.replay.capacity=20000",
        "--set",
        "apex_dqn.replay.min_size=1000",
        "--set",
        "apex_dqn.batch_size=64",
        "--set",
        "apex_dqn.target_update_interval=100",
        "--set",
        "apex_dqn.lr=5e-4",
        "--set",
        "apex_dqn.replay_ratio=2",
    )
    assert_reached(summary, 0.9)
    per_transition = rows[-1]["replay_bytes_per_transition"]
    # the frame ring holds capacity * 1.125 + 4096 frames; a replay of 4-frame stacks would need 4+ frames a transition
    assert CATCH_FRAME_BYTES < per_transition < 1.6 * CATCH_FRAME_BYTES, per_transition


def test_impala_learns_catch_from_pixels(tmp_path):
    # One frame shows where the ball and the paddle are (the ball falls straight down): with
    # the default stack of 4 the run took 25-100 s and sometimes the whole 180 s under CI's
    # load; with 1, 14-31 s over seeds 1-4, but seed 0 took 32-116 s in three runs here and one
    # CI run stopped at 180 s with a best of 0.88: 300 s keeps the test about learning, not speed.
    summary, _, _ = apex_run(
        tmp_path / "run", "tests.envs:apex-test/Catch-v0", 0.9, 300, *IMPALA_SMALL, "--set", "env.frame_stack=1"
    )
    assert_reached(summary, 0.9)


# -- MinAtar, through the generic image path (no MinAtar code in apex)


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_minatar_runs_through_the_image_path(tmp_path, algo):
    """MinAtar's ids come from its gymnasium.envs entry point; its 10 x 10 x C bool frames
    become C x 10 x 10 uint8 ones for the small conv torso."""
    pytest.importorskip("minatar")
    small = APEX_SMALL if algo == "apex_dqn" else IMPALA_SMALL
    logdir = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "apex",
            "run",
            "--env",
            "MinAtar/Breakout-v1",
            "--logdir",
            str(logdir),
            "--port",
            str(free_base_port()),
            "--stop-env-steps",
            "3000",
            "--stop-seconds",
            "120",
            *FAST,
            *small,
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["env_steps"] >= 3000 and summary["learner_updates"] > 0
