"""deploy/slurm/apex.sbatch on a real one-node Slurm cluster (tests/support/slurm.py): a job of
one learner and two actors solves CartPole; scancel mid-run leaves a checkpoint and the job
submitted again on the same run directory resumes from it; an array of two seeds writes two
runs. Skips, saying why, where Slurm cannot be brought up (not root, slurm-wlm missing)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apex.checkpoint import find_latest
from apex.transport.keys import generate_keys
from tests.support.paths import ROOT
from tests.support.slurm import missing, one_node_cluster, wait_job

pytestmark = [
    pytest.mark.skipif(missing() is not None, reason=str(missing())),
    pytest.mark.timeout(600),
]

SBATCH = ROOT / "deploy" / "slurm" / "apex.sbatch"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with one_node_cluster(tmp_path_factory.mktemp("slurm")) as env:
        # the nodes' apex: this interpreter's, with the checkout importable (tests.envs and all)
        yield {**env, "APEX": f"{sys.executable} -m apex", "PYTHONPATH": str(ROOT)}


def submit(cluster: dict, workdir: Path, *args: str) -> str:
    out = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks=3", "--overcommit", *args],
        env=cluster,
        cwd=workdir,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().split(";")[0]


def job_output(workdir: Path, job: str) -> str:
    return "\n".join(p.read_text()[-3000:] for p in workdir.glob(f"slurm-{job}*.out"))


def test_a_job_of_a_learner_and_two_actors_solves_cartpole(cluster, tmp_path):
    started = time.monotonic()
    job = submit(
        cluster, tmp_path, str(SBATCH), "--config", "cartpole_apex", "--stop-return", "475", "--stop-seconds", "200"
    )
    assert wait_job(job, cluster, 300) == "COMPLETED", job_output(tmp_path, job)
    wall = time.monotonic() - started
    summary = json.loads((tmp_path / "runs" / f"slurm-{job}" / "summary.json").read_text())
    assert str(summary["stop_reason"]).startswith("return_mean_100"), summary
    output = job_output(tmp_path, job)
    assert "2 actors" in output and "the learner exited with 0" in output, output
    print(
        f"slurm: CartPole to 475 in {wall:.1f} s from sbatch (learner: {summary['wall_seconds']} s), "
        f"{summary['env_steps'] / summary['wall_seconds']:.0f} env steps/s"
    )


def assert_keys_private(keys: Path) -> None:
    """The job's CURVE keys: its directories 0700, its secret keys 0600, none on a command line."""
    assert (keys / "learner.key_secret").exists(), f"no CURVE keys in {keys}"
    for directory in (keys, keys / "authorized"):
        assert directory.stat().st_mode & 0o777 == 0o700, directory
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    for secret in keys.glob("*.key_secret"):
        assert secret.stat().st_mode & 0o777 == 0o600, secret
        (z85,) = re.findall(r'secret-key = "(.+)"', secret.read_text())
        assert z85 not in ps, f"{secret.name} on a command line"


def test_scancel_leaves_a_checkpoint_and_the_job_submitted_again_resumes_it(cluster, tmp_path):
    logdir = tmp_path / "runs" / "cancelled"
    args = (str(SBATCH), "--config", "cartpole_apex", "--logdir", str(logdir), "--stop-seconds", "300")
    job = submit(cluster, tmp_path, *args, "--set", "learner.checkpoint_interval_s=1000")
    deadline = time.monotonic() + 120
    while not (logdir / "metrics.jsonl").exists() or not any(
        json.loads(line)["learner_updates"] > 20 for line in (logdir / "metrics.jsonl").read_text().splitlines()
    ):
        assert time.monotonic() < deadline, job_output(tmp_path, job)
        time.sleep(1.0)
    assert_keys_private(logdir / "keys")
    subprocess.run(["scancel", job], env=cluster, check=True)
    wait_job(job, cluster, 120)
    assert not (logdir / "keys").exists(), "the job's CURVE keys outlived it"
    checkpoints = sorted((logdir / "checkpoints").glob("ckpt-*.json"))
    assert checkpoints, "scancel's SIGTERM wrote no checkpoint: " + job_output(tmp_path, job)
    assert json.loads((logdir / "summary.json").read_text())["stop_reason"] == "signal SIGTERM"

    # the keys a job killed with SIGKILL leaves: the next job replaces them, then removes its own
    generate_keys(logdir / "keys")
    stale = (logdir / "keys" / "learner.key_secret").read_text()
    again = submit(
        cluster, tmp_path, str(SBATCH), "--config", "cartpole_apex", "--logdir", str(logdir), "--stop-seconds", "8"
    )
    keys, replaced = logdir / "keys" / "learner.key_secret", False
    deadline = time.monotonic() + 120
    while not replaced and time.monotonic() < deadline:
        try:
            replaced = keys.read_text() != stale
        except FileNotFoundError:
            pass
        time.sleep(0.1)
    assert replaced, "the second job ran on the keys the first left"
    assert wait_job(again, cluster, 180) == "COMPLETED", job_output(tmp_path, again)
    assert not (logdir / "keys").exists(), "the second job's CURVE keys outlived it"
    summary = json.loads((logdir / "summary.json").read_text())
    assert checkpoints[-1].stem in str(summary["resumed_from"]), summary


def test_an_array_of_two_seeds_writes_two_runs(cluster, tmp_path):
    job = submit(
        cluster, tmp_path, "--array=0-1", str(SBATCH), "--config", "cartpole_apex", "--stop-env-steps", "20000"
    )
    for task in (0, 1):
        assert wait_job(f"{job}_{task}", cluster, 300) == "COMPLETED", job_output(tmp_path, job)
    for task in (0, 1):
        run = tmp_path / "runs" / f"slurm-{job}_{task}"
        assert json.loads((run / "summary.json").read_text())["env_steps"] >= 20_000
        assert find_latest(run).config["seed"] == task  # the array's task: its seed
