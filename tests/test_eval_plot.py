"""apex eval on a real checkpoint, and apex plot on run output."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from apex.algos.apex_dqn import Learner
from apex.cli import main
from apex.config import Config
from apex.envs import env_spec
from apex.evaluate import evaluate


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
