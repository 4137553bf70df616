"""The learner's sockets: bound with apex's limits, CURVE's server keys and authenticator,
and closed without lingering. Shared by rank 0's ``LearnerEndpoint`` and a follower rank's
``TrajectoryEndpoint``."""

from __future__ import annotations

from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from apex.errors import ApexError
from apex.transport.keys import load_keypair
from apex.transport.ports import Ports


def bind_socket(
    context: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    host: str,
    port: int,
    curve: tuple[bytes, bytes] | None,
    ports: Ports,
    *,
    sndhwm: int = 0,
    rcvhwm: int = 0,
    buffer_bytes: int = 0,
    max_message_bytes: int = 0,
) -> zmq.Socket[bytes]:
    """A learner socket bound at host:port with apex's limits (and CURVE's server keys)."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if buffer_bytes:
        sock.setsockopt(zmq.RCVBUF, buffer_bytes)
    if sndhwm:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
    if rcvhwm:
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
    if max_message_bytes:
        # ZeroMQ drops a connection that sends a larger frame, before allocating it.
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey = curve
        sock.curve_server = True
    address = f"tcp://{host}:{port}"
    try:
        sock.bind(address)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        raise ApexError(
            f"cannot bind {address}: {e.strerror} (is another learner using ports {ports.control}-"
            f"{ports.weights} or its ranks' ports? pick another with --port)"
        ) from None
    return sock


def close_sockets(
    context: zmq.Context[zmq.Socket[bytes]], sockets: list[zmq.Socket[bytes] | None], auth: ThreadAuthenticator | None
) -> None:
    """Closes an endpoint's sockets (those made so far) without lingering, its CURVE
    authenticator, then its context."""
    for sock in sockets:
        if sock is not None:
            sock.close(linger=0)
    if auth is not None:
        auth.stop()
    context.term()


def start_curve(
    context: zmq.Context[zmq.Socket[bytes]], curve_dir: str
) -> tuple[ThreadAuthenticator, tuple[bytes, bytes]]:
    """The learner's CURVE key pair, and an authenticator that admits the authorised actors."""
    directory = Path(curve_dir)
    keypair = load_keypair(directory / "learner.key_secret")
    authorized = directory / "authorized"
    if not authorized.is_dir() or not any(authorized.glob("*.key")):
        raise ApexError(f"no authorised actor keys in {authorized}: run `apex keygen {directory}`")
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=str(authorized))
    return auth, keypair
