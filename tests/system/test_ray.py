"""`apex run --ray ADDRESS` on a real two-node Ray cluster on this host (`ray start --head` and
`ray start --address`): three actors and the learner as Ray actors solve CartPole; an actor
killed through Ray comes back and joins the learner again; nothing of the run is left alive on
the cluster afterwards, nor its files (CURVE keys among them) on the nodes. Skips, saying why,
where Ray is not installed (.ci/run installs the ray extra)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from apex.bench.transport import free_base_port
from tests.support.paths import ROOT
from tests.support.runs import metrics

ray = pytest.importorskip("ray", reason="the ray extra (.ci/run installs it)")
pytestmark = [
    pytest.mark.skipif(shutil.which("ray") is None, reason="no `ray` command on PATH"),
    pytest.mark.timeout(600),
]


def ray_command(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["ray", *args], capture_output=True, text=True, timeout=120, check=False, env=env)


def gcs_port() -> int:
    """A free port for Ray's GCS outside Ray's own ranges (workers take 10002-19999)."""
    import random
    import socket

    for port in random.sample(range(20000, 30000), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError("no free port in 20000-29999")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node and a second node, two CPUs each, on this host; the address to join."""
    temp = tmp_path_factory.mktemp("ray")
    port = gcs_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    head = ray_command(
        "start", "--head", f"--port={port}", "--num-cpus=2", f"--temp-dir={temp}", "--disable-usage-stats", env=env
    )
    if head.returncode != 0:
        pytest.skip(f"ray start --head failed: {head.stderr[-500:]}")
    address = f"127.0.0.1:{port}"
    try:
        second = ray_command("start", f"--address={address}", "--num-cpus=2", env=env)
        assert second.returncode == 0, second.stderr[-1000:]
        yield address
    finally:
        ray_command("stop", "--force")


def apex_alive(address: str) -> list:
    """The run's Ray actors that are alive (any namespace), from Ray's state API."""
    from ray.util.state import list_actors

    alive = list_actors(address=address, filters=[("state", "=", "ALIVE")], limit=1000)
    return [actor for actor in alive if (actor.name or "").startswith("apex-")]


def apex_run_on_ray(cluster: str, logdir: Path, *stops: str) -> subprocess.Popen:
    """`apex run --ray` in the background, its output (the Ray actors' too) in LOGDIR.out."""
    logdir.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{logdir}.out", "w") as out:  # the child keeps its own copy
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "apex", "run", "--ray", cluster, "--actors", "3", "--config", "cartpole_apex"),
                *(*stops, "--logdir", str(logdir), "--port", str(free_base_port())),
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def node_files() -> set[str]:
    """The directories apex's Ray actors wrote their files to (config, CURVE keys) on this host."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "apex-ray-*")))


def check_node_files(new: set[str]) -> list[str]:
    """Each directory of ``new`` 0700 and each file in it 0600; the secret keys they hold."""
    secrets = []
    for top in new:
        for directory, _, files in os.walk(top):
            assert os.stat(directory).st_mode & 0o777 == 0o700, directory
            for file in files:
                path = os.path.join(directory, file)
                assert os.stat(path).st_mode & 0o777 == 0o600, path
                if file.endswith("key_secret"):
                    secrets += re.findall(r'secret-key = "(.+)"', Path(path).read_text())
    return secrets


def command_lines() -> str:
    """Every process's command line on this host, as `ps` shows them."""
    return subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout


def output(logdir: Path) -> str:
    return Path(f"{logdir}.out").read_text()


def joined_pids(logdir: Path, actor: int) -> set[str]:
    """The pids of the apex actor processes of index ``actor`` that joined the learner (Ray can
    print a line twice: lines are not counted)."""
    return set(re.findall(rf"actor {actor} joined from \S+ \(pid (\d+)\)", output(logdir)))


def test_three_actors_on_ray_solve_cartpole_and_leave_nothing_on_the_cluster(cluster, tmp_path):
    files_before = node_files()
    started = time.monotonic()
    run = apex_run_on_ray(cluster, tmp_path / "run", "--stop-return", "475", "--stop-seconds", "240")
    run.wait(timeout=300)
    wall = time.monotonic() - started
    assert run.returncode == 0, output(tmp_path / "run")[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert str(summary["stop_reason"]).startswith("return_mean_100"), summary
    rate = summary["env_steps"] / summary["wall_seconds"]
    learner_s = summary["wall_seconds"]
    print(f"ray: CartPole to 475 in {wall:.1f} s from the command (learner {learner_s} s), {rate:,.0f} env steps/s")
    assert apex_alive(cluster) == [], "the run left Ray actors alive"
    assert node_files() == files_before, "the run left its files (CURVE keys among them) on the nodes"


def test_an_actor_whose_ray_worker_is_killed_comes_back_and_its_files_go_with_it(cluster, tmp_path):
    """The Ray worker of actor 1 is SIGKILLed (as on a node that dies: nothing of it can
    clean up): Ray restarts it and its apex actor joins the learner again; the dead worker's
    files (0600 in 0700, the CURVE secret key among them) are removed within seconds by its
    janitor; no secret key is on any command line or in the run's output; nothing is left at
    the end."""
    logdir = tmp_path / "run"
    files_before = node_files()
    run = apex_run_on_ray(cluster, logdir, "--stop-seconds", "60")
    try:
        deadline = time.monotonic() + 120
        while not any(r.get("actors_connected") == 3 for r in metrics(logdir)):
            assert run.poll() is None and time.monotonic() < deadline, "the three actors never joined"
            time.sleep(1.0)
        secrets = check_node_files(node_files() - files_before)
        assert len(secrets) == 4, secrets  # the learner's and each actor's
        assert not any(secret in command_lines() for secret in secrets), "a secret key on a command line"
        ray.init(address=cluster, namespace="apex-test-driver")
        try:
            (victim,) = [a for a in apex_alive(cluster) if a.name == "apex-actor-1"]
            (victim_files,) = glob.glob(os.path.join(tempfile.gettempdir(), f"apex-ray-*-actor-1-{victim.pid}"))
            os.kill(victim.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while os.path.exists(victim_files):
                assert time.monotonic() < deadline, f"{victim_files} outlived its Ray worker by 10 s"
                time.sleep(0.2)
            deadline = time.monotonic() + 50
            while True:  # Ray restarts it (a new process), and its apex actor joins the learner again
                restarted = [a for a in apex_alive(cluster) if a.name == "apex-actor-1" and a.pid != victim.pid]
                if restarted and len(joined_pids(logdir, 1)) >= 2:
                    break
                assert run.poll() is None and time.monotonic() < deadline, "the killed actor never came back"
                time.sleep(1.0)
        finally:
            ray.shutdown()
        run.wait(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output(logdir)[-3000:]
    assert metrics(logdir)[-1]["actors_connected"] == 3
    assert re.search(r"ray: actor 1 (died|exited with -?\d+)", output(logdir)), "apex did not start it again"
    assert not any(secret in output(logdir) for secret in secrets), "a secret key in the run's output"
    assert json.loads((logdir / "summary.json").read_text())["stop_reason"] == "60.0 seconds"
    time.sleep(2.0)
    assert apex_alive(cluster) == [], "the run left Ray actors alive"
    assert node_files() == files_before, "the restarted actor's files, or the run's, were left behind"
    assert "apex.run.node_files" not in command_lines(), "a janitor outlived its files"


def test_a_learner_that_dies_is_started_again_from_its_newest_checkpoint(cluster, tmp_path):
    logdir = tmp_path / "run"
    run = apex_run_on_ray(cluster, logdir, "--stop-seconds", "40", "--set", "learner.checkpoint_interval_s=2")
    try:
        deadline = time.monotonic() + 120
        while not list((logdir / "checkpoints").glob("ckpt-*.json")) or not metrics(logdir):
            assert run.poll() is None and time.monotonic() < deadline, output(logdir)[-3000:]
            time.sleep(1.0)
        learners = subprocess.run(
            ["pgrep", "-f", f"apex learner .*--logdir {logdir}"], capture_output=True, text=True, check=False
        ).stdout.split()
        assert len(learners) == 1, learners
        os.kill(int(learners[0]), signal.SIGKILL)  # the apex process, not its Ray actor
        run.wait(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, output(logdir)[-3000:]
    assert "starting it again from its newest checkpoint" in output(logdir)
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["resumed_from"] and summary["stop_reason"] == "40.0 seconds", summary
    time.sleep(2.0)
    assert apex_alive(cluster) == []
