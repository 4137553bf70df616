"""CartPole learned through `apex serve`: its environments stepped by client processes that
are not apex actors (``apex.bench.cartpole_client``: gymnasium's vectorised CartPole, all
its actions in one request a step), over ZeroMQ and over HTTP, two servers with a client
each, both algorithms. How long that takes beside local actors is `apex bench serve`'s
second table (a benchmark prints times; a test holds behaviour): here, that 475 is reached."""

from __future__ import annotations

import pytest

from apex.bench.serve import time_to_475


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
@pytest.mark.parametrize("transport", ["zmq", "http"])
def test_cartpole_is_learned_through_apex_serve(algo, transport, tmp_path):
    run = time_to_475(algo, transport, tmp_path, limit_s=120)
    logs = "\n".join(p.read_text()[-1500:] for p in sorted(tmp_path.glob("*.log")))
    assert run["reached"], logs
    assert run["env_steps"] > 50_000 and run["startup_s"] < run["seconds"]
