"""`apex eval` and `apex plot` as processes: a forged checkpoint runs no code, and bad rows
and run files that are not regular files are said in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from apex.cli import main
from tests.support.checkpoints import full_state
from tests.support.runs import metrics_run


def test_eval_of_a_forged_checkpoint_runs_no_code_and_says_so_in_one_line(checkpoint, tmp_path):
    from apex.checkpoint import CheckpointWriter
    from tests.support.checkpoints import RunsCode

    marker = tmp_path / "marker"
    run = tmp_path / "run"
    writer = CheckpointWriter(run / "checkpoints", keep=3)
    writer.save("ckpt-000000001", full_state(checkpoint, 1))
    # The manifest's size and CRC-32 match: only loading can tell.
    writer.save("ckpt-000000002", {**full_state(checkpoint, 2), "online": RunsCode(marker)})
    forged = run / "checkpoints" / "ckpt-000000002.pt"
    result = subprocess.run(
        [sys.executable, "-m", "apex", "eval", "--checkpoint", str(forged)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("apex eval: error: checkpoint "), result.stderr
    assert "without running code" in lines[0]
    assert not marker.exists()
    # Given the run, eval sets the forged one aside and plays the one before.
    result = subprocess.run(
        [sys.executable, "-m", "apex", "eval", "--checkpoint", str(run), "--episodes", "1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "ckpt-000000002 refused" in result.stderr and "(apex_dqn, 1 updates)" in result.stdout
    assert not marker.exists()


def test_plot_draws_the_good_rows_and_says_in_one_line_how_many_it_skipped(tmp_path):
    """Issue 30, item 11: rows that are not objects, string times, NaN or 1e400 (inf to
    Python's json) ended apex plot in a TypeError traceback."""
    logdir = tmp_path / "run"
    logdir.mkdir()
    good = [
        json.dumps({"time": t, "env_steps": 1000 * t, "env_steps_per_s": 1000.0, "return_mean_100": t / 2})
        for t in range(1, 6)
    ]
    bad = [
        "[1, 2]",
        '"a string"',
        "null",
        '{"time": "3", "env_steps": 1, "env_steps_per_s": 1}',
        '{"time": NaN, "env_steps": 1, "env_steps_per_s": 1}',
        '{"time": 7, "env_steps": 1e400, "env_steps_per_s": 1}',
        '{"time": 8, "env_steps": 1, "env_steps_per_s": 1, "return_mean_100": Infinity}',
        '{"time": 9, "env_steps": 1' + "0" * 400 + ', "env_steps_per_s": 1}',  # an integer past any float
        '{"time": true, "env_steps": 1, "env_steps_per_s": 1}',
        '{"env_steps": 1}',
    ]
    (logdir / "metrics.jsonl").write_text("\n".join(good[:3] + bad + good[3:]) + "\n")
    output = tmp_path / "run.png"
    out = subprocess.run(
        [sys.executable, "-m", "apex", "plot", str(logdir), "-o", str(output)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    [warning] = out.stderr.strip().splitlines()
    assert f"skipped {len(bad)} of {len(bad) + len(good)} rows" in warning, warning
    from apex.run.plot import read_metrics

    assert [row["time"] for row in read_metrics(logdir)] == [1, 2, 3, 4, 5]
    # nothing to plot: one line, exit 2
    (logdir / "metrics.jsonl").write_text("\n".join(bad) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "apex", "plot", str(logdir), "-o", str(output)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"apex plot: error: {logdir / 'metrics.jsonl'} holds no row to plot"
    (logdir / "metrics.jsonl").write_text("[" * 100_000 + "\n")  # past json's recursion
    assert main(["plot", str(logdir), "-o", str(output)]) == 2


def plot_command(*logdirs: Path, output: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "apex", "plot", *map(str, logdirs), "-o", str(output)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_plot_reads_a_runs_files_only_when_they_are_regular_files(tmp_path):
    """A metrics.jsonl linked to /dev/zero was read until MemoryError, a FIFO blocked apex plot
    for ever; a config.yaml or manifest that is either did the same to the legend. Now a
    metrics file that is not a regular file is one line and exit 2, and the legend falls back
    to the run's directory name."""
    import os

    output = tmp_path / "run.png"
    zero_metrics = tmp_path / "zero"
    zero_metrics.mkdir()
    (zero_metrics / "metrics.jsonl").symlink_to("/dev/zero")
    fifo_metrics = tmp_path / "fifo"
    fifo_metrics.mkdir()
    os.mkfifo(fifo_metrics / "metrics.jsonl")
    for logdir, kind in ((zero_metrics, "a symbolic link"), (fifo_metrics, "a FIFO")):
        out = plot_command(logdir, output=output)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert out.stderr.strip().splitlines() == [
            f"apex plot: error: {logdir / 'metrics.jsonl'} is {kind}, not a regular file"
        ]

    logdir = Path(metrics_run(tmp_path / "planted"))
    (logdir / "config.yaml").symlink_to("/dev/zero")
    (logdir / "checkpoints").mkdir()
    os.mkfifo(logdir / "checkpoints" / "ckpt-000000002.json")
    (logdir / "checkpoints" / "ckpt-000000001.json").symlink_to("/dev/zero")
    out = plot_command(logdir, output=output)
    assert out.returncode == 0, out.stderr[-3000:]
    from apex.run.plot import run_labels

    assert run_labels([str(logdir)]) == ["planted"]
