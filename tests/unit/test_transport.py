"""apex.transport over real ZeroMQ sockets on loopback."""

from __future__ import annotations

import socket
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from apex.bench import transport as bench_transport
from apex.bench.transport import free_base_port
from apex.transport import (
    ActorConnection,
    HandshakeRejected,
    LearnerEndpoint,
    Rejected,
    TransportConfig,
    generate_keys,
)
from apex.wire import protocol
from tests.support.endpoints import FAST, SPEC, Learner, welcome_all


@pytest.fixture
def port():
    return free_base_port()


@pytest.fixture
def learner(port):
    learner = Learner(port)
    yield learner
    learner.close()


def make_client(port, **kwargs) -> ActorConnection:
    kwargs.setdefault("options", FAST)
    return ActorConnection("127.0.0.1", port, **kwargs)


def wait_for(predicate, timeout=5.0, tick=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if tick is not None:
            tick()
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_handshake_assigns_indices_and_sends_the_spec(learner, port):
    clients = [make_client(port, num_envs=4) for _ in range(2)] + [make_client(port, actor_index=7)]
    try:
        welcomes = [c.handshake(timeout_s=5) for c in clients]
        assert [w.fields["actor_index"] for w in welcomes] == [0, 1, 7]
        assert welcomes[0].fields["setup"] == {**SPEC, "epsilon": 0.4}
        assert wait_for(lambda: learner.endpoint.actors_connected == 3)
    finally:
        for c in clients:
            c.close()


def test_handshake_rejection_reason_reaches_the_actor(port):
    def refuse(hello, index):
        raise Rejected(f"this learner wants 1 env per actor, got {hello.fields['num_envs']}")

    learner = Learner(port, welcome=refuse)
    client = make_client(port, num_envs=3)
    try:
        with pytest.raises(HandshakeRejected, match="wants 1 env per actor, got 3"):
            client.handshake(timeout_s=5)
        assert learner.endpoint.actors_connected == 0
    finally:
        client.close()
        learner.close()


def test_protocol_mismatch_is_rejected_with_a_reason(learner, port):
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        dealer.send_multipart([msgpack.packb({"v": 99, "type": "hello", "anything": 1})])
        assert dealer.poll(5000)
        msg = protocol.decode(dealer.recv_multipart())
        assert msg.type == "reject"
        assert "protocol mismatch" in msg.fields["reason"] and "99" in msg.fields["reason"]
        assert learner.endpoint.rejected_messages == 1
    finally:
        dealer.close(linger=0)


def test_batches_arrive_decoded_with_the_actor_index(learner, port):
    client = make_client(port)
    try:
        client.handshake(timeout_s=5)
        for i in range(10):
            assert client.send_batch(
                {"obs": np.full((64, 4), i, np.float32)}, weights_version=i, info={"steps": 64}, timeout_s=5
            )
        received = []
        assert wait_for(
            lambda: (
                ((m := learner.endpoint.receiver.recv(50)) is not None and received.append(m)) or len(received) == 10
            )
        )
        assert [m.fields["weights_version"] for m in received] == list(range(10))
        assert all(m.fields["actor_index"] == 0 and m.fields["info"] == {"steps": 64} for m in received)
        np.testing.assert_array_equal(received[3].arrays["obs"], np.full((64, 4), 3, np.float32))
    finally:
        client.close()


def test_malformed_messages_are_counted_and_the_learner_keeps_serving(learner, port):
    context = zmq.Context.instance()
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port + 1}")
    dealer = context.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    client = make_client(port)
    try:
        push.send_multipart([b"\x93garbage", b"more"])
        push.send_multipart(protocol.encode("stop", {"reason": "wrong channel"}))
        dealer.send_multipart([b"not msgpack at all \xc1"])
        client.handshake(timeout_s=5)
        assert client.send_batch({"x": np.arange(3)}, weights_version=0, timeout_s=5)
        receiver = learner.endpoint.receiver
        valid = []
        rejected = learner.endpoint.rejected
        assert wait_for(
            lambda: (
                ((m := receiver.recv(50)) is not None and valid.append(m))
                or (rejected.by_reason() == {"malformed": 2, "unexpected_type": 1} and valid)
            )
        )
        assert [m.arrays["x"].tolist() for m in valid] == [[0, 1, 2]]
        assert learner.endpoint.rejected_messages == 3
    finally:
        push.close(linger=0)
        dealer.close(linger=0)
        client.close()


def collect_weights(client, until_version, timeout=5.0):
    """Ticks the client, taking weights, until it holds ``until_version``."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not (seen and seen[-1].fields["version"] >= until_version):
        client.tick()
        if (weights := client.take_weights()) is not None:
            seen.append(weights)
        time.sleep(0.005)
    return seen


def test_new_actor_gets_current_weights_at_once_and_only_the_newest(learner, port):
    learner.call(lambda e: e.publish_weights(1, {"w": np.full(10, 1.0, np.float32)}))
    client = make_client(port)
    try:
        client.handshake(timeout_s=5)
        # PUB/SUB alone would miss weights published before the actor joined.
        assert [w.fields["version"] for w in collect_weights(client, 1)] == [1]
        for version in range(2, 60):  # published while the actor is not reading
            learner.call(lambda e, v=version: e.publish_weights(v, {"w": np.full(10, float(v), np.float32)}))
        seen = collect_weights(client, 59)
        versions = [w.fields["version"] for w in seen]
        assert versions[-1] == 59
        assert len(versions) < 5  # conflated: never a queue of 58 stale blobs
        assert versions == sorted(versions)
        np.testing.assert_array_equal(seen[-1].arrays["w"], np.full(10, 59.0, np.float32))
    finally:
        client.close()


def test_slow_learner_makes_the_actor_wait_with_bounded_queues(learner, port):
    """Nobody reads the trajectory stream: sends block after a bounded number of batches."""
    client = make_client(
        port, options=TransportConfig(trajectory_hwm=2, heartbeat_interval_s=0.05, heartbeat_timeout_s=5)
    )
    try:
        client.handshake(timeout_s=5)
        batch = {"obs": np.random.default_rng(0).integers(0, 255, (1 << 20,), dtype=np.uint8)}  # 1 MiB, incompressible
        sent = 0
        while sent < 200 and client.send_batch(batch, weights_version=0, timeout_s=0.5):
            sent += 1
        # HWMs on both sides plus the kernel's socket buffers: a handful of MiB, not 200.
        assert 2 <= sent < 40
        # The learner catches up: the actor can send again.
        received = 0
        while learner.endpoint.receiver.recv(200) is not None:
            received += 1
        assert received == sent
        assert client.send_batch(batch, weights_version=0, timeout_s=5)
    finally:
        client.close()


def test_silent_actor_is_dropped_and_stop_reaches_actors(learner, port):
    client, quiet = make_client(port), make_client(port)
    try:
        client.handshake(timeout_s=5)
        quiet.handshake(timeout_s=5)
        assert wait_for(lambda: learner.endpoint.actors_connected == 2, tick=client.tick)
        # `quiet` never ticks, so it sends no heartbeats
        assert wait_for(lambda: learner.endpoint.actors_connected == 1, tick=client.tick)
        learner.call(lambda e: e.stop_actors("stop-return reached"))
        assert wait_for(lambda: client.stop_reason == "stop-return reached", tick=client.tick)
        assert not client.send_batch({"x": np.arange(2)}, weights_version=0)
    finally:
        client.close()
        quiet.close()


def test_actor_reconnects_to_a_restarted_learner(port):
    learner = Learner(port)
    client = make_client(port, num_envs=2)
    try:
        assert client.handshake(timeout_s=5).fields["actor_index"] == 0
        learner.close()  # the learner dies

        restarted = {}

        def restart_later():
            time.sleep(1.0)
            restarted["learner"] = Learner(port)

        threading.Thread(target=restart_later).start()
        # tick() notices the silence and blocks in a new handshake until the learner is back
        assert wait_for(lambda: client.reconnects >= 1 and client.connected, timeout=15, tick=client.tick)
        assert client.actor_index == 0  # keeps its index
        new = restarted["learner"]
        try:
            assert wait_for(lambda: new.endpoint.actors_connected == 1, tick=client.tick)
            assert client.send_batch({"x": np.arange(5)}, weights_version=0, timeout_s=5)
            assert wait_for(lambda: new.endpoint.receiver.recv(50) is not None)
        finally:
            new.close()
    finally:
        client.close()


def test_curve_admits_only_authorised_actors(tmp_path, port):
    keys = tmp_path / "keys"
    generate_keys(keys)
    intruder = tmp_path / "intruder"
    generate_keys(intruder)
    (intruder / "learner.key").unlink()
    (intruder / "learner.key").write_bytes((keys / "learner.key").read_bytes())  # knows the server key

    options = TransportConfig(heartbeat_timeout_s=30, curve_dir=str(keys))
    learner = Learner(port, options=options)
    good = make_client(port, options=options)
    bad = make_client(port, options=TransportConfig(curve_dir=str(intruder)))
    plain = make_client(port, options=TransportConfig())
    try:
        assert good.handshake(timeout_s=5).fields["setup"]["env"] == SPEC["env"]
        assert good.send_batch({"x": np.arange(3)}, weights_version=0, timeout_s=5)
        for client in (bad, plain):
            with pytest.raises(TimeoutError):
                client.handshake(timeout_s=1.5)
            client._session, client.actor_index = bytes(16), 0  # made up: the batch is not even delivered
            client.send_batch({"x": np.arange(3)}, weights_version=0, timeout_s=0.5)
        received = []
        while (msg := learner.endpoint.receiver.recv(500)) is not None:
            received.append(msg)
        assert len(received) == 1  # only the authorised actor's batch got in
        assert learner.endpoint.actors_connected == 1
    finally:
        for client in (good, bad, plain):
            client.close()
        learner.close()


def test_bind_conflict_is_a_clear_error(learner, port):
    from apex.errors import ApexError

    with pytest.raises(ApexError, match="cannot bind .* pick another with --port"):
        LearnerEndpoint("127.0.0.1", port, welcome_all, FAST)


def test_free_base_port_hands_out_disjoint_free_ranges_below_the_kernels_ephemeral_ports():
    # A port the kernel hands out for an outgoing connection can take a learner's port between
    # choosing it and binding it (CI saw "Address already in use"): tests draw theirs below that range.
    first = free_base_port(span=6)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", first + 8))  # inside the range the next call tries first
        second = free_base_port(span=6)
    assert first + 6 <= second or second + 6 <= first  # not yet bound, yet never handed out twice
    assert not second <= first + 8 < second + 6
    assert max(first, second) + 6 <= bench_transport._ephemeral_low()
    for base in (first, second):
        probes = [socket.socket() for _ in range(6)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", base + offset))
        finally:
            for probe in probes:
                probe.close()


# Actors that hear the learner out longer than it waits for them: only the learner's clock counts.
PATIENT = TransportConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=10)


def group_learner(port: int, secret: bytes = b"g" * 32) -> Learner:
    """Rank 0's endpoint of a learner group of 2: rank 1 takes trajectories on port + 3."""
    from apex.transport.sessions import SessionSigner

    return Learner(
        port,
        options=TransportConfig(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0),
        signer=SessionSigner(secret),
        routes=[None, {"host": None, "port": port + 3}],
    )


def routed_rank(welcome, port: int) -> int:
    return 1 if welcome.fields["setup"].get("trajectories") == {"host": None, "port": port + 3} else 0


def test_rank_0_chooses_ranks_not_hellos_and_a_silent_sessions_place_comes_back(port):
    """A hello asking for an index does not choose its rank: rank 0 routes each new session to
    the rank with the fewest live ones; a session gone silent (no heartbeats) gives back its
    index and its place on its rank to the next actor."""
    learner = group_learner(port)
    first, asks_for_1, quiet = (
        make_client(port, options=PATIENT),
        make_client(port, actor_index=1, options=PATIENT),
        make_client(port, options=PATIENT),
    )
    try:
        assert routed_rank(first.handshake(timeout_s=5), port) == 0
        # index 1 would be rank 1 by index mod 2; rank 0 holds one session and rank 1 none
        welcome = asks_for_1.handshake(timeout_s=5)
        assert welcome.fields["actor_index"] == 1 and routed_rank(welcome, port) == 1
        welcome = quiet.handshake(timeout_s=5)  # a tie: the lowest rank
        assert welcome.fields["actor_index"] == 2 and routed_rank(welcome, port) == 0

        def tick():
            first.tick()
            asks_for_1.tick()

        # `quiet` sends no heartbeats: dropped, its index and its place on rank 0 go back
        assert wait_for(lambda: learner.endpoint.actors_connected == 2, tick=tick)
        late = make_client(port, options=PATIENT)
        try:
            welcome = late.handshake(timeout_s=5)
            assert welcome.fields["actor_index"] == 2 and routed_rank(welcome, port) == 0
        finally:
            late.close()
    finally:
        for client in (first, asks_for_1, quiet):
            client.close()
        learner.close()


def test_a_batch_goes_in_on_its_own_rank_alone(port):
    """A session's token names its rank under the group's HMAC: rank 0 refuses the batches of
    a session it routed to rank 1 (counted as wrong_rank), and a follower refuses tokens for
    any rank but its own, so a batch accepted on one rank and sent to another is not credited
    twice."""
    from apex.errors import RejectedMessage
    from apex.transport.sessions import SessionSigner, SignedSessions

    secret = b"g" * 32
    learner = group_learner(port, secret)
    own, elsewhere = make_client(port, options=PATIENT), make_client(port, options=PATIENT)
    try:
        assert routed_rank(own.handshake(timeout_s=5), port) == 0
        assert routed_rank(elsewhere.handshake(timeout_s=5), port) == 1
        rank_1 = SignedSessions(SessionSigner(secret), 1)
        fields = {"actor_index": elsewhere.actor_index, "session": elsewhere._session, "seq": 0}
        assert rank_1.check_batch(fields).index == elsewhere.actor_index  # accepted on its rank
        # ... and sent to rank 0 as well: refused there
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port + 1}")
        push.send_multipart(protocol.encode("batch", {**fields, "weights_version": 0, "info": {}}, {"x": np.arange(3)}))
        push.close(linger=5000)  # delivered before it closes
        assert own.send_batch({"x": np.arange(4)}, weights_version=0, timeout_s=5)
        received = []
        rejected = learner.endpoint.rejected
        assert wait_for(
            lambda: (
                ((m := learner.endpoint.receiver.recv(50)) is not None and received.append(m))
                or (rejected.by_reason() == {"wrong_rank": 1} and received)
            )
        )
        assert [m.arrays["x"].tolist() for m in received] == [[0, 1, 2, 3]]  # the honest one's, on its rank
        # rank 0's own session's batch on rank 1, and a token for rank 2: refused by rank 1
        for token in (own._session, SessionSigner(secret).token(5, 1, 2)):
            with pytest.raises(RejectedMessage, match="whose batches go to rank") as refused:
                rank_1.check_batch({"actor_index": 0, "session": token, "seq": 0})
            assert refused.value.reason == "wrong_rank"
        # the rank is under the HMAC: a token rewritten for rank 1 is no token at all
        forged = own._session[:16] + (1).to_bytes(4, "little") + own._session[20:]
        with pytest.raises(RejectedMessage, match="without a live session"):
            rank_1.check_batch({"actor_index": 0, "session": forged, "seq": 0})
    finally:
        own.close()
        elsewhere.close()
        learner.close()
