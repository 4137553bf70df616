"""LearnerEndpoint: the learner's control channel (hello, welcome, heartbeats, stop) and
weight publisher, with its trajectory receiver; TrajectoryEndpoint: a follower rank's.

What a hello is answered is decided in ``apex.transport.handshake``; the sockets are bound
and closed by ``apex.transport.learner_sockets``."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import zmq
from zmq.auth.thread import ThreadAuthenticator

from apex.config import TransportConfig
from apex.errors import ProtocolError
from apex.system.logs import RateLimitedLog
from apex.transport.handshake import Handshake, Refusal
from apex.transport.learner_sockets import bind_socket, close_sockets, start_curve
from apex.transport.ports import Ports
from apex.transport.receiver import TrajectoryReceiver
from apex.transport.sessions import (
    HelloLimiter,
    RejectCounter,
    Sessions,
    SessionSigner,
    SignedSessions,
    peer_address,
)
from apex.wire import protocol
from apex.wire.protocol import Message

log = logging.getLogger("apex.transport")

MAX_CONTROL_PER_POLL = 32  # control messages handled per loop iteration: the train loop goes on under a flood
AUTO_ID_PREFIX = b"\x00"  # routing ids that a ROUTER makes up start with a zero byte
CONTROL_HWM = 100  # control messages queued per peer before ZeroMQ stops reading its connection
WEIGHTS_PORT_MAX_BYTES = 512  # a registration (a session token), or a CURVE handshake command


class LearnerEndpoint:
    """The learner's control channel and weight publisher, plus its trajectory receiver.

    ``poll``, ``publish_weights`` and ``stop_actors`` belong to one thread (the learner's
    main loop); ``receiver`` is handed to the ingest thread, which is its only user.
    ``setup_for`` is called for each hello with the message and the actor index to be
    assigned; it returns the actor's setup, sent back in the welcome, or raises
    ``Rejected(reason)``.

    In a learner group (``routes``: where each rank takes trajectories), this endpoint is rank
    0's and decides which rank a new session's batches go to: the one with the fewest live
    sessions (the lowest of those), whatever index the hello asks for; the session's token
    names that rank under the group's HMAC, so every other rank refuses its batches.

    Weights go out over a ROUTER socket to the actors that registered their session on it,
    rather than over PUB/SUB: a PUB socket keeps every topic a subscriber sends, so any
    peer could grow the learner's memory at will.
    """

    def __init__(
        self,
        host: str,
        port: int,
        setup_for: Callable[[Message, int], Mapping[str, Any]],
        options: TransportConfig = TransportConfig(),
        signer: SessionSigner | None = None,
        routes: list[Mapping[str, Any] | None] | None = None,
    ) -> None:
        """``signer``: in a learner group, issues session tokens that every rank can check;
        ``routes``: the welcome's ``trajectories`` for each rank of the group (None for rank
        0, this endpoint's own port)."""
        self.ports = Ports.from_base(port)
        self.signer = signer
        self.routes = list(routes) if routes else [None]
        self.options = options
        self.context = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self.sessions = Sessions()
        self.rejected = RejectCounter()
        self._handshake = Handshake(
            self.sessions, self.rejected, setup_for, options.heartbeat_timeout_s, signer, self.routes
        )
        self.incarnation = os.urandom(8)  # tells actors that this is a new learner, whatever its versions
        self._stopping: str | None = None
        self._weights: tuple[int, list[bytes | bytearray], bytes] | None = None  # version, frames, packed
        self._hellos = HelloLimiter()
        self._bad_log = RateLimitedLog(log)
        self._idle_poller: tuple[int | None, zmq.Poller] | None = None  # wait()'s, with the fd it watches
        try:
            curve = self._start_curve(options.curve_dir) if options.curve_dir else None
            # Control messages carry no arrays: a header's worth is the most a frame may hold.
            self.control = self._bind(
                zmq.ROUTER,
                host,
                self.ports.control,
                curve,
                max_message_bytes=protocol.MAX_HEADER_BYTES,
                rcvhwm=CONTROL_HWM,
            )
            # An actor keeps its routing id across the fresh sockets it opens while retrying
            # (lazy pirate); the newest connection takes that id over, so its hellos are known
            # as one actor's, with one index, instead of leaving ghosts behind.
            self.control.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # Registrations are a session token; room for the CURVE handshake's commands.
            self._weights_socket = self._bind(
                zmq.ROUTER,
                host,
                self.ports.weights,
                curve,
                sndhwm=1,
                max_message_bytes=WEIGHTS_PORT_MAX_BYTES,
                rcvhwm=CONTROL_HWM,
            )
            self._weights_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone actor raises, never blocks
            pull = self._bind(
                zmq.PULL,
                host,
                self.ports.trajectories,
                curve,
                rcvhwm=options.trajectory_hwm,
                buffer_bytes=options.trajectory_buffer_bytes,
                max_message_bytes=options.max_message_bytes + protocol.MAX_HEADER_BYTES,
            )
        except Exception:
            self.close()
            raise
        self.receiver = TrajectoryReceiver(pull, options, self.sessions, self.rejected)

    @property
    def actors_connected(self) -> int:
        return len(self.sessions)

    @property
    def rejected_messages(self) -> int:
        return self.rejected.total

    def poll(self, timeout_ms: int = 0) -> int:
        """Handles pending control messages, at most MAX_CONTROL_PER_POLL, waiting up to
        ``timeout_ms`` for the first; reads weight registrations; forgets actors silent for
        too long. Returns how many control messages were handled."""
        handled = 0
        if self.control.poll(timeout_ms):
            while handled < MAX_CONTROL_PER_POLL:
                try:
                    frames = self.control.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
                handled += 1
        self._read_registrations()
        self._expire_silent_actors()
        return handled

    def wait(self, timeout_ms: int, wake_fd: int | None = None) -> None:
        """Blocks until a control message or a weights registration arrives, ``wake_fd`` (a
        file descriptor) becomes readable, or ``timeout_ms`` passes; handles nothing (poll
        does). The learner's loop sleeps here instead of spinning when it cannot train."""
        if self._idle_poller is None or self._idle_poller[0] != wake_fd:
            poller = zmq.Poller()
            poller.register(self.control, zmq.POLLIN)
            poller.register(self._weights_socket, zmq.POLLIN)
            if wake_fd is not None:
                poller.register(wake_fd, zmq.POLLIN)
            self._idle_poller = (wake_fd, poller)
        self._idle_poller[1].poll(timeout_ms)

    def publish_weights(self, version: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Sends weights to every registered actor (copied now: later changes to the arrays
        are not sent). An actor that has not read the previous copy misses this one."""
        frames = protocol.encode(
            "weights", {"version": int(version), "incarnation": self.incarnation}, arrays, compress=False
        )
        packed = protocol.pack(frames)
        self._weights = (int(version), frames, packed)
        for session in self.sessions:
            if session.weights_identity is not None:
                self._send_weights(session.weights_identity, packed)

    @property
    def weights_version(self) -> int:
        return self._weights[0] if self._weights else -1

    def stop_actors(self, reason: str) -> None:
        """Tells every actor to stop now, and any that calls in later."""
        self._stopping = reason
        for session in self.sessions:
            self._send(session.identity, "stop", {"reason": reason})

    def close(self) -> None:
        receiver = getattr(self, "receiver", None)
        close_sockets(
            self.context,
            [
                getattr(self, "control", None),
                getattr(self, "_weights_socket", None),
                receiver.socket if receiver is not None else None,
            ],
            self._auth,
        )
        self._auth = None

    # -- internals

    def _bind(
        self, kind: int, host: str, port: int, curve: tuple[bytes, bytes] | None, **options: int
    ) -> zmq.Socket[bytes]:
        return bind_socket(self.context, kind, host, port, curve, self.ports, **options)

    def _start_curve(self, curve_dir: str) -> tuple[bytes, bytes]:
        self._auth, keypair = start_curve(self.context, curve_dir)
        return keypair

    def _reject(self, reason: str, fmt: str, *args: Any) -> None:
        self.rejected.add(reason)
        self._bad_log.warning(fmt, *args)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        try:
            # Actors send no arrays here: a message declaring any is refused before it is read.
            msg = protocol.decode(frames[1:], max_array_bytes=0, max_message_bytes=0)
        except ProtocolError as e:
            version = protocol.peek_version(frames[1]) if len(frames) > 1 else None
            if version is not None and version != protocol.PROTOCOL:
                reason = (
                    f"protocol mismatch: actor speaks version {version}, learner {protocol.PROTOCOL}; "
                    "install the same apex version on both sides"
                )
                self._send(identity, "reject", {"reason": reason, "retry": False})
            self._reject("malformed", "rejected control message: %s", e)
            return
        if msg.type == "hello" and identity.startswith(AUTO_ID_PREFIX):
            # A connection without a routing id of its own: an actor's superseded socket
            # (ROUTER_HANDOVER renames it while its queued hellos drain), or not an apex
            # actor (they always set one). A welcome could not reach it: nothing to do.
            return
        if msg.type == "hello":
            address = peer_address(frames[0])
            if self._hellos.allow(address, identity, time.monotonic()):
                self._hello(identity, msg)
            else:
                self._reject("hello_rate", "dropped hellos from %s: over the rate limit", address)
        elif msg.type == "heartbeat":
            session = self.sessions.get(identity)
            if self._stopping is not None:
                self._send(identity, "stop", {"reason": self._stopping})
                if session is not None:  # told: the learner's last moments need not wait for it
                    self.sessions.close(session)
            elif session is None:  # e.g. this learner restarted: the actor must say hello again
                self._send(identity, "reject", {"reason": "unknown actor: say hello again", "retry": True})
            else:
                session.last_seen = time.monotonic()
                self._send(identity, "heartbeat_ack", {"weights_version": self.weights_version})
        else:
            self._reject("unexpected_type", "rejected a %r message on the control port", msg.type)

    def _hello(self, identity: bytes, msg: Message) -> None:
        if self._stopping is not None:
            self._send(identity, "stop", {"reason": self._stopping})
            return
        answer = self._handshake.answer(identity, msg)
        if isinstance(answer, Refusal):
            self._send(identity, "reject", {"reason": answer.reason, "retry": answer.retry})
            return
        session = answer.session
        if not self._send(
            identity,
            "welcome",
            {
                "actor_index": session.index,
                "setup": answer.setup,
                "session": session.token,
                "incarnation": self.incarnation,
            },
        ):
            self.sessions.close(session)
            return
        if self._weights is not None:
            with contextlib.suppress(zmq.Again):  # it is not reading: the weights port will do
                self.control.send_multipart([identity, *self._weights[1]], copy=False, flags=zmq.NOBLOCK)
        if answer.joined:
            log.info("actor %d joined from %s (pid %d)", session.index, session.host, session.pid)

    def _read_registrations(self) -> None:
        """Actors register their session on the weights port; only live sessions are kept."""
        for _ in range(MAX_CONTROL_PER_POLL):
            try:
                frames = self._weights_socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            session = self.sessions.by_token(frames[1]) if len(frames) == 2 else None
            if session is None:
                self._reject("no_session", "a weights registration without a live session")
                continue
            session.weights_identity = frames[0]
            if self._weights is not None:
                self._send_weights(frames[0], self._weights[2])

    def _send_weights(self, identity: bytes, packed: bytes) -> None:
        try:
            self._weights_socket.send_multipart([identity, packed], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:  # not reading (its queue holds a copy), or gone: heartbeats will tell
            pass

    def _expire_silent_actors(self) -> None:
        deadline = time.monotonic() - self.options.heartbeat_timeout_s
        for session in self.sessions:
            if session.last_seen < deadline:
                self.sessions.close(session)
                log.info(
                    "actor %d (%s) went silent; dropped (its session sent %d env steps, %d episodes)",
                    session.index,
                    session.host,
                    session.env_steps,
                    session.episodes,
                )

    def _send(self, identity: bytes, msg_type: str, fields: Mapping[str, Any]) -> bool:
        """Sends a control message; False if it could not be (encoded or queued)."""
        try:
            frames = protocol.encode(msg_type, fields)
        except (ProtocolError, ValueError, TypeError, OverflowError) as e:  # e.g. a value msgpack cannot hold
            self._reject("unanswerable", "could not answer an actor: %s", e)
            return False
        try:
            self.control.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
        except zmq.Again:  # the actor's queue is full: it is not reading; heartbeats will tell
            return False
        return True


class TrajectoryEndpoint:
    """A follower rank's one socket: the trajectory stream of the actors the welcome sent to
    it (PULL, bound with the learner's limits and CURVE), checked against the group's signed
    sessions."""

    def __init__(self, host: str, port: int, ports: Ports, options: TransportConfig, sessions: SignedSessions) -> None:
        self.context = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self.rejected = RejectCounter()
        self.sessions = sessions
        try:
            curve = None
            if options.curve_dir:
                self._auth, curve = start_curve(self.context, options.curve_dir)
            pull = bind_socket(
                self.context,
                zmq.PULL,
                host,
                port,
                curve,
                ports,
                rcvhwm=options.trajectory_hwm,
                buffer_bytes=options.trajectory_buffer_bytes,
                max_message_bytes=options.max_message_bytes + protocol.MAX_HEADER_BYTES,
            )
        except Exception:
            self.close()
            raise
        self.receiver = TrajectoryReceiver(pull, options, sessions, self.rejected)

    def close(self) -> None:
        receiver = getattr(self, "receiver", None)
        close_sockets(self.context, [receiver.socket if receiver is not None else None], self._auth)
        self._auth = None
