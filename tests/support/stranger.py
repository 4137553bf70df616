"""A process that reaches a learner group's store and is not one of its ranks: what it can try
(tests/system/test_ranks.py on one host, tests/system/test_multihost.py across two). Runs as
``python -m tests.support.stranger HOST PORT`` too, inside another network namespace; it
exits 1 if the store answered it."""

from __future__ import annotations

import os
import socket
import sys

import msgpack
import zmq

from tests.support.processes import wait_for


def accepts(host: str, port: int) -> bool:
    """Whether something listens at host:port (a connection opened and closed)."""
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except OSError:
        return False


def stranger_sets(host: str, port: int, keys: int, value_bytes: int) -> bool:
    """A ZeroMQ client with CURVE keys of its own (the handshake is the only way in) sends
    ``keys`` sets of ``value_bytes`` and a get of torch's rendezvous key, and a plain TCP
    client writes raw bytes at the port: whether the store answered any of it."""
    # The store binds once its learner has started (torch's import alone takes seconds on a
    # loaded machine): a stranger that knocks before that tests nothing.
    wait_for(lambda: accepts(host, port), 90, f"the store at {host}:{port} to listen")
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.curve_serverkey = zmq.curve_keypair()[0]  # a guess: the store's key derives from the run's secret
    sock.linger = 0
    sock.connect(f"tcp://{host}:{port}")
    for k in range(keys):
        sock.send(msgpack.packb(["set", f"stranger/{k}", os.urandom(value_bytes)]), copy=False)
    sock.send(msgpack.packb(["get", "rank_0"]))
    answered = bool(sock.poll(3000))
    sock.close(linger=0)
    context.term()
    for _ in range(max(1, keys // 8)):
        try:
            with socket.create_connection((host, port), timeout=5) as raw:
                raw.sendall(b"\xff" * (4 * value_bytes))
        except OSError:
            pass  # the store hung up on it, or its short run ended (refused): no answer either way
    return answered


if __name__ == "__main__":
    sys.exit(1 if stranger_sets(sys.argv[1], int(sys.argv[2]), keys=8, value_bytes=1 << 20) else 0)
