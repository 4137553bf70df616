"""ZeroMQ transport between one learner and any number of actors.

The learner binds three sockets on consecutive ports; actors connect to them:

    port P     control       ROUTER <- DEALER   hello/welcome/reject, heartbeats, stop
    port P+1   trajectories  PULL   <- PUSH     batches; a high-water mark makes a slow
                                                learner push back on its actors
    port P+2   weights       PUB    -> SUB      newest weights only (CONFLATE on the actor,
                                                a send queue of one on the learner)

An actor says hello and gets a welcome with the run's spec and its actor index (or a
reject with a reason), then the current weights at once over the control channel, then
newer ones as they are published. Both sides send heartbeats; an actor that stops hearing
from the learner drops its control socket and says hello again until a learner answers
(the lazy-pirate pattern), so a restarted learner gets its actors back by itself.

Optional CURVE (``apex keygen DIR``): every socket is encrypted and the learner accepts only
the actor public keys in ``DIR/authorized/``.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket as pysocket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from apex import protocol
from apex.errors import ApexError, ProtocolError
from apex.protocol import Message

log = logging.getLogger(__name__)

DEFAULT_PORT = 5550


@dataclass(frozen=True)
class Ports:
    """The learner's ports: the one a user names and the two after it."""

    control: int
    trajectories: int
    weights: int

    @classmethod
    def from_base(cls, port: int) -> Ports:
        if not 1 <= port <= 65533:
            raise ApexError(f"port must be in 1..65533 (the learner also uses port+1 and port+2), got {port}")
        return cls(port, port + 1, port + 2)


@dataclass(frozen=True)
class TransportOptions:
    """Settings shared by both ends (the `transport` section of a config)."""

    trajectory_hwm: int = 4
    """Batches an actor may have queued before sending blocks (ZeroMQ high-water mark)."""
    trajectory_buffer_bytes: int = 32 * 1024
    """Kernel socket buffer of the trajectory stream on each side. The high-water mark
    counts messages, but without this cap the kernel's own buffers (megabytes) hold
    hundreds of small batches, which then reach a throttled learner seconds stale."""
    heartbeat_interval_s: float = 1.0
    """How often each side tells the other it is alive."""
    heartbeat_timeout_s: float = 5.0
    """Silence after which the other side counts as gone."""
    max_array_bytes: int = protocol.DEFAULT_MAX_ARRAY_BYTES
    """Largest array a received message may declare."""
    max_message_bytes: int = protocol.DEFAULT_MAX_MESSAGE_BYTES
    """Largest total of arrays a received message may declare."""
    curve_dir: str | None = None
    """Directory made by `apex keygen`; enables CURVE encryption and authentication."""
    give_up_after_s: float = 600.0
    """An actor that has not heard from the learner for this long stops trying and exits
    (LearnerGone); 0: it keeps trying forever."""


def options_from_config(transport: Any) -> TransportOptions:
    """TransportOptions from a config's ``transport`` section."""
    return TransportOptions(
        trajectory_hwm=transport.trajectory_hwm,
        trajectory_buffer_bytes=transport.trajectory_buffer_bytes,
        heartbeat_interval_s=transport.heartbeat_interval_s,
        heartbeat_timeout_s=transport.heartbeat_timeout_s,
        curve_dir=transport.curve_dir,
        give_up_after_s=transport.give_up_after_s,
    )


class LearnerGone(ApexError):
    """No learner answered for ``give_up_after_s``: it stopped for good, or never came."""


class HandshakeRejected(ApexError):
    """The learner refused this actor; the message gives its reason."""


class Rejected(Exception):
    """Raised by a learner's welcome callback to turn an actor away with a reason."""


# ---------------------------------------------------------------------------------------
# CURVE keys


def generate_keys(directory: str | os.PathLike) -> dict[str, Path]:
    """Writes a learner and an actor key pair, and authorises the actor's public key.

    Layout: learner.key / learner.key_secret, actor.key / actor.key_secret, and
    authorized/actor.key. Actor hosts need actor.key_secret and learner.key only.
    """
    directory = Path(directory)
    authorized = directory / "authorized"
    authorized.mkdir(parents=True, exist_ok=True)
    for name in ("learner", "actor"):
        if (directory / f"{name}.key_secret").exists():
            raise ApexError(f"{directory / (name + '.key_secret')} exists: choose an empty directory")
    zmq.auth.create_certificates(str(directory), "learner")
    zmq.auth.create_certificates(str(directory), "actor")
    shutil.copy(directory / "actor.key", authorized / "actor.key")
    for secret in directory.glob("*.key_secret"):
        secret.chmod(0o600)
    return {
        "learner_secret": directory / "learner.key_secret",
        "learner_public": directory / "learner.key",
        "actor_secret": directory / "actor.key_secret",
        "actor_public": directory / "actor.key",
        "authorized": authorized,
    }


def _load_keypair(path: Path) -> tuple[bytes, bytes]:
    if not path.exists():
        raise ApexError(f"CURVE key {path} not found: create keys with `apex keygen {path.parent}`")
    public, secret = zmq.auth.load_certificate(str(path))
    if not secret:
        raise ApexError(f"{path} holds no secret key: use the .key_secret file")
    return public, secret


def _load_public(path: Path) -> bytes:
    if not path.exists():
        raise ApexError(f"CURVE key {path} not found: copy the learner's learner.key next to actor.key_secret")
    public, _ = zmq.auth.load_certificate(str(path))
    return public


# ---------------------------------------------------------------------------------------
# Learner side


@dataclass
class ActorRecord:
    """What the learner knows of one connected actor."""

    index: int
    host: str
    pid: int
    num_envs: int
    last_seen: float


class LearnerEndpoint:
    """The learner's control channel and weight publisher, plus its trajectory receiver.

    ``poll``, ``publish_weights`` and ``stop_actors`` belong to one thread (the learner's
    main loop); ``receiver`` is handed to the ingest thread, which is its only user.
    ``welcome`` is called for each hello with the message and the actor index to be
    assigned; it returns the spec sent back, or raises ``Rejected(reason)``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        welcome: Callable[[Message, int], Mapping[str, Any]],
        options: TransportOptions = TransportOptions(),
    ) -> None:
        self.ports = Ports.from_base(port)
        self.options = options
        self._welcome = welcome
        self.context = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        self.actors: dict[bytes, ActorRecord] = {}
        self.rejected_messages = 0
        self._stopping: str | None = None
        self._weights: tuple[int, list[bytes], bytes] | None = None  # version, frames, packed
        self._bad_log = RateLimitedLog(log)
        try:
            curve = self._start_curve() if options.curve_dir else None
            self.control = self._bind(zmq.ROUTER, host, self.ports.control, curve)
            # An actor keeps its routing id across the fresh sockets it opens while retrying
            # (lazy pirate); the newest connection takes that id over, so its hellos are known
            # as one actor's, with one index, instead of leaving ghosts behind.
            self.control.setsockopt(zmq.ROUTER_HANDOVER, 1)
            self._weights_socket = self._bind(zmq.PUB, host, self.ports.weights, curve, sndhwm=1)
            pull = self._bind(zmq.PULL, host, self.ports.trajectories, curve, rcvhwm=options.trajectory_hwm,
                              buffer_bytes=options.trajectory_buffer_bytes)
        except Exception:
            self.close()
            raise
        self.receiver = TrajectoryReceiver(pull, options)

    @property
    def actors_connected(self) -> int:
        return len(self.actors)

    def poll(self, timeout_ms: int = 0) -> int:
        """Handles every pending control message, waiting up to ``timeout_ms`` for the first.

        Returns how many were handled. Also forgets actors silent for too long.
        """
        handled = 0
        while self.control.poll(timeout_ms if handled == 0 else 0):
            frames = self.control.recv_multipart(copy=False)
            self._handle(frames[0].bytes, frames[1:])
            handled += 1
        self._expire_silent_actors()
        return handled

    def publish_weights(self, version: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Broadcasts weights (copied now: later changes to the arrays are not sent)."""
        frames = protocol.encode("weights", {"version": int(version)}, arrays, compress=False)
        packed = protocol.pack(frames)
        self._weights = (int(version), frames, packed)
        # PUB never blocks: a subscriber that still holds an unread copy simply misses this one.
        self._weights_socket.send(packed, copy=False)

    @property
    def weights_version(self) -> int:
        return self._weights[0] if self._weights else -1

    def stop_actors(self, reason: str) -> None:
        """Tells every actor to stop now, and any that calls in later."""
        self._stopping = reason
        for identity in list(self.actors):
            self._send(identity, "stop", {"reason": reason})

    def close(self) -> None:
        for name in ("control", "_weights_socket"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close(linger=0)
        receiver = getattr(self, "receiver", None)
        if receiver is not None:
            receiver.socket.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.context.term()

    # -- internals

    def _bind(self, kind: int, host: str, port: int, curve, *, sndhwm: int = 0, rcvhwm: int = 0,
              buffer_bytes: int = 0) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if buffer_bytes:
            sock.setsockopt(zmq.RCVBUF, buffer_bytes)
        if sndhwm:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        if rcvhwm:
            sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey = curve
            sock.curve_server = True
        address = f"tcp://{host}:{port}"
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise ApexError(f"cannot bind {address}: {e.strerror} (is another learner using ports {self.ports.control}-{self.ports.weights}? pick another with --port)") from None
        return sock

    def _start_curve(self) -> tuple[bytes, bytes]:
        directory = Path(self.options.curve_dir)
        keypair = _load_keypair(directory / "learner.key_secret")
        authorized = directory / "authorized"
        if not authorized.is_dir() or not any(authorized.glob("*.key")):
            raise ApexError(f"no authorised actor keys in {authorized}: run `apex keygen {directory}`")
        self._auth = ThreadAuthenticator(self.context)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(authorized))
        return keypair

    def _handle(self, identity: bytes, frames: list) -> None:
        try:
            msg = protocol.decode(frames)
        except ProtocolError as e:
            self.rejected_messages += 1
            version = protocol.peek_version(frames[0]) if frames else None
            if version is not None and version != protocol.PROTOCOL:
                reason = (f"protocol mismatch: actor speaks version {version}, learner {protocol.PROTOCOL}; "
                          "install the same apex version on both sides")
                self._send(identity, "reject", {"reason": reason})
            self._bad_log.warning("rejected control message: %s", e)
            return
        if msg.type == "hello":
            self._hello(identity, msg)
        elif msg.type == "heartbeat":
            record = self.actors.get(identity)
            if self._stopping is not None:
                self._send(identity, "stop", {"reason": self._stopping})
            elif record is None:  # e.g. this learner restarted: the actor must say hello again
                self._send(identity, "reject", {"reason": "unknown actor: say hello again"})
            else:
                record.last_seen = time.monotonic()
                self._send(identity, "heartbeat_ack", {"weights_version": self.weights_version})
        else:
            self.rejected_messages += 1
            self._bad_log.warning("rejected control message of type %r from an actor", msg.type)

    def _hello(self, identity: bytes, msg: Message) -> None:
        if self._stopping is not None:
            self._send(identity, "stop", {"reason": self._stopping})
            return
        requested = msg.fields["actor_index"]
        previous = self.actors.pop(identity, None)
        if requested is None and previous is not None:
            requested = previous.index
        if requested is not None and requested < 0:
            self._send(identity, "reject", {"reason": f"actor index must be >= 0, got {requested}"})
            return
        index = requested if requested is not None else self._free_index()
        try:
            spec = dict(self._welcome(msg, index))
        except Rejected as e:
            self._send(identity, "reject", {"reason": str(e)})
            log.info("rejected actor %s (pid %s): %s", msg.fields["host"], msg.fields["pid"], e)
            return
        for other, record in list(self.actors.items()):
            if record.index == index:  # an actor restarted under the same index replaces the old one
                del self.actors[other]
        self.actors[identity] = ActorRecord(
            index, msg.fields["host"], msg.fields["pid"], msg.fields["num_envs"], time.monotonic()
        )
        self._send(identity, "welcome", {"actor_index": index, "spec": spec})
        if self._weights is not None:
            self.control.send_multipart([identity, *self._weights[1]], copy=False)
        log.info("actor %d joined from %s (pid %d)", index, msg.fields["host"], msg.fields["pid"])

    def _free_index(self) -> int:
        taken = {record.index for record in self.actors.values()}
        index = 0
        while index in taken:
            index += 1
        return index

    def _expire_silent_actors(self) -> None:
        deadline = time.monotonic() - self.options.heartbeat_timeout_s
        for identity, record in list(self.actors.items()):
            if record.last_seen < deadline:
                del self.actors[identity]
                log.info("actor %d (%s) went silent; dropped", record.index, record.host)

    def _send(self, identity: bytes, msg_type: str, fields: Mapping[str, Any]) -> None:
        try:
            self.control.send_multipart([identity, *protocol.encode(msg_type, fields)], flags=zmq.NOBLOCK)
        except zmq.Again:  # the actor's queue is full: it is not reading; heartbeats will tell
            pass


class TrajectoryReceiver:
    """The learner's end of the trajectory stream: decoded batches, bad ones counted."""

    def __init__(self, sock: zmq.Socket, options: TransportOptions) -> None:
        self.socket = sock
        self.options = options
        self.rejected_messages = 0
        self.received_messages = 0
        self.lazy = False  # leave lz4 arrays compressed (protocol.decode(lazy=True))
        self._bad_log = RateLimitedLog(log)

    def recv(self, timeout_ms: int = 0) -> Message | None:
        """The next valid batch, or None when none arrived within ``timeout_ms``.

        A malformed message is counted in ``rejected_messages``, logged, and skipped.
        """
        deadline = None
        while True:
            try:  # the common case under load: a message is already waiting, no poll needed
                frames = self.socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                if deadline is None:
                    deadline = time.monotonic() + timeout_ms / 1000
                remaining = max(0, int((deadline - time.monotonic()) * 1000))
                if not self.socket.poll(remaining):
                    return None
                continue
            try:
                msg = protocol.decode(
                    frames,
                    max_array_bytes=self.options.max_array_bytes,
                    max_message_bytes=self.options.max_message_bytes,
                    lazy=self.lazy,
                )
                if msg.type != "batch":
                    raise ProtocolError(f"a {msg.type!r} message on the trajectory stream")
            except ProtocolError as e:
                self.rejected_messages += 1
                self._bad_log.warning("rejected trajectory message: %s", e)
                continue
            self.received_messages += 1
            try:
                msg.peer = frames[0].get("Peer-Address")  # the sending host's IP (TCP)
            except zmq.ZMQError:
                pass
            return msg


# ---------------------------------------------------------------------------------------
# Actor side


class LearnerClient:
    """An actor's connection to the learner: handshake, batches, weights, heartbeats.

    Call ``tick()`` from the actor loop every few milliseconds or more: it sends heartbeats,
    reads acks, weights and stop orders, and reconnects when the learner has gone quiet.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        actor_index: int | None = None,
        num_envs: int = 1,
        options: TransportOptions = TransportOptions(),
    ) -> None:
        self.ports = Ports.from_base(port)
        self.host = host
        self.options = options
        self.actor_index = actor_index
        self.num_envs = num_envs
        self.welcome: Message | None = None
        self.stop_reason: str | None = None
        self.reconnects = 0
        self.learner_weights_version = -1  # as of the last heartbeat answer
        self._weights: Message | None = None
        self._weights_version = -1
        self._last_heard = time.monotonic()
        self._last_beat = 0.0
        self._bad_log = RateLimitedLog(log)
        self.context = zmq.Context()
        self._curve = self._load_curve() if options.curve_dir else None
        self._routing_id = b"actor-" + os.urandom(8).hex().encode()
        self.control = self._control_socket()
        self.trajectories = self._connect(zmq.PUSH, self.ports.trajectories, sndhwm=options.trajectory_hwm,
                                          buffer_bytes=options.trajectory_buffer_bytes)
        self.weights = self._connect(zmq.SUB, self.ports.weights, conflate=True)

    @property
    def connected(self) -> bool:
        return self.welcome is not None

    def handshake(self, timeout_s: float | None = None) -> Message:
        """Says hello until welcomed; returns the welcome. Retries with backoff until
        ``timeout_s`` (then raises TimeoutError) or, without it, until the learner has been
        silent for ``options.give_up_after_s`` (then raises LearnerGone; 0: forever). A
        reject raises HandshakeRejected with the learner's reason.
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
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        wait = 0.25
        while True:
            self._send_control("hello", {
                "actor_index": self.actor_index,
                "num_envs": self.num_envs,
                "host": pysocket.gethostname(),
                "pid": os.getpid(),
            })
            answer_by = time.monotonic() + wait
            if deadline is not None:
                answer_by = min(answer_by, deadline)
            while time.monotonic() < answer_by:
                if self.control.poll(max(1, int((answer_by - time.monotonic()) * 1000))):
                    msg = self._recv_control()
                    if msg is None:
                        continue
                    if msg.type == "welcome":
                        self.welcome = msg
                        self.actor_index = msg.fields["actor_index"]
                        self._last_heard = time.monotonic()
                        return msg
                    if msg.type == "reject":
                        raise HandshakeRejected(f"learner at {self.host}:{self.ports.control} rejected this actor: {msg.fields['reason']}")
                    if msg.type == "stop":
                        self.stop_reason = msg.fields["reason"]
                        raise HandshakeRejected(f"learner is stopping: {self.stop_reason}")
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no answer from a learner at {self.host}:{self.ports.control} within {timeout_s}s")
            # Lazy pirate: a fresh socket drops the unanswered hello instead of queueing more.
            self.control.close(linger=0)
            self.control = self._control_socket()
            wait = min(wait * 2, 5.0)

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
            elif msg.type == "heartbeat_ack":
                self.learner_weights_version = msg.fields["weights_version"]
            elif msg.type == "weights":
                self._offer_weights(msg)
            elif msg.type == "reject":  # the learner restarted and does not know us
                log.info("learner asks for a new handshake: %s", msg.fields["reason"])
                self._reconnect()
                return
        while self.weights.poll(0):
            frame = self.weights.recv(copy=False)
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
        """Sends one batch; while the learner's queue is full, waits (ticking).

        Returns False if ``timeout_s`` passed or a stop arrived before it could be sent.
        """
        frames = protocol.encode(
            "batch",
            {"actor_index": self.actor_index if self.actor_index is not None else -1,
             "weights_version": int(weights_version), "info": dict(info or {})},
            arrays,
        )
        return self.send_frames(frames, timeout_s=timeout_s)

    def send_frames(self, frames: list[bytes], *, timeout_s: float | None = None) -> bool:
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
            self.trajectories.poll(50, zmq.POLLOUT)
            self.tick()
        return False

    def close(self) -> None:
        for sock in (self.control, self.trajectories, self.weights):
            sock.close(linger=0)
        self.context.term()

    # -- internals

    def _load_curve(self) -> tuple[bytes, bytes, bytes]:
        directory = Path(self.options.curve_dir)
        public, secret = _load_keypair(directory / "actor.key_secret")
        return public, secret, _load_public(directory / "learner.key")

    def _connect(self, kind: int, port: int, *, sndhwm: int = 0, conflate: bool = False,
                 buffer_bytes: int = 0, routing_id: bytes | None = None) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if buffer_bytes:
            sock.setsockopt(zmq.SNDBUF, buffer_bytes)
        if sndhwm:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
        if conflate:
            sock.setsockopt(zmq.CONFLATE, 1)  # hold only the newest message
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        if self._curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._curve
        sock.connect(f"tcp://{self.host}:{port}")
        return sock

    def _control_socket(self) -> zmq.Socket:
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
        if msg.type != "weights":
            return
        version = msg.fields["version"]
        if version > self._weights_version:  # never go back to older weights
            self._weights_version = version
            self._weights = msg


class RateLimitedLog:
    """Logs at most one warning a second, with a count of those it held back."""

    def __init__(self, logger: logging.Logger, interval_s: float = 1.0) -> None:
        self._logger = logger
        self._interval = interval_s
        self._next = 0.0
        self._suppressed = 0

    def warning(self, fmt: str, *args: Any) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        if self._suppressed:
            fmt += f" (and {self._suppressed} more since the last report)"
        self._logger.warning(fmt, *args)
        self._next = now + self._interval
        self._suppressed = 0
