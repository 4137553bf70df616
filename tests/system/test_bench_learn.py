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
        [
            sys.executable,
            "-m",
            "apex",
            "bench",
            "learn",
            "--tasks",
            "cartpole,acrobot",
            "--seeds",
            "1",
            "--seconds",
            "6",
            "--json",
            str(tmp_path / "learn.json"),
            "--plot",
            str(tmp_path / "learn.png"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "learn.json").read_text())["learn"]
    assert report["limit_s"] == 6 and report["seeds"] == 1
    assert [(r["task"], r["algo"]) for r in report["runs"]] == [
        ("cartpole", "apex_dqn"),
        ("cartpole", "impala"),
        ("cartpole", "appo"),
        ("acrobot", "apex_dqn"),
        ("acrobot", "impala"),
        ("acrobot", "appo"),
    ]
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
    with pytest.raises(ApexError, match="--tasks pendulum runs with --algos impala, appo, apex_ddpg only"):
        learn.run(tasks="pendulum", algos="apex_dqn")
    with pytest.raises(ApexError, match="--tasks cartpole runs with --algos apex_dqn, impala, appo only"):
        learn.run(tasks="cartpole", algos="apex_ddpg")


def test_bench_learn_runs_each_task_with_the_algorithms_that_take_its_actions(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(learn, "_run_one", _fake_run(calls))
    learn.run(tasks="cartpole,pendulum", seeds=1, seconds=30, runs_dir=str(tmp_path))
    assert [(task, algo) for task, algo, _, _ in calls] == [
        ("cartpole", "apex_dqn"),
        ("cartpole", "impala"),
        ("cartpole", "appo"),
        ("pendulum", "impala"),
        ("pendulum", "appo"),
        ("pendulum", "apex_ddpg"),
    ]


def _fake_run(calls):
    def run_one(task, algo, seed, limit_s, logdir):
        calls.append((task, algo, seed, limit_s))
        logdir.mkdir(parents=True)
        (logdir / "metrics.jsonl").write_text("{}\n")
        return {
            "task": task,
            "algo": algo,
            "seed": seed,
            "threshold": 475.0,
            "limit_s": limit_s,
            "reached": True,
            "time_to_threshold_s": 10.0 + seed,
            "wall_s": 11.0 + seed,
            "startup_s": 2.0,
            "env_steps": 1000,
            "final_return": 480.0,
            "best_return": 490.0,
            "env_steps_per_s": 100.0,
            "updates_per_s": 10.0,
            "curve": [[1.0, 100, 20.0]],
        }

    return run_one


def test_bench_learn_runs_dir_goes_on_where_a_stopped_bench_left_off(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(learn, "_run_one", _fake_run(calls))
    first = learn.run(tasks="cartpole", algos="apex_dqn", seeds=2, seconds=30, runs_dir=str(tmp_path))
    assert calls == [("cartpole", "apex_dqn", 0, 30), ("cartpole", "apex_dqn", 1, 30)]
    assert first["runs_wall_s"] == 23.0
    # a stop during seed 1: its record is gone and its directory is half written
    (tmp_path / "cartpole-apex_dqn-1.json").unlink()
    calls.clear()
    again = learn.run(tasks="cartpole", algos="apex_dqn", seeds=2, seconds=30, runs_dir=str(tmp_path))
    assert calls == [("cartpole", "apex_dqn", 1, 30)]  # seed 0 read back, seed 1 run afresh
    assert [r["seed"] for r in again["runs"]] == [0, 1]
    assert again["summary"] == first["summary"]
    calls.clear()
    learn.run(tasks="cartpole", algos="apex_dqn", seeds=2, seconds=40, runs_dir=str(tmp_path))
    assert len(calls) == 2  # another time limit: recorded runs do not count


def test_bench_learn_runs_dir_reruns_a_retuned_preset_and_names_a_broken_record(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(learn, "_run_one", _fake_run(calls))
    learn.run(tasks="cartpole", algos="apex_dqn", seeds=1, seconds=30, runs_dir=str(tmp_path))
    record = tmp_path / "cartpole-apex_dqn-0.json"
    saved = json.loads(record.read_text())
    saved["config"]["apex_dqn"]["lr"] *= 2  # as if recorded with another preset
    record.write_text(json.dumps(saved))
    learn.run(tasks="cartpole", algos="apex_dqn", seeds=1, seconds=30, runs_dir=str(tmp_path))
    assert len(calls) == 2
    # a key added to the config since (here: dropped from the record) at its default: the same run
    saved = json.loads(record.read_text())
    del saved["config"]["apex_dqn"]["eps_repeat_mu"]
    record.write_text(json.dumps(saved))
    learn.run(tasks="cartpole", algos="apex_dqn", seeds=1, seconds=30, runs_dir=str(tmp_path))
    assert len(calls) == 2
    saved["config"]["apex_dqn"]["eps_repeat_mu"] = 2.0  # but not at another value
    record.write_text(json.dumps(saved))
    learn.run(tasks="cartpole", algos="apex_dqn", seeds=1, seconds=30, runs_dir=str(tmp_path))
    assert len(calls) == 3
    record.write_text("{not json")
    with pytest.raises(ApexError, match="cannot read .*cartpole-apex_dqn-0.json.*delete it"):
        learn.run(tasks="cartpole", algos="apex_dqn", seeds=1, seconds=30, runs_dir=str(tmp_path))


def test_a_task_without_a_preset_runs_the_algorithms_defaults_on_its_env(tmp_path, monkeypatch):
    """The reach row (issue 47) is `apex run --env ... --algo A` as a new user types it, its
    test env imported where allowed; its record keeps the defaults' config."""
    assert learn.TASKS["reach"].run_args("reach", "appo") == [
        "--env",
        "tests.envs:apex-test/Reach-v0",
        "--algo",
        "appo",
        "--allow-import",
        "tests",
    ]
    assert learn.TASKS["pendulum"].run_args("pendulum", "appo") == ["--config", "pendulum_appo"]
    calls = []
    monkeypatch.setattr(learn, "_run_one", _fake_run(calls))
    learn.run(tasks="reach", algos="appo", seeds=1, seconds=30, runs_dir=str(tmp_path))
    record = json.loads((tmp_path / "reach-appo-0.json").read_text())
    assert record["config"]["algo"] == "appo" and record["config"]["env"]["id"] == "tests.envs:apex-test/Reach-v0"
    assert record["config"]["appo"]["replay_ratio"] == 2  # the defaults, not a preset's
