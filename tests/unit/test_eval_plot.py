"""apex eval on a real checkpoint, and apex plot on run output."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from apex.algos.apex_dqn import Learner
from apex.cli import main
from apex import config as config_module
from apex.config import Config
from apex.envs import env_spec
from apex.errors import ApexError
from apex.evaluation import evaluate


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    config = Config()
    learner = Learner(config, env_spec(config.env), torch.device("cpu"))
    # Push "left" (action 0) hard: the greedy policy must then always push left.
    with torch.no_grad():
        learner.online.advantage.bias.copy_(torch.tensor([10.0, -10.0]))
    path = tmp_path / "ckpt-000000001.pt"
    torch.save({**learner.state_dict(), "config": config.to_dict()}, path)
    return path


def test_eval_plays_the_checkpoint_greedily(checkpoint, tmp_path):
    result = evaluate(checkpoint, episodes=3)
    assert result["algo"] == "apex_dqn" and result["episodes"] == 3 and len(result["returns"]) == 3
    # Always pushing left ends CartPole within a few dozen steps, every time.
    assert max(result["returns"]) < 20
    assert result["return_mean"] == pytest.approx(np.mean(result["returns"]))
    out = tmp_path / "eval.json"
    assert main(["eval", "--checkpoint", str(checkpoint), "--episodes", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["episodes"] == 2


def test_eval_refuses_a_truncated_checkpoint(checkpoint, tmp_path, capsys):
    truncated = tmp_path / "ckpt-truncated.pt"
    truncated.write_bytes(checkpoint.read_bytes()[:2000])
    assert main(["eval", "--checkpoint", str(truncated)]) == 2
    assert "unreadable (truncated or corrupt?)" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path / "nope.pt")]) == 2
    assert "not found" in capsys.readouterr().err


def test_plot_draws_several_runs(tmp_path, capsys):
    logdirs = []
    for name, slope in (("a", 1.0), ("b", 2.0)):
        logdir = tmp_path / name
        logdir.mkdir()
        rows = [{"time": t, "env_steps": 1000 * t, "env_steps_per_s": 1000.0,
                 "return_mean_100": None if t == 0 else slope * t} for t in range(10)]
        (logdir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        logdirs.append(str(logdir))
    output = tmp_path / "runs.png"
    assert main(["plot", *logdirs, "-o", str(output)]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "a" / "metrics.jsonl").write_text("not json\n")
    assert main(["plot", logdirs[0], "-o", str(output)]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_plot_keeps_the_timeline_a_resumed_run_went_on_with():
    from apex.plot import _labels, surviving_timeline

    # Killed at t=10 after a checkpoint at t=6; the resumed learner logs the resume point
    # and goes on from there.
    times = [2, 4, 6, 8, 10, 6, 8.1, 10.1, 12]
    kept = surviving_timeline([{"time": t, "n": i} for i, t in enumerate(times)])
    assert [(r["time"], r["n"]) for r in kept] == [(2, 0), (4, 1), (6, 5), (8.1, 6), (10.1, 7), (12, 8)]
    assert _labels(["/a/s1/run", "/a/s2/run", "/b/other"]) == ["s1/run", "s2/run", "b/other"]


def full_state(checkpoint: Path, updates: int) -> dict:
    """The fixture's networks with everything else a learner checkpoint holds."""
    return {**torch.load(checkpoint, weights_only=True), "updates": updates, "env_steps": 100, "time": 1.0,
            "episode_stats": {"eval": [], "train": [], "episodes": 0, "best": -math.inf}}


def test_eval_of_a_forged_checkpoint_runs_no_code_and_says_so_in_one_line(checkpoint, tmp_path):
    from apex.checkpoint import CheckpointWriter
    from tests.test_checkpoint import RunsCode

    marker = tmp_path / "marker"
    run = tmp_path / "run"
    writer = CheckpointWriter(run / "checkpoints", keep=3)
    writer.save("ckpt-000000001", full_state(checkpoint, 1))
    # The manifest's size and CRC-32 match: only loading can tell.
    writer.save("ckpt-000000002", {**full_state(checkpoint, 2), "online": RunsCode(marker)})
    forged = run / "checkpoints" / "ckpt-000000002.pt"
    result = subprocess.run([sys.executable, "-m", "apex", "eval", "--checkpoint", str(forged)],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("apex eval: error: checkpoint "), result.stderr
    assert "without running code" in lines[0]
    assert not marker.exists()
    # Given the run, eval sets the forged one aside and plays the one before.
    result = subprocess.run([sys.executable, "-m", "apex", "eval", "--checkpoint", str(run), "--episodes", "1"],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "ckpt-000000002 refused" in result.stderr and "(apex_dqn, 1 updates)" in result.stdout
    assert not marker.exists()


def test_eval_of_a_checkpoint_without_its_network_names_the_key(checkpoint, tmp_path, capsys):
    state = torch.load(checkpoint, weights_only=True)
    del state["online"]
    path = tmp_path / "hand-made.pt"
    torch.save(state, path)
    assert main(["eval", "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no 'online'" in err, err
    # A network of another shape: one line too, not a traceback.
    state["online"] = {"advantage.bias": torch.zeros(7)}
    torch.save(state, path)
    assert main(["eval", "--checkpoint", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not fit" in err, err


def test_eval_plays_the_best_or_the_newest_checkpoint_of_a_run(checkpoint, tmp_path):
    from apex.checkpoint import CheckpointWriter

    run = tmp_path / "run"
    writer = CheckpointWriter(run / "checkpoints", keep=1)
    for updates, score in ((1, 500.0), (2, 377.0), (3, None)):
        writer.save(f"ckpt-{updates:09d}", full_state(checkpoint, updates), score=score)
    best = evaluate(run, episodes=1)  # best by default
    assert Path(best["checkpoint"]) == run / "checkpoints" / "ckpt-000000001.pt"
    assert (best["which"], best["updates"], best["recorded_return_mean_100"]) == ("best", 1, 500.0)
    newest = evaluate(run, episodes=1, which="newest")
    assert Path(newest["checkpoint"]) == run / "checkpoints" / "ckpt-000000003.pt"
    assert (newest["which"], newest["updates"], newest["recorded_return_mean_100"]) == ("newest", 3, None)
    # A file is that file, whatever `which` says.
    chosen = evaluate(run / "checkpoints" / "ckpt-000000003.pt", episodes=1, which="best")
    assert (chosen["which"], chosen["updates"]) == ("file", 3)
    with pytest.raises(ApexError, match="--which must be one of best, newest, got 'latest'"):
        evaluate(run, episodes=1, which="latest")


def metrics_run(directory: Path, slope: float = 1.0, config: Config | None = None) -> str:
    """A run of 1.2M env steps over 20 minutes whose return zigzags up."""
    directory.mkdir(parents=True)
    rows = [{"time": 30.0 * t, "env_steps": 30_000 * t, "env_steps_per_s": 1000.0 + 10 * t,
             "return_mean_100": None if t == 0 else slope * t + (-1) ** t * 3} for t in range(41)]
    (directory / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    if config is not None:
        config.save(directory / "config.yaml")
    return str(directory)


def config_of(env: str, algo: str) -> Config:
    return config_module.load(None, [f"env.id={env}", f"algo={algo}"])


def visible_tick_labels(axis, which: str) -> list[str]:
    """The labels the image shows (matplotlib also formats ticks just outside the view)."""
    low, high = getattr(axis, f"get_{which}lim")()
    ticks = getattr(axis, f"get_{which}ticks")()
    labels = [label.get_text() for label in getattr(axis, f"get_{which}ticklabels")()]
    return [label for tick, label in zip(ticks, labels) if low <= tick <= high]


def test_plot_tick_labels_are_short_enough_to_read(tmp_path):
    from apex.plot import figure, si

    fig = figure([metrics_run(tmp_path / "run", config=config_of("CartPole-v1", "apex_dqn"))])
    fig.canvas.draw()
    steps, _, throughput = fig.axes
    labels = visible_tick_labels(steps, "x")
    assert 3 <= len(labels) <= 7, labels
    # Not "100000200000300000", and no "1e6" in the corner either.
    assert all(len(label) <= 6 for label in labels), labels
    assert "250k" in labels and "1M" in labels and steps.xaxis.get_offset_text().get_text() == ""
    assert all(len(label) <= 6 for label in visible_tick_labels(throughput, "y"))
    assert fig.axes[1].get_xlabel() == "minutes"  # 1200 s of wall time
    assert [si(v) for v in (0, 950, 1500, 999_600, 1_250_000, 2e9, -3000)] == [
        "0", "950", "1.5k", "1M", "1.25M", "2B", "\N{MINUS SIGN}3k"]


def test_plot_legend_names_each_runs_env_and_algorithm(tmp_path):
    from apex.plot import figure

    logdirs = [
        metrics_run(tmp_path / "cartpole", config=config_of("CartPole-v1", "apex_dqn")),
        metrics_run(tmp_path / "pong1", config=config_of("ALE/Pong-v5", "impala")),
        metrics_run(tmp_path / "pong2", config=config_of("ALE/Pong-v5", "impala")),
        metrics_run(tmp_path / "learner-only"),  # no config.yaml: the checkpoint's config
        metrics_run(tmp_path / "bare"),  # neither: its directory
    ]
    checkpoints = tmp_path / "learner-only" / "checkpoints"
    checkpoints.mkdir()
    for updates, env in ((1, "Old-v0"), (2, "Acrobot-v1")):
        manifest = {"name": f"ckpt-{updates:09d}", "config": config_of(env, "apex_dqn").to_dict()}
        (checkpoints / f"ckpt-{updates:09d}.json").write_text(json.dumps(manifest))
    fig = figure(logdirs)
    legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
    assert legend == ["CartPole-v1 apex_dqn", "ALE/Pong-v5 impala (pong1)", "ALE/Pong-v5 impala (pong2)",
                      "Acrobot-v1 apex_dqn", "bare"]


def test_plot_smoothing_is_an_ema_over_the_raw_curve(tmp_path):
    from apex.plot import figure, plot

    logdir = metrics_run(tmp_path / "run", config=config_of("CartPole-v1", "apex_dqn"))
    raw = [t + (-1) ** t * 3 for t in range(1, 41)]

    def curve(fig) -> list[float]:
        [line] = [line for line in fig.axes[0].get_lines() if line.get_label() == "CartPole-v1 apex_dqn"]
        return list(line.get_ydata())

    assert curve(figure([logdir])) == raw
    assert curve(figure([logdir], smooth=None)) == raw
    smooth = figure([logdir], smooth=0.9)
    ys = curve(smooth)
    assert ys[0] == pytest.approx(raw[0]) and ys != pytest.approx(raw)
    # Smoothed, the zigzag of +-3 is mostly gone; the raw curve stays behind, faint.
    assert np.abs(np.diff(ys[10:])).max() < 2.5 < np.abs(np.diff(raw)).min()
    assert any(list(line.get_ydata()) == raw and line.get_alpha() < 1 for line in smooth.axes[0].get_lines())
    with pytest.raises(ApexError, match=r"--smooth must be in \[0, 1\)"):
        figure([logdir], smooth=1.0)
    output = plot([logdir], str(tmp_path / "smooth.png"), smooth=0.6)
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hostile2_11_plot_draws_the_good_rows_and_says_in_one_line_how_many_it_skipped(tmp_path):
    """Issue 30, item 11: rows that are not objects, string times, NaN or 1e400 (inf to
    Python's json) ended apex plot in a TypeError traceback."""
    logdir = tmp_path / "run"
    logdir.mkdir()
    good = [json.dumps({"time": t, "env_steps": 1000 * t, "env_steps_per_s": 1000.0, "return_mean_100": t / 2})
            for t in range(1, 6)]
    bad = ["[1, 2]", '"a string"', "null", '{"time": "3", "env_steps": 1, "env_steps_per_s": 1}',
           '{"time": NaN, "env_steps": 1, "env_steps_per_s": 1}', '{"time": 7, "env_steps": 1e400, "env_steps_per_s": 1}',
           '{"time": 8, "env_steps": 1, "env_steps_per_s": 1, "return_mean_100": Infinity}',
           '{"time": 9, "env_steps": 1' + "0" * 400 + ', "env_steps_per_s": 1}',  # an integer past any float
           '{"time": true, "env_steps": 1, "env_steps_per_s": 1}', '{"env_steps": 1}']
    (logdir / "metrics.jsonl").write_text("\n".join(good[:3] + bad + good[3:]) + "\n")
    output = tmp_path / "run.png"
    out = subprocess.run([sys.executable, "-m", "apex", "plot", str(logdir), "-o", str(output)], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    [warning] = out.stderr.strip().splitlines()
    assert f"skipped {len(bad)} of {len(bad) + len(good)} rows" in warning, warning
    from apex.plot import read_metrics

    assert [row["time"] for row in read_metrics(logdir)] == [1, 2, 3, 4, 5]
    # nothing to plot: one line, exit 2
    (logdir / "metrics.jsonl").write_text("\n".join(bad) + "\n")
    out = subprocess.run([sys.executable, "-m", "apex", "plot", str(logdir), "-o", str(output)], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == f"apex plot: error: {logdir / 'metrics.jsonl'} holds no row to plot"
    (logdir / "metrics.jsonl").write_text("[" * 100_000 + "\n")  # past json's recursion
    assert main(["plot", str(logdir), "-o", str(output)]) == 2


def plot_command(*logdirs: Path, output: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apex", "plot", *map(str, logdirs), "-o", str(output)],
                          capture_output=True, text=True, timeout=60, check=False)


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
        assert out.stderr.strip().splitlines() == [f"apex plot: error: {logdir / 'metrics.jsonl'} is {kind}, "
                                                   "not a regular file"]

    logdir = Path(metrics_run(tmp_path / "planted"))
    (logdir / "config.yaml").symlink_to("/dev/zero")
    (logdir / "checkpoints").mkdir()
    os.mkfifo(logdir / "checkpoints" / "ckpt-000000002.json")
    (logdir / "checkpoints" / "ckpt-000000001.json").symlink_to("/dev/zero")
    out = plot_command(logdir, output=output)
    assert out.returncode == 0, out.stderr[-3000:]
    from apex.plot import run_labels

    assert run_labels([str(logdir)]) == ["planted"]
