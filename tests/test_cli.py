"""The `apex` console script as a user runs it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from apex.cli import main


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


def test_bench_rejects_unknown_benchmark(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "nope"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_bench_rejects_non_positive_seconds(capsys):
    assert main(["bench", "sumtree", "--seconds", "0"]) == 2
    assert "--seconds must be positive" in capsys.readouterr().err
