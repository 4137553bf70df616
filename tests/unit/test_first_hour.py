"""A new user's first hour, in-process: command-line shorthands, config errors, one answer
per hello and the ladder over however many actors join (the `apex` commands a user types,
`apex config` and what `apex run` prints: tests/system/test_first_hour.py)."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from apex import config as config_module
from apex.algos.apex_dqn import exploration
from apex.bench.transport import free_base_port
from apex.cli import build_parser, load_config
from apex.transport import ActorConnection, LearnerEndpoint, TransportConfig

FAST = TransportConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=0.5)
PATIENT = TransportConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=10.0)  # for clients that do not tick


# -- flags


def test_shorthands_set_the_config_and_set_wins_over_them():
    args = build_parser().parse_args(
        ["run", "--env", "Acrobot-v1", "--algo", "impala", "--seed", "3", "--num-envs", "4"]
    )
    config = load_config(args)
    assert (config.env.id, config.algo, config.seed, config.actor.num_envs) == ("Acrobot-v1", "impala", 3, 4)
    args = build_parser().parse_args(["learner", "--env", "Acrobot-v1", "--set", "env.id=MountainCar-v0"])
    assert load_config(args).env.id == "MountainCar-v0"
    args = build_parser().parse_args(["learner", "--env", "ALE/Pong-v5", "--seed", "0"])
    assert (load_config(args).env.id, load_config(args).seed) == ("ALE/Pong-v5", 0)


def test_a_seed_out_of_range_is_a_config_error():
    with pytest.raises(config_module.ConfigError, match="seed must be in 0..2"):
        config_module.load(None, ["seed=-1"])


# -- apex config


def test_a_config_that_is_neither_a_file_nor_a_preset_is_named():
    with pytest.raises(config_module.ConfigError, match="pong_apx.*pong_apex"):
        config_module.load("pong_apx")


def test_a_retired_key_in_an_old_config_is_dropped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        config = config_module.load_dict({"actor": {"num_actors": 4, "num_envs": 8}})
    assert config.actor.num_envs == 8 and "actor.num_actors" in caplog.text


# -- the learner's side of joining


class Endpoint:
    """A LearnerEndpoint polled in a thread, welcoming with the Ape-X ladder."""

    def __init__(self, port: int, options: TransportConfig = FAST) -> None:
        actor = config_module.ApexDqnConfig(eval_envs=1)
        self.endpoint = LearnerEndpoint(
            "127.0.0.1",
            port,
            lambda hello, index: {"epsilons": exploration.actor_epsilons(index, 4, actor)[0]},
            options,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.endpoint.poll(10)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.endpoint.close()


def test_actors_started_before_the_learner_are_each_answered_once(caplog):
    port = free_base_port()
    clients = [ActorConnection("127.0.0.1", port, options=PATIENT) for _ in range(3)]
    welcomes: list = [None] * 3

    def handshake(i: int) -> None:
        welcomes[i] = clients[i].handshake(timeout_s=20)

    threads = [threading.Thread(target=handshake, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(2.5)  # several hellos each, unanswered: the learner is not there yet
    with caplog.at_level(logging.INFO, logger="apex.transport"):
        endpoint = Endpoint(port, PATIENT)
        try:
            for t in threads:
                t.join(20)
            time.sleep(1.0)  # any late duplicate hello would be answered by now
            indices = sorted(w.fields["actor_index"] for w in welcomes)
            assert indices == [0, 1, 2]
            assert sorted(s.index for s in endpoint.endpoint.sessions) == [0, 1, 2]
        finally:
            endpoint.close()
            for c in clients:
                c.close()
    joined = [r.getMessage() for r in caplog.records if "joined" in r.getMessage()]
    assert len(joined) == 3, joined


def test_more_actors_than_ever_configured_explore_with_distinct_epsilons():
    port = free_base_port()
    endpoint = Endpoint(port)
    clients = [ActorConnection("127.0.0.1", port, options=FAST) for _ in range(6)]
    try:
        welcomes = [c.handshake(timeout_s=10) for c in clients]
        epsilons = {w.fields["actor_index"]: w.fields["setup"]["epsilons"][:3] for w in welcomes}
        assert sorted(epsilons) == list(range(6))
        flat = [e for eps in epsilons.values() for e in eps]
        assert len(set(flat)) == len(flat) == 18
        # one leaves: the next to join takes its place on the ladder
        clients[2].close()
        gone = welcomes[2].fields["actor_index"]
        deadline = time.monotonic() + 5
        while endpoint.endpoint.actors_connected > 5 and time.monotonic() < deadline:
            for c in clients[:2] + clients[3:]:
                c.tick()
            time.sleep(0.05)
        clients[2] = ActorConnection("127.0.0.1", port, options=FAST)
        newcomer = clients[2].handshake(timeout_s=10)
        assert newcomer.fields["actor_index"] == gone
        assert newcomer.fields["setup"]["epsilons"][:3] == epsilons[gone]
    finally:
        endpoint.close()
        for c in clients:
            c.close()


def test_an_actor_keeps_its_connection_alive_while_its_environments_are_made():
    """16 Atari environments take longer to make than the learner's heartbeat timeout: the
    actor ticks (heartbeats) between them, or the learner drops it and it joins twice."""
    from apex.envs.make import VectorEnv

    ticks = []
    envs = VectorEnv(config_module.EnvConfig(), 3, seed=0, tick=lambda: ticks.append(time.monotonic()))
    assert len(ticks) == 3
    envs.reset()
    assert len(ticks) == 6
