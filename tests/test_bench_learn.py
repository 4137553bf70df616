"""`apex bench learn` as a smoke test: the JSON and the plot, not the learning targets (those
take minutes per run; the README has a full table)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from apex.bench import learn
from apex.errors import ApexError


def test_bench_learn_writes_figures_for_every_run_and_a_plot(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "apex", "bench", "learn", "--tasks", "cartpole,acrobot", "--seeds", "1",
         "--seconds", "6", "--json", str(tmp_path / "learn.json"), "--plot", str(tmp_path / "learn.png")],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "learn.json").read_text())["learn"]
    assert report["limit_s"] == 6 and report["seeds"] == 1
    assert [(r["task"], r["algo"]) for r in report["runs"]] == [
        ("cartpole", "apex_dqn"), ("cartpole", "impala"), ("acrobot", "apex_dqn"), ("acrobot", "impala")]
    for run in report["runs"]:
        assert run["env_steps"] > 0 and run["updates_per_s"] > 0
        assert run["curve"] and all(len(point) == 3 for point in run["curve"])
        assert 0 < run["startup_s"] < run["wall_s"]
        if run["reached"]:  # IMPALA's -100 on Acrobot can come within 6 s
            assert 0 < run["time_to_threshold_s"] <= run["wall_s"]
        else:
            assert run["time_to_threshold_s"] is None and run["wall_s"] >= 6
    assert {(s["task"], s["algo"]) for s in report["summary"]} == {(r["task"], r["algo"]) for r in report["runs"]}
    assert (tmp_path / "learn.png").stat().st_size > 10_000
    assert "learn: median over 1 seed(s)" in out.stdout and "CleanRL DQN 488.7 at 500k steps" in out.stdout


def test_bench_learn_names_unknown_tasks_and_algos():
    with pytest.raises(ApexError, match="--tasks takes a comma-separated list of cartpole"):
        learn.run(tasks="cartpole,pong")
    with pytest.raises(ApexError, match="--algos"):
        learn.run(algos="ppo")
