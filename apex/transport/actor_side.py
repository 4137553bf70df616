"""ActorConnection: an actor's (or `apex serve`'s) connection to the learner."""

from __future__ import annotations

import contextlib
import logging
import os
import socket as pysocket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from apex.config import TransportConfig
from apex.errors import ApexError, ProtocolError
from apex.system.logs import RateLimitedLog
from apex.transport.errors import HandshakeRejected, LearnerGone, Stopped
from apex.transport.keys import load_keypair, load_learner_public
from apex.transport.ports import MAX_HOST_CHARS, Ports
from apex.wire import protocol
from apex.wire.protocol import Message

log = logging.getLogger("apex.transport")

ACTOR_MAX_MESSAGE_BYTES = protocol.DEFAULT_MAX_MESSAGE_BYTES  # what an actor accepts from its learner
POLL_SLICE_S = 0.1  # longest an actor waits without looking at should_stop
WAITING_LOG_S = 10.0
BACKOFF_FIRST_S = 0.25  # hello retries wait this long at first, doubling up to BACKOFF_MAX_S
BACKOFF_MAX_S = 5.0


class ActorConnection:
    """An actor's connection to the learner: handshake, batches, weights, heartbeats.

    Call ``tick()`` from the actor loop every few milliseconds or more: it sends heartbeats,
    reads acks, weights and stop orders, and reconnects when the learner has gone quiet.
    ``should_stop`` is asked often while waiting (for the learner, or to send): once it
    says yes, the waiting call raises ``Stopped`` (within POLL_SLICE_S).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        actor_index: int | None = None,
        num_envs: int = 1,
        options: TransportConfig = TransportConfig(),
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.ports = Ports.from_base(port)
        self.host = host
        self.options = options
        self.actor_index = actor_index
        self.num_envs = num_envs
        self.should_stop = should_stop
        self.welcome: Message | None = None
        self.stop_reason: str | None = None
        self.reconnects = 0
        self._session: bytes | None = None
        self._incarnation: bytes | None = None  # of the learner whose weights we hold
        self._seq = 0  # of the next batch: never reused, across sessions too
        self._weights: Message | None = None
        self._weights_version = -1
        self._last_heard = time.monotonic()
        self._last_beat = 0.0
        self._bad_log = RateLimitedLog(log)
        self.context = zmq.Context()
        self._curve = self._load_curve(options.curve_dir) if options.curve_dir else None
        self._routing_id = b"actor-" + os.urandom(8).hex().encode()
        self.control = self._control_socket()
        self._route = (host, self.ports.trajectories)  # where batches go: the rank the welcome named
        self.trajectories = self._trajectory_socket()
        self.weights_socket = self._connect(zmq.DEALER, self.ports.weights, conflate=True)

    @property
    def connected(self) -> bool:
        return self.welcome is not None

    def handshake(self, timeout_s: float | None = None) -> Message:
        """Says hello until welcomed; returns the welcome. Retries with backoff until
        ``timeout_s`` (then raises TimeoutError) or, without it, until the learner has been
        silent for ``options.give_up_after_s`` (then raises LearnerGone; 0: forever). A
        reject raises HandshakeRejected with the learner's reason, unless the learner says
        to retry (e.g. the actor index is still held by this actor's previous process).
        While no learner answers, logs ``waiting for learner at HOST:PORT (N s)`` every
        WAITING_LOG_S. Raises Stopped as soon as ``should_stop()``.
        """
        if timeout_s is None and self.options.give_up_after_s > 0:
            left = self.options.give_up_after_s - (time.monotonic() - self._last_heard)
            try:
                return self.handshake(timeout_s=max(1.0, left))
            except TimeoutError:
                raise LearnerGone(
                    f"no learner answered at {self.host}:{self.ports.control} for "
                    f"{self.options.give_up_after_s:.0f}s (transport.give_up_after_s): giving up"
                ) from None
        started = time.monotonic()
        deadline = None if timeout_s is None else started + timeout_s
        next_log = started + WAITING_LOG_S
        wait = BACKOFF_FIRST_S
        retry_logged = False
        while True:
            self._send_control(
                "hello",
                {
                    "actor_index": self.actor_index,
                    "num_envs": self.num_envs,
                    "host": pysocket.gethostname()[:MAX_HOST_CHARS],
                    "pid": os.getpid(),
                },
            )
            answer_by = time.monotonic() + wait
            if deadline is not None:
                answer_by = min(answer_by, deadline)
            while (now := time.monotonic()) < answer_by:
                if self.should_stop():
                    raise Stopped("told to stop while waiting for the learner")
                if now >= next_log:
                    log.info("waiting for learner at %s:%d (%.0f s)", self.host, self.ports.control, now - started)
                    next_log = now + WAITING_LOG_S
                slice_ms = max(1, int(min(answer_by - now, POLL_SLICE_S) * 1000))
                if not self.control.poll(slice_ms):
                    continue
                msg = self._recv_control()
                if msg is None:
                    continue
                if msg.type == "welcome":
                    self._join(msg)
                    return msg
                if msg.type == "reject" and msg.fields["retry"]:
                    if not retry_logged:
                        log.info("learner asks to retry: %s", msg.fields["reason"])
                        retry_logged = True
                    answer_by = min(answer_by, time.monotonic() + wait)
                    break
                if msg.type == "reject":
                    raise HandshakeRejected(
                        f"learner at {self.host}:{self.ports.control} rejected this actor: {msg.fields['reason']}"
                    )
                if msg.type == "stop":
                    self.stop_reason = msg.fields["reason"]
                    raise HandshakeRejected(f"learner is stopping: {self.stop_reason}")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from a learner at {self.host}:{self.ports.control} within {timeout_s}s")
            self._sleep_until(answer_by)
            # Lazy pirate: a fresh socket drops the unanswered hello instead of queueing more.
            self.control.close(linger=0)
            self.control = self._control_socket()
            wait = min(wait * 2, BACKOFF_MAX_S)

    def tick(self) -> None:
        """Heartbeats, control messages, weights; reconnects if the learner went quiet."""
        now = time.monotonic()
        while self.control.poll(0):
            msg = self._recv_control()
            if msg is None:
                continue
            self._last_heard = now
            if msg.type == "stop":
                self.stop_reason = msg.fields["reason"]
            elif msg.type == "weights":
                self._offer_weights(msg)
            elif msg.type == "reject":  # the learner restarted and does not know us
                log.info("learner asks for a new handshake: %s", msg.fields["reason"])
                self._reconnect()
                return
        while self.weights_socket.poll(0):
            frame = self.weights_socket.recv(copy=False)
            try:
                self._offer_weights(protocol.decode(protocol.unpack(frame)))
            except ProtocolError as e:
                self._bad_log.warning("ignored malformed weights: %s", e)
        if now - self._last_heard > self.options.heartbeat_timeout_s:
            log.warning("no word from the learner for %.1fs; reconnecting", now - self._last_heard)
            self._reconnect()
        elif now - self._last_beat >= self.options.heartbeat_interval_s:
            self._send_control("heartbeat", {"actor_index": self.actor_index})
            self._last_beat = now

    def take_weights(self) -> Message | None:
        """The newest weights received since the last call, or None."""
        weights, self._weights = self._weights, None
        return weights

    def send_batch(
        self,
        arrays: Mapping[str, np.ndarray],
        *,
        weights_version: int,
        info: Mapping[str, Any] | None = None,
        timeout_s: float | None = None,
    ) -> bool:
        """Sends one batch in this actor's session; while the learner's queue is full, waits
        (ticking). Returns False if ``timeout_s`` passed or a stop arrived before it could be
        sent; raises Stopped if ``should_stop()`` while waiting."""
        if self._session is None:
            raise ApexError("send_batch before a handshake: call handshake() first")
        frames = protocol.encode(
            "batch",
            {
                "actor_index": self.actor_index,
                "weights_version": int(weights_version),
                "info": dict(info or {}),
                "session": self._session,
                "seq": self._seq,
            },
            arrays,
        )
        self._seq += 1
        return self.send_frames(frames, timeout_s=timeout_s)

    def send_frames(self, frames: Sequence[bytes | bytearray], *, timeout_s: float | None = None) -> bool:
        """Sends an encoded batch (see ``send_batch``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.stop_reason is None:
            try:
                self.trajectories.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                return False
            if self.should_stop():
                raise Stopped("told to stop while waiting to send")
            self.trajectories.poll(50, zmq.POLLOUT)
            self.tick()
        return False

    def close(self) -> None:
        for sock in (self.control, self.trajectories, self.weights_socket):
            sock.close(linger=0)
        self.context.term()

    # -- internals

    def _join(self, msg: Message) -> None:
        self.welcome = msg
        self.actor_index = msg.fields["actor_index"]
        self._session = msg.fields["session"]
        self._last_heard = time.monotonic()
        if msg.fields["incarnation"] != self._incarnation:
            # A new learner (restarted, perhaps from an older checkpoint): its weights count
            # whatever their version, or the actor would ignore them for good.
            self._incarnation = msg.fields["incarnation"]
            self._weights_version = -1
        route = self._route_of(msg.fields["setup"].get("trajectories"))
        if route != self._route:  # a learner group sends this actor's batches to another rank
            self._route = route
            self.trajectories.close(linger=0)
            self.trajectories = self._trajectory_socket()
            log.info("sending batches to the learner rank at %s:%d", *route)
        # Weights come on their own port to the sessions registered there.
        with contextlib.suppress(zmq.Again):
            self.weights_socket.send(self._session, flags=zmq.NOBLOCK)

    def _sleep_until(self, until: float) -> None:
        """Waits (for a retry) in slices, honouring should_stop."""
        while (left := until - time.monotonic()) > 0:
            if self.should_stop():
                raise Stopped("told to stop while waiting for the learner")
            time.sleep(min(left, POLL_SLICE_S))

    def _load_curve(self, curve_dir: str) -> tuple[bytes, bytes, bytes]:
        directory = Path(curve_dir)
        public, secret = load_keypair(directory / "actor.key_secret")
        return public, secret, load_learner_public(directory / "learner.key")

    def _connect(
        self,
        kind: int,
        port: int,
        *,
        host: str | None = None,
        sndhwm: int = 0,
        conflate: bool = False,
        buffer_bytes: int = 0,
        routing_id: bytes | None = None,
    ) -> zmq.Socket[bytes]:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, ACTOR_MAX_MESSAGE_BYTES)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if buffer_bytes:
            sock.setsockopt(zmq.SNDBUF, buffer_bytes)
        if sndhwm:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        if conflate:
            sock.setsockopt(zmq.CONFLATE, 1)  # hold only the newest message
        if self._curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._curve
        sock.connect(f"tcp://{host or self.host}:{port}")
        return sock

    def _route_of(self, trajectories: Any) -> tuple[str, int]:
        """The address a welcome's ``trajectories`` names ({"host": HOST or None, "port": P}:
        None is the learner's own host), or the learner's trajectory port without one."""
        if not isinstance(trajectories, dict):
            return (self.host, self.ports.trajectories)
        host, port = trajectories.get("host") or self.host, trajectories.get("port")
        if not isinstance(host, str) or type(port) is not int or not 1 <= port <= 65535:
            log.warning("ignored a malformed trajectories address in the welcome: %r", trajectories)
            return (self.host, self.ports.trajectories)
        return (host, port)

    def _trajectory_socket(self) -> zmq.Socket[bytes]:
        return self._connect(
            zmq.PUSH,
            self._route[1],
            host=self._route[0],
            sndhwm=self.options.trajectory_hwm,
            buffer_bytes=self.options.trajectory_buffer_bytes,
        )

    def _control_socket(self) -> zmq.Socket[bytes]:
        return self._connect(zmq.DEALER, self.ports.control, routing_id=self._routing_id)

    def _reconnect(self) -> None:
        self.reconnects += 1
        self.welcome = None
        self.control.close(linger=0)
        self.control = self._control_socket()
        self.handshake()

    def _send_control(self, msg_type: str, fields: Mapping[str, Any]) -> None:
        try:
            self.control.send_multipart(protocol.encode(msg_type, fields), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet: the next heartbeat or hello goes instead

    def _recv_control(self) -> Message | None:
        frames = self.control.recv_multipart(copy=False)
        try:
            return protocol.decode(frames)
        except ProtocolError as e:
            self._bad_log.warning("ignored malformed control message from the learner: %s", e)
            return None

    def _offer_weights(self, msg: Message) -> None:
        if msg.type != "weights" or msg.fields["incarnation"] != self._incarnation:
            return  # not weights, or a previous learner's
        version = msg.fields["version"]
        if version > self._weights_version:  # never go back to older weights of this learner
            self._weights_version = version
            self._weights = msg
