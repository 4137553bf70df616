"""`apex config show` given hostile configs (issue 30, item 11): an alias bomb, a huge
integer and an infinite rate, each one line from a real apex process."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time

import pytest

from apex import config
from apex.bench.transport import free_base_port
from apex.errors import ConfigError
from tests.support.configs import HUGE
from tests.support.paths import ROOT


def alias_bomb(levels: int = 9) -> str:
    """A few hundred bytes of YAML that aliases expand to 9**levels values."""
    lines = ["env:", "  kwargs:", '    a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"    a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def config_show(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "apex", "config", "show", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_an_alias_bomb_is_refused_in_one_line_within_seconds(tmp_path):
    """Issue 30, item 11: 510 bytes of YAML aliases in env.kwargs kept `apex config show`
    busy past 10 s (a billion values); a config's YAML may expand to 100,000 values."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert len(bomb.read_bytes()) < 600
    # The CLI first (the old code never returned): one line, exit 2, in a couple of seconds with apex's start-up.
    started = time.monotonic()
    out = config_show(str(bomb), timeout=20)
    assert time.monotonic() - started < 10
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"apex config: error: {bomb}: its YAML aliases expand it past 100000 "
        "values (an alias bomb?): write the values out, or use fewer aliases"
    ]
    started = time.monotonic()
    with pytest.raises(ConfigError, match="aliases expand it past 100000 values"):
        config.load(bomb)
    with pytest.raises(ConfigError, match="aliases expand it past"):
        config.load(
            None,
            [
                "env.kwargs={a: &a [x, x, x, x, x, x, x, x, x, x], b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, "
                "*a], c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b], d: &d [*c, *c, *c, *c, *c, *c, *c, *c, "
                "*c, *c], e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d, *d]}"
            ],
        )
    assert time.monotonic() - started < 2
    loop = tmp_path / "loop.yaml"
    loop.write_text("env:\n  kwargs: &k {self: *k}\n")
    with pytest.raises(ConfigError, match="refers to a value that holds it"):
        config.load(loop)
    deep = tmp_path / "deep.yaml"
    deep.write_text("env:\n  kwargs: {a: " + "[" * 50_000 + "]" * 50_000 + "}\n")
    with pytest.raises(ConfigError, match="nested too deep"):
        config.load(deep)
    # an honest config's few aliases still load
    shared = tmp_path / "shared.yaml"
    shared.write_text("env:\n  kwargs: {a: &v [1, 2], b: *v}\n")
    assert config.load(shared).env.kwargs == {"a": [1, 2], "b": [1, 2]}


def test_config_show_says_a_huge_integer_and_an_infinite_rate_in_one_line_each(tmp_path):
    for args, message in (
        (["--set", f"apex_dqn.batch_size={HUGE}"], "apex_dqn.batch_size must be within"),
        (["--set", "apex_dqn.lr=.inf"], "apex_dqn.lr must be a finite number, got inf"),
    ):
        out = config_show(*args)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        [line] = out.stderr.strip().splitlines()
        assert line.startswith(f"apex config: error: invalid configuration: {message}") and len(line) < 200, line
    path = tmp_path / "c.yaml"
    path.write_text(f"apex_dqn:\n  batch_size: {HUGE}\n")
    out = config_show(str(path))
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "apex config: error: invalid configuration: apex_dqn.batch_size must be within -2**53..2**53, got an integer "
        "of 5000 digits"
    ], out.stderr[-2000:]


# -- Each algorithm's settings in its own section: what was written before still runs

OLD_RUNS = ROOT / "tests" / "data" / "runs_before_config_sections"
APEX_LEARNER = [sys.executable, "-m", "apex", "learner"]


@pytest.mark.parametrize(
    "algo, moved",
    [
        ("apex_dqn", {"lr": 0.001, "gamma": 0.98, "batch_size": 32, "replay.capacity": 2000}),
        ("impala", {"lr": 0.0007, "gamma": 0.97, "grad_clip": 33.0, "batch_unrolls": 4}),
    ],
)
def test_a_run_written_before_the_settings_moved_evaluates_and_resumes_with_its_values(tmp_path, algo, moved):
    """Checkpoints of c3d5b45 hold learner.lr, replay.* and the like: they evaluate, and a
    resume reads each value under its new name (learner.lr is IMPALA's own lr in an IMPALA
    run), says so in one warning, keeps Ape-X's replay and writes the new names."""
    run = tmp_path / algo
    shutil.copytree(OLD_RUNS / algo, run)
    evaluated = subprocess.run(
        [sys.executable, "-m", "apex", "eval", "--checkpoint", str(run), "--episodes", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    before = json.loads(next((run / "checkpoints").glob("ckpt-*.json")).read_text())
    resumed = subprocess.run(
        [*APEX_LEARNER, "--resume", str(run), "--port", str(free_base_port()), "--stop-seconds", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert re.search(r"resumed from ckpt-\d+", output), output[-3000:]
    warnings = [line for line in output.splitlines() if "settings under their older names" in line]
    assert len(warnings) == 1, output[-3000:]
    assert f"learner.lr -> {algo}.lr" in warnings[0] and f"learner.gamma -> {algo}.gamma" in warnings[0]
    newest = max((run / "checkpoints").glob("ckpt-*.json"), key=lambda p: p.stat().st_mtime_ns)
    after = json.loads(newest.read_text())
    saved = after["config"]
    assert "replay" not in saved and "lr" not in saved["learner"], saved
    for key, value in moved.items():
        node = saved[algo]
        for part in key.split("."):
            node = node[part]
        assert node == value, (key, node)
    if algo == "apex_dqn":  # the replay came back: the new checkpoint holds what the old one did
        assert after["replay_header"]["items"] == before["replay_header"]["items"], (before, after)
