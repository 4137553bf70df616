"""The `apex` console script as a user runs it, and each benchmark run for real."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest


def test_console_script_is_installed():
    assert shutil.which("apex"), "pip install should put the `apex` console script on PATH"
    out = subprocess.run(["apex", "--help"], capture_output=True, text=True, check=True).stdout
    assert "bench" in out


def test_bench_sumtree_writes_the_json_report(tmp_path):
    report_path = tmp_path / "out" / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "apex.cli", "bench", "sumtree", "--seconds", "0.02", "--json", str(report_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "learner_step" in result.stdout
    report = json.loads(report_path.read_text())
    rows = report["sumtree"]["results"]
    assert {(r["capacity"], r["op"]) for r in rows} == {
        (c, op) for c in (2**20, 2**16) for op in ("update", "sample", "learner_step", "insert_64")
    }
    for row in rows:
        assert row["native_p50_us"] > 0 and row["numpy_p50_us"] > 0
        assert row["speedup_vs_numpy"] == pytest.approx(row["numpy_p50_us"] / row["native_p50_us"], rel=0.01)
    assert report["sumtree"]["baseline"]
    assert report["sumtree"]["machine"]["cpus"] >= 1


def test_bench_codec_and_transport_report_against_pickle(tmp_path):
    report_path = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "apex.cli",
            "bench",
            "codec",
            "transport",
            "--seconds",
            "0.2",
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    codec_rows = {r["batch"]: r for r in report["codec"]["results"]}
    assert set(codec_rows) == {"cartpole", "atari"}
    # frames once + lz4: far fewer bytes than the pickled stacks
    assert codec_rows["atari"]["wire_bytes"] * 8 < codec_rows["atari"]["pickle_wire_bytes"]
    rows = report["transport"]["results"]
    assert {(r["transport"], r["senders"], r["batch"]) for r in rows} == {
        (t, s, b) for t in ("tcp", "ipc") for s in (1, 4) for b in ("cartpole", "atari")
    }
    assert all(r["transitions_per_s"] > 0 and r["pickle_transitions_per_s"] > 0 for r in rows)


def test_bench_ingest_learner_and_e2e_report_their_figures(tmp_path):
    report_path = tmp_path / "bench.json"
    plot = tmp_path / "scaling.png"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "apex.cli",
            "bench",
            "ingest",
            "learner",
            "e2e",
            "--seconds",
            "2",
            "--actors",
            "1",
            "--ranks",
            "1,2",
            "--plot",
            str(plot),
            "--json",
            str(report_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    ingest = {r["batch"]: r for r in report["ingest"]["results"]}
    assert ingest["cartpole"]["transitions_per_s"] > 0 and ingest["cartpole"]["training_updates_per_s"] > 0
    assert ingest["cartpole"]["rejected_messages"] == 0
    assert "atari" in ingest or "atari" in report["ingest"]["skipped"]
    learner = {(r["model"], r["device"], r["ranks"]): r for r in report["learner"]["results"]}
    assert learner[("mlp", "cpu", 1)]["batches_per_s"] > 0 and learner[("nature_cnn", "cpu", 1)]["batch"] == 512
    assert (
        learner[("mlp", "cpu", 1)]["pipelined_vs_update_only"] > 0 and learner[("mlp", "cpu", 1)]["time_train_ms"] > 0
    )
    for model in ("mlp", "nature_cnn"):  # two learner processes over gloo: both ranks' samples, the leader's sections
        pair = learner[(model, "cpu", 2)]
        assert (
            pair["samples_per_s"] == pytest.approx(2 * 512 * pair["batches_per_s"], rel=1e-2)
            and pair["scaling_efficiency"] > 0
        )
        assert pair["time_train_ms"] > 0 and pair["time_sample_ms"] > 0
    (row,) = report["e2e"]["results"]
    assert row["actors"] == 1 and row["env_steps_per_s"] > 0 and row["updates_per_s"] > 0
    assert row["learner_cpu_percent"] > 0 and row["actor_peak_rss_mb"] > 0
    assert plot.stat().st_size > 1000


def test_bench_flood_measures_every_phase_and_counts_the_refused(tmp_path):
    report_path = tmp_path / "flood.json"
    result = subprocess.run(
        [sys.executable, "-m", "apex", "bench", "flood", "--seconds", "4", "--json", str(report_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode in (0, 2), result.stderr[
        -3000:
    ]  # 2: a ratio fell short; the report is written all the same
    report = json.loads(report_path.read_text())["flood"]
    phases = {r["phase"]: r for r in report["results"]}
    assert list(phases) == [
        "unloaded",
        "hello flood",
        "control garbage",
        "trajectory garbage",
        "unloaded again",
        "all at once",
    ]
    for row in phases.values():
        for key in ("updates_per_s", "env_steps_per_s", "updates_ratio", "env_steps_ratio", "learner_rss_mb"):
            assert isinstance(row[key], (int, float)), (row["phase"], key, row[key])
    assert phases["unloaded"]["updates_per_s"] > 0 and phases["unloaded"]["env_steps_per_s"] > 0
    assert phases["unloaded"]["rejected_messages"] == 0
    assert phases["hello flood"]["rejected_by_reason"].get("hello_rate", 0) > 0
    assert phases["control garbage"]["rejected_by_reason"].get("malformed", 0) > 0
    assert phases["trajectory garbage"]["rejected_by_reason"].get("no_session", 0) > 0
    assert phases["all at once"]["rejected_messages"] > 0
    assert isinstance(report["sigterm_exit_s"], float) and report["learner_exit"] == 0
    assert report["baseline"].startswith("the unloaded phases") and isinstance(report["passed"], bool)


def test_help_imports_nothing_heavy():
    """`apex --help` stays fast (0.1 s here) by building the parser without torch, ZeroMQ,
    gymnasium or the benchmarks."""
    code = (
        "import sys; from apex.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('torch', 'zmq', 'gymnasium', 'numpy', 'apex.bench.e2e') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_apex_run_the_learner_and_an_actor_import_no_engine_they_were_not_asked_for():
    """Ray, W&B and MLflow (the ray, wandb and mlflow extras) load only with --ray and --track."""
    code = (
        "import sys, apex.cli, apex.run.launch, apex.learner.process, apex.actor.process; apex.cli.build_parser(); "
        "print(sorted(m for m in ('wandb', 'mlflow', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
