"""The learner group's store (apex.training.rendezvous): only the run's secret opens it, and
what an admitted rank may put in it is bounded."""

from __future__ import annotations

import datetime

import pytest

from apex.bench.transport import free_base_port
from apex.training import rendezvous
from apex.training.rendezvous import RunStore, StoreServer
from tests.support.processes import wait_for

SECRET, STRANGER = b"r" * 32, b"s" * 32


@pytest.fixture
def server():
    port = free_base_port()
    served = StoreServer("127.0.0.1", port, SECRET)
    yield served, port
    served.close()


def test_a_client_without_the_runs_secret_can_neither_set_nor_get(server):
    served, port = server
    stranger = RunStore("127.0.0.1", port, STRANGER, datetime.timedelta(seconds=4))
    try:
        with pytest.raises(RuntimeError, match="did not answer"):
            stranger.set("rank/0", b"forged")
    finally:
        stranger.close()
    assert served.keys == {}
    wait_for(lambda: served.refusals >= 1, 5, "the stranger's handshake to be counted")
    turned_away = served.turned_away
    rank = RunStore("127.0.0.1", port, SECRET, datetime.timedelta(seconds=4))
    try:
        rank.set("rank/0", b"real")
        assert rank.get("rank/0") == b"real" and rank.add("n", 2) == 2 and rank.check(["rank/0", "n"])
    finally:
        rank.close()
    assert served.turned_away == turned_away  # the rank's handshake was not counted as a stranger's


def test_a_rank_is_held_to_the_caps_with_a_refusal_naming_them(server, monkeypatch):
    served, port = server
    monkeypatch.setattr(rendezvous, "MAX_KEYS", 3)
    rank = RunStore("127.0.0.1", port, SECRET, datetime.timedelta(seconds=4))
    try:
        with pytest.raises(RuntimeError, match="at most 1 MiB"):
            rank.set("big", b"x" * (rendezvous.MAX_VALUE_BYTES + 1))
        for i in range(3):
            rank.set(f"k{i}", b"v")
        with pytest.raises(RuntimeError, match="its most keys"):
            rank.set("k3", b"v")
        assert served.held_bytes <= rendezvous.MAX_STORE_BYTES
    finally:
        rank.close()
