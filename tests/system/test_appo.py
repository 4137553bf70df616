"""APPO through real processes: `apex run --algo appo` solves CartPole with its defaults, and its
checkpoint plays through `apex.load_policy` and resumes (the target network and the KL weight
with it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from apex import load_policy
from apex.bench.transport import free_base_port
from tests.support.learning import assert_reached
from tests.support.paths import ROOT
from tests.support.runs import metrics

pytestmark = pytest.mark.timeout(300)


def apex_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "apex", "run", "--port", str(free_base_port()), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )


def test_appo_solves_cartpole_with_its_defaults_and_resumes(tmp_path):
    logdir = tmp_path / "run"
    out = apex_run(
        "--algo", "appo", "--actors", "2", "--stop-return", "475", "--stop-seconds", "200", "--logdir", str(logdir)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((logdir / "summary.json").read_text())
    assert_reached(summary, 475)
    row = metrics(logdir)[-1]
    assert {"kl", "clip_fraction", "kl_coeff", "queue_reused_unrolls"} <= row.keys()
    assert row["rejected_messages"] == 0

    checkpoint = sorted((logdir / "checkpoints").glob("ckpt-*.pt"))[-1]
    state = torch.load(checkpoint, weights_only=True)
    assert {"net", "target", "optimizer", "kl_coeff"} <= state.keys()
    policy = load_policy(logdir, which="best")
    assert int(policy.act([0.0, 0.0, 0.0, 0.0])) in (0, 1)

    resumed = apex_run("--resume", str(logdir), "--actors", "1", "--stop-seconds", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {checkpoint.stem}" in resumed.stderr
    assert "starting appo on CartPole-v1" in out.stderr
