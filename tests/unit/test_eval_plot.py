"""apex eval on a real checkpoint, and apex plot on run output, in-process (`apex eval` and
`apex plot` as processes: tests/system/test_eval_plot.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from apex import config as config_module
from apex.cli import main
from apex.config import Config
from apex.errors import ApexError
from apex.run.evaluation import evaluate
from tests.support.checkpoints import full_state
from tests.support.runs import metrics_run


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
        rows = [
            {
                "time": t,
                "env_steps": 1000 * t,
                "env_steps_per_s": 1000.0,
                "return_mean_100": None if t == 0 else slope * t,
            }
            for t in range(10)
        ]
        (logdir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        logdirs.append(str(logdir))
    output = tmp_path / "runs.png"
    assert main(["plot", *logdirs, "-o", str(output)]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "a" / "metrics.jsonl").write_text("not json\n")
    assert main(["plot", logdirs[0], "-o", str(output)]) == 2
    assert "is not JSON" in capsys.readouterr().err


def test_plot_keeps_the_timeline_a_resumed_run_went_on_with():
    from apex.run.plot import _labels, surviving_timeline

    # Killed at t=10 after a checkpoint at t=6; the resumed learner logs the resume point
    # and goes on from there.
    times = [2, 4, 6, 8, 10, 6, 8.1, 10.1, 12]
    kept = surviving_timeline([{"time": t, "n": i} for i, t in enumerate(times)])
    assert [(r["time"], r["n"]) for r in kept] == [(2, 0), (4, 1), (6, 5), (8.1, 6), (10.1, 7), (12, 8)]
    assert _labels(["/a/s1/run", "/a/s2/run", "/b/other"]) == ["s1/run", "s2/run", "b/other"]


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


def config_of(env: str, algo: str) -> Config:
    return config_module.load(None, [f"env.id={env}", f"algo={algo}"])


def visible_tick_labels(axis, which: str) -> list[str]:
    """The labels the image shows (matplotlib also formats ticks just outside the view)."""
    low, high = getattr(axis, f"get_{which}lim")()
    ticks = getattr(axis, f"get_{which}ticks")()
    labels = [label.get_text() for label in getattr(axis, f"get_{which}ticklabels")()]
    return [label for tick, label in zip(ticks, labels) if low <= tick <= high]


def test_plot_tick_labels_are_short_enough_to_read(tmp_path):
    from apex.run.plot import figure, si

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
        "0",
        "950",
        "1.5k",
        "1M",
        "1.25M",
        "2B",
        "\N{MINUS SIGN}3k",
    ]


def test_plot_legend_names_each_runs_env_and_algorithm(tmp_path):
    from apex.run.plot import figure

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
    assert legend == [
        "CartPole-v1 apex_dqn",
        "ALE/Pong-v5 impala (pong1)",
        "ALE/Pong-v5 impala (pong2)",
        "Acrobot-v1 apex_dqn",
        "bare",
    ]


def test_plot_smoothing_is_an_ema_over_the_raw_curve(tmp_path):
    from apex.run.plot import figure, plot

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
