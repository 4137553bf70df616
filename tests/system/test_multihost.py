"""A learner and two actors on three "hosts": network namespaces joined by veth pairs,
each with its own address, the actors started before the learner."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from tests.support.processes import kill_leftovers


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@pytest.fixture
def hosts():
    """Three namespaces: learner <-> actor 1 on 10.231.1.0/24, learner <-> actor 2 on 10.231.2.0/24."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (`ip`)")
    tag = uuid.uuid4().hex[:6]
    names = {"learner": f"apexl{tag}", "actor1": f"apexa{tag}", "actor2": f"apexb{tag}"}
    try:
        for ns in names.values():
            sh("ip", "netns", "add", ns)
            sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        for n, actor in ((1, names["actor1"]), (2, names["actor2"])):
            left, right = f"vl{n}{tag}", f"vr{n}{tag}"
            sh("ip", "link", "add", left, "type", "veth", "peer", "name", right)
            sh("ip", "link", "set", left, "netns", names["learner"])
            sh("ip", "link", "set", right, "netns", actor)
            sh("ip", "netns", "exec", names["learner"], "ip", "addr", "add", f"10.231.{n}.1/24", "dev", left)
            sh("ip", "netns", "exec", actor, "ip", "addr", "add", f"10.231.{n}.2/24", "dev", right)
            sh("ip", "netns", "exec", names["learner"], "ip", "link", "set", left, "up")
            sh("ip", "netns", "exec", actor, "ip", "link", "set", right, "up")
    except (subprocess.CalledProcessError, OSError) as e:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {getattr(e, 'stderr', e)}")
    yield names
    for ns in names.values():
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def in_host(ns: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "apex", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_actors_on_two_hosts_train_one_learner(hosts, tmp_path):
    logdir = tmp_path / "cluster"
    fast = ["--set", "transport.heartbeat_interval_s=0.2", "--set", "transport.heartbeat_timeout_s=2"]
    # Actors first: they keep saying hello until a learner answers.
    actors = [
        in_host(hosts["actor1"], "actor", "--learner", "10.231.1.1:5550", "--num-envs", "4", *fast),
        in_host(hosts["actor2"], "actor", "--learner", "10.231.2.1", "--num-envs", "4", *fast),
    ]
    learner = in_host(
        hosts["learner"],
        "learner",
        "--bind-host",
        "0.0.0.0",
        "--port",
        "5550",
        "--logdir",
        str(logdir),
        "--stop-env-steps",
        "30000",
        *fast,
    )
    try:
        _, err = learner.communicate(timeout=240)
        assert learner.returncode == 0, err
        for actor in actors:
            actor.communicate(timeout=60)
            assert actor.returncode == 0
    finally:
        kill_leftovers([learner, *actors])
    summary = json.loads((logdir / "summary.json").read_text())
    by_host = summary["env_steps_by_host"]
    assert set(by_host) == {"10.231.1.2", "10.231.2.2"}, by_host
    assert all(steps > 0 for steps in by_host.values())
    assert summary["learner_updates"] > 0
