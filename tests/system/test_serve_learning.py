"""Tasks learned through `apex serve`: their environments stepped by client processes that
are not apex actors (``apex.bench.cartpole_client``: a vectorised Gymnasium simulator, all its
actions in one request a step), two servers with a client each. CartPole over ZeroMQ and over
HTTP with both algorithms; a recurrent IMPALA on a memory task and APPO's continuous actions on
Pendulum with one client on each transport. How long that takes beside local actors is `apex
bench serve`'s second table (a benchmark prints times; a test holds behaviour): here, that the
threshold is reached."""

from __future__ import annotations

import shutil

import pytest

from apex.bench.serve import time_to_475
from apex.bench.serve_learning import TASKS, time_to_threshold


def logs(tmp_path) -> str:
    return "\n".join(p.read_text()[-1500:] for p in sorted(tmp_path.glob("*.log")))


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
@pytest.mark.parametrize("transport", ["zmq", "http"])
def test_cartpole_is_learned_through_apex_serve(algo, transport, tmp_path):
    run = time_to_475(algo, transport, tmp_path, limit_s=120)
    assert run["reached"], logs(tmp_path)
    assert run["env_steps"] > 50_000 and run["startup_s"] < run["seconds"]


def test_a_recurrent_policy_learns_a_memory_task_through_apex_serve(tmp_path):
    """Recall: a cue on the first step only, to be named 10 steps later. A feed-forward policy
    scores 0 at best; 0.9 needs the core's state carried across each episode's requests."""
    run = time_to_threshold("recall", "impala", "both", tmp_path, limit_s=120)
    assert run["reached"], logs(tmp_path)
    assert run["best_return"] >= TASKS["recall"].threshold


def test_a_continuous_policy_learns_pendulum_through_apex_serve(tmp_path):
    """APPO's Gaussian policy: the server samples, bounds the torque into [-2, 2] and keeps
    the sample's density; Pendulum's -250 (from about -1200 at random) follows."""
    run = time_to_threshold("pendulum", "appo", "both", tmp_path, limit_s=240)
    assert run["reached"], logs(tmp_path)
    assert run["env_steps"] > 100_000


@pytest.mark.skipif(shutil.which("node") is None, reason="no Node on PATH (.ci/run installs Debian's nodejs)")
def test_a_javascript_client_written_from_the_schema_learns_cartpole(tmp_path):
    """deploy/clients/cartpole.mjs: CartPole's dynamics in JavaScript and the HTTP API, no
    apex code, two servers with a client of 32 environments each."""
    run = time_to_475("impala", "node", tmp_path, limit_s=120)
    assert run["reached"], logs(tmp_path)
    assert run["env_steps"] > 50_000


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_two_agents_with_a_policy_each_learn_to_meet_through_apex_serve(algo, tmp_path):
    """meet, multi_agent.mapping per_agent: each request carries both agents' observations,
    rewards and done flags, each agent acts with its own policy, and each policy's steps go to
    the learner as its own stream; one client on each transport. Acting at random scores -0.4
    and an agent blind to its partner cannot get near 0.75 (the team's mean return)."""
    run = time_to_threshold("meet", algo, "both", tmp_path, limit_s=150)
    assert run["reached"], logs(tmp_path)
    assert sorted(run["policy_updates"]) == ["a_0", "a_1"] and all(n > 0 for n in run["policy_updates"].values())
