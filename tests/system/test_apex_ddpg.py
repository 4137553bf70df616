"""Ape-X DDPG through real processes: `apex run --algo apex_ddpg` learns Pendulum with its
defaults; `apex eval` and `apex.load_policy` play the checkpoint's policy without noise; the run
resumes with its policy-update count; a discrete environment is refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from apex import load_policy
from apex.bench.transport import free_base_port
from tests.support.learning import assert_reached
from tests.support.paths import ROOT
from tests.support.runs import metrics

pytestmark = pytest.mark.timeout(400)


def apex(*args: str, timeout: float = 280) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "apex", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
    )


def test_apex_ddpg_learns_pendulum_with_its_defaults_plays_and_resumes(tmp_path):
    """Measured 46 s to -200 with the defaults on this 2-core VM (the issue's target: 2 minutes)."""
    logdir = tmp_path / "run"
    out = apex(
        "run", "--algo", "apex_ddpg", "--env", "Pendulum-v1", "--port", str(free_base_port()),
        "--stop-return", "-200", "--stop-seconds", "240", "--logdir", str(logdir),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((logdir / "summary.json").read_text())
    print(f"Pendulum-v1: {summary['stop_reason']}, {summary['env_steps']} env steps, {summary['wall_seconds']} s")
    assert_reached(summary, -200)
    row = metrics(logdir)[-1]
    assert row["rejected_messages"] == 0 and row["policy_updates"] >= 1
    assert "policy_loss" in {key for r in metrics(logdir) for key in r}

    checkpoint = sorted((logdir / "checkpoints").glob("ckpt-*.pt"))[-1]
    state = torch.load(checkpoint, weights_only=True)
    assert {"online", "target", "policy", "optimizer", "policy_updates"} <= state.keys()
    assert any(name.startswith("critics.1.") for name in state["online"])  # twin critics
    policy = load_policy(logdir, which="best")
    torque = np.asarray(policy.act([1.0, 0.0, 0.0]))
    assert torque.shape == (1,) and -2.0 <= float(torque[0]) <= 2.0
    played = apex("eval", "--checkpoint", str(logdir), "--episodes", "5", "--json", str(tmp_path / "eval.json"))
    assert played.returncode == 0, played.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())["return_mean"] > -400

    port = str(free_base_port())
    resumed = apex("run", "--resume", str(logdir), "--actors", "1", "--stop-seconds", "3", "--port", port)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint.stem}" in resumed.stderr
    assert metrics(logdir)[-1]["policy_updates"] >= state["policy_updates"]


def test_apex_ddpg_on_discrete_actions_is_one_line_naming_the_algorithms_that_take_them(tmp_path):
    out = apex("run", "--algo", "apex_ddpg", "--env", "CartPole-v1", "--logdir", str(tmp_path / "run"), timeout=60)
    assert out.returncode != 0
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "apex_ddpg needs continuous (Box) actions" in lines[0], out.stderr
    assert "--algo apex_dqn" in lines[0]
