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


def in_host(ns: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "apex", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
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


def test_a_learner_group_on_two_hosts_trains_with_curve_keys_and_its_store_refuses_a_stranger(hosts, tmp_path):
    """`apex learner --rank 0|1 --master` on two "hosts" with the run's CURVE keys (their
    store's key pair derives from the learner's secret: no file to share), two actors beside
    rank 0 (one routed to rank 1 across the link): the group trains, and a process on rank
    1's host without the run's secret gets no answer from the store, which counts it."""
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "apex", "keygen", str(keys)], check=True, capture_output=True)
    port = 5560
    master = f"10.231.1.1:{port + 4}"
    fast = ["--set", "transport.heartbeat_interval_s=0.2", "--set", "transport.heartbeat_timeout_s=2"]
    fast += ["--set", "learner.metrics_interval_s=0.5", "--curve-dir", str(keys)]
    tag = hosts["learner"][len("apexl") :]
    group = ["--world-size", "2", "--master", master, "--port", str(port), "--stop-env-steps", "30000", *fast]
    rank0 = in_host(
        hosts["learner"],
        "learner",
        "--rank",
        "0",
        "--bind-host",
        "10.231.1.1",
        "--logdir",
        str(tmp_path / "host0"),
        *group,
        env={"GLOO_SOCKET_IFNAME": f"vl1{tag}"},
    )
    rank1 = in_host(
        hosts["actor1"],
        "learner",
        "--rank",
        "1",
        "--bind-host",
        "10.231.1.2",
        "--logdir",
        str(tmp_path / "host1"),
        *group,
        env={"GLOO_SOCKET_IFNAME": f"vr1{tag}"},
    )
    actors = [
        in_host(hosts["learner"], "actor", "--learner", f"10.231.1.1:{port}", *fast[:4], *fast[-2:]) for _ in range(2)
    ]
    procs = [rank0, rank1, *actors]
    try:
        stranger = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                hosts["actor1"],
                sys.executable,
                "-m",
                "tests.support.stranger",
                "10.231.1.1",
                str(port + 4),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert stranger.returncode == 0, f"the store answered a stranger: {stranger.stderr}"
        _, err = rank0.communicate(timeout=240)
        assert rank0.returncode == 0, err
        rank1.communicate(timeout=60)
        assert rank1.returncode == 0
    finally:
        kill_leftovers(procs)
    summary = json.loads((tmp_path / "host0" / "summary.json").read_text())
    assert summary["learner_updates"] > 0 and summary["env_steps"] >= 30000
    rows = [json.loads(line) for line in (tmp_path / "host0" / "metrics.jsonl").read_text().splitlines()]
    assert all(row["ranks"] == 2 for row in rows)
    assert rows[-1]["group_store_refusals"] >= 1
    assert "turned away a client without the run's key" in err
