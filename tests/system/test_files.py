"""Run-directory write errors for real: a child process under a per-file size limit writes
metrics, TensorBoard files, a checkpoint and a summary past it, and leaves no temporary file."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap

from tests.support.paths import ROOT


def run_child(script: str, *args: str) -> subprocess.CompletedProcess:
    """Runs ``script`` in a fresh interpreter: resource limits there do not reach pytest."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


# -- write errors


FILE_SIZE_LIMIT = """
import resource
# A per-file size limit: writes past it fail with EFBIG (Python ignores SIGXFSZ), for real,
# in the kernel, on metrics.jsonl and the TensorBoard event file alike.
def limit(nbytes):
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
"""


def test_metrics_and_tensorboard_write_errors_do_not_end_the_run(tmp_path):
    script = (
        FILE_SIZE_LIMIT
        + """
import json, logging, resource, sys, time
from pathlib import Path
from apex.learner.metrics import MetricsWriter
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

class Quiet:
    def isatty(self):
        return False

    def write(self, text):
        return len(text)

    def flush(self):
        pass

logdir = Path(sys.argv[1])
writer = MetricsWriter(logdir, console=Quiet())
limit(4096)
row = {"env_steps": 0, "learner_updates": 0, "loss": 0.5, "note": "x" * 100}
for n in range(150):
    writer.write({**row, "time": float(n), "env_steps": 100 * n, "learner_updates": n})
    time.sleep(0.002)
failed_while_full = writer.write_failures
limit(resource.RLIM_INFINITY)  # the disk freed up
writer.write({**row, "time": 999.0, "learner_updates": 999})
writer.close()
print(json.dumps({"failed_while_full": failed_while_full, "write_failures": writer.write_failures}))
"""
    )
    result = run_child(script, str(tmp_path))
    assert result.returncode == 0, result.stderr
    counts = json.loads(result.stdout.splitlines()[-1])
    assert counts["failed_while_full"] > 10 and counts["write_failures"] >= counts["failed_while_full"]
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.count("TensorBoard output is off for the rest of the run") == 1, result.stderr
    # Rate-limited: one line for the first failure, not one per row.
    assert result.stderr.count("metrics.jsonl failed") <= 2, result.stderr
    assert "File too large" in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["learner_updates"] == 999 and len(rows) < 150
    assert "metrics.jsonl is written again" in result.stderr


def test_failed_checkpoint_and_summary_writes_leave_no_temporary_file(tmp_path):
    script = (
        FILE_SIZE_LIMIT
        + """
import json, sys
from pathlib import Path
import torch
from apex.checkpoint import CheckpointWriter
from apex.learner.metrics import write_json_atomic
from tests.support.checkpoints import state

logdir = Path(sys.argv[1])
writer = CheckpointWriter(logdir / "checkpoints", keep=3)
write_json_atomic(logdir / "summary.json", {"old": True})
limit(4096)
big = {**state(100), "weights": torch.zeros(1 << 16)}
writer.save("ckpt-000000100", big)
try:
    write_json_atomic(logdir / "summary.json", {"padding": "x" * 100_000})
    summary_error = None
except OSError as e:
    summary_error = e.errno
print(json.dumps({"checkpoint_failures": writer.failures, "summary_errno": summary_error}))
"""
    )
    result = run_child(script, str(tmp_path))
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.splitlines()[-1])
    assert outcome == {"checkpoint_failures": 1, "summary_errno": errno.EFBIG}
    assert os.listdir(tmp_path / "checkpoints") == []
    assert sorted(os.listdir(tmp_path)) == ["checkpoints", "summary.json"]
    assert json.loads((tmp_path / "summary.json").read_text()) == {"old": True}
