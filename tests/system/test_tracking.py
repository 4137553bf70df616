"""Experiment tracking (`--track wandb|mlflow`, config logging.track): a real `apex run` sends
the resolved config, every metrics row, the summary and the best checkpoint to an offline W&B
run and a local MLflow run, read back here through each library's own record formats; a
tracker that fails is logged and the run goes on. (That neither library, nor Ray, is imported
unless asked for: tests/system/test_cli.py.)"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from tests.support.runs import metrics

mlflow = pytest.importorskip("mlflow", reason="the mlflow extra (.ci/run installs it)")
wandb_proto = pytest.importorskip("wandb.proto.wandb_internal_pb2", reason="the wandb extra (.ci/run installs it)")


def apex_run(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    from apex.bench.transport import free_base_port

    environment = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    environment.update(env or {}, PYTHONPATH=str(ROOT), WANDB_SILENT="true")
    return subprocess.run(
        [sys.executable, "-m", "apex", "run", "--config", "cartpole_impala", "--port", str(free_base_port()), *args],
        cwd=tmp_path,  # MLflow's default store: mlflow.db and mlruns/ here
        env=environment,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (its LevelDB-log framing of the library's protobuf
    records: 32 KiB blocks of [crc32c, length, type] chunks after a 7-byte header)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        room = block - offset % block
        if room < 7:  # a block's tail too short for a header: padding
            offset += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + 7])
        chunk = data[offset + 7 : offset + 7 + length]
        offset += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL, FIRST / MIDDLE, LAST
        if kind in (1, 4):
            record = wandb_proto.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def key(item) -> str:
    """A W&B record item's name: its key, or its nested key's path."""
    return item.key or "/".join(item.nested_key)


def test_an_offline_wandb_run_and_a_local_mlflow_run_hold_the_config_metrics_summary_and_best_checkpoint(tmp_path):
    out = apex_run(tmp_path, "--track", "wandb", "--track", "mlflow", "--stop-seconds", "10", "--logdir", "run")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "failed" not in out.stderr, out.stderr[-2000:]
    rows = metrics(tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())

    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("apex").experiment_id])
    assert run.info.run_name == "run" and run.info.status == "FINISHED"
    assert run.data.params["algo"] == "impala" and run.data.params["impala.lr"] == "0.002"
    history = client.get_metric_history(run.info.run_id, "throughput/env_steps_per_s")
    assert len(history) == len(rows) and history[-1].step == rows[-1]["env_steps"]
    assert run.data.metrics["summary/env_steps"] == summary["env_steps"]
    artifacts = sorted(a.path for a in client.list_artifacts(run.info.run_id, "best_checkpoint"))
    assert [Path(a).suffix for a in artifacts] == [".json", ".pt"]

    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    kinds = [r.WhichOneof("record_type") for r in records]
    updates = [i for r in records if r.HasField("run") for i in r.run.config.update]  # the config, at init
    updates += [i for r in records if r.HasField("config") for i in r.config.update]
    config = {key(i): json.loads(i.value_json) for i in updates}
    assert config["algo"] == "impala" and config["impala"]["lr"] == 0.002
    history_rows = [
        {key(i): json.loads(i.value_json) for i in r.history.item} for r in records if r.HasField("history")
    ]
    assert len(history_rows) == len(rows)
    assert history_rows[-1]["env_steps"] == rows[-1]["env_steps"]
    assert "return/return_mean_100" in history_rows[-1]
    final = {key(i): json.loads(i.value_json) for r in records if r.HasField("summary") for i in r.summary.update}
    assert final["env_steps"] == summary["env_steps"]
    assert "artifact" in kinds  # the best checkpoint


def test_a_tracker_that_fails_is_logged_once_and_the_run_goes_on(tmp_path):
    out = apex_run(
        tmp_path, "--track", "mlflow", "--stop-seconds", "6", "--logdir", "run", env={"MLFLOW_TRACKING_URI": "bogus:/x"}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.count("--track mlflow failed") == 1, out.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["env_steps"] > 0


def first_row_s(args: list[str], cwd: Path, env: dict) -> tuple[float, subprocess.Popen]:
    """Seconds from an `apex run`'s start to its first metrics row, and its process."""
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "apex", "run", *args], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True
    )
    rows = cwd / "run" / "metrics.jsonl"
    while not (rows.exists() and rows.read_text().strip()):
        assert proc.poll() is None and time.monotonic() - started < 120, "no metrics row"
        time.sleep(0.1)
    return time.monotonic() - started, proc


def test_a_tracker_whose_server_accepts_and_never_answers_is_dropped_and_the_run_reaches_its_stop_return(
    tmp_path,
):
    from apex.bench.transport import free_base_port

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes each connection; nothing ever reads or answers
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    environment.update(PYTHONPATH=str(ROOT), MLFLOW_TRACKING_URI=f"http://127.0.0.1:{silent.getsockname()[1]}")
    common = ["--config", "cartpole_impala", "--logdir", "run", "--stop-return", "400", "--stop-seconds", "100"]
    seconds = {}
    for name, extra in (("untracked", []), ("tracked", ["--track", "mlflow"])):
        (tmp_path / name).mkdir()
        args = [*common, *extra, "--port", str(free_base_port())]
        seconds[name], proc = first_row_s(args, tmp_path / name, environment)
        _, stderr = proc.communicate(timeout=150)
        assert proc.returncode == 0, stderr[-2000:]
        summary = json.loads((tmp_path / name / "run" / "summary.json").read_text())
        assert summary["stop_reason"].startswith("return_mean_100"), summary  # reached its stop return
    silent.close()
    assert seconds["tracked"] < seconds["untracked"] + 10, seconds
    warnings = [line for line in stderr.splitlines() if "--track mlflow" in line]
    assert len(warnings) == 1 and "dropped" in warnings[0], stderr[-2000:]
    assert "urllib3" not in stderr  # MLflow's retries are not a second warning


OUTSIDE = "/etc/apex-test-tracker"  # root's: a tracker that wrote there would create it


@pytest.mark.parametrize(
    ("mlflow_uri", "wandb_variable", "wandb_dir"),
    [
        ("file:../outside/mlruns", "WANDB_DATA_DIR", "{outside}/wandb"),
        (f"file://{OUTSIDE}/mlruns", "WANDB_DIR", OUTSIDE),
        (f"sqlite:///{OUTSIDE}.db", "WANDB_CACHE_DIR", "../outside/cache"),
    ],
)
def test_a_local_store_outside_the_run_is_refused_and_nothing_is_written_there(
    tmp_path, mlflow_uri, wandb_variable, wandb_dir
):
    """An MLflow store or a W&B directory that points outside the run (`/etc`, `../`): one
    warning each naming the variable, the run goes on without that tracker, nothing is
    written there."""
    work, outside = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    out = apex_run(
        work,
        *("--track", "mlflow", "--track", "wandb", "--stop-seconds", "6", "--logdir", "run"),
        env={"MLFLOW_TRACKING_URI": mlflow_uri, wandb_variable: wandb_dir.format(outside=outside)},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stderr.count("--track mlflow: MLFLOW_TRACKING_URI") == 1, out.stderr[-2000:]
    assert out.stderr.count(f"--track wandb: {wandb_variable}") == 1, out.stderr[-2000:]
    assert not outside.exists()
    assert not Path(OUTSIDE).exists() and not Path(f"{OUTSIDE}.db").exists()
    assert json.loads((work / "run" / "summary.json").read_text())["env_steps"] > 0


def test_a_run_directory_of_any_name_is_a_finished_run_at_both_trackers(tmp_path):
    """A LOGDIR whose name has spaces, shell and non-ASCII characters and 230 bytes: both
    runs finish, named by its first 128 characters, and W&B holds the best checkpoint under a
    name it allows. (Before: `wandb.Artifact` refused the name, the W&B run never finished.)"""
    name = "my run; $(id) `x` ü " + "x" * 200
    out = apex_run(tmp_path, "--track", "wandb", "--track", "mlflow", "--stop-seconds", "6", "--logdir", name)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "the run goes on without it" not in out.stderr, out.stderr[-2000:]
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("apex").experiment_id])
    assert run.info.run_name == name[:128] and run.info.status == "FINISHED"
    (run_file,) = (tmp_path / name / "wandb").glob("offline-run-*/run-*.wandb")
    records = wandb_records(run_file)
    (artifact,) = [r.artifact for r in records if r.HasField("artifact")]
    assert len(artifact.name) <= 128 and artifact.name.endswith("-best"), artifact.name
    assert any(r.HasField("exit") for r in records)  # the run finished
