"""ZeroMQ transport between one learner and any number of actors.

The learner binds three sockets on consecutive ports; actors connect to them:

    port P     control       ROUTER <- DEALER   hello/welcome/reject, heartbeats, stop
    port P+1   trajectories  PULL   <- PUSH     batches; a high-water mark makes a slow
                                                learner push back on its actors
    port P+2   weights       ROUTER -> DEALER   newest weights only, to the actors that
                                                registered their session here (CONFLATE on
                                                the actor, a send queue of one per actor)

An actor says hello and gets a welcome with the run's spec, its actor index, a random
session token and the learner's incarnation id (or a reject with a reason), then the current
weights at once over the control channel, then newer ones as they are published. Every batch
carries the session token and a sequence number: the learner accepts batches only from a live
session, in order, each once. Both sides send heartbeats; an actor that stops hearing
from the learner drops its control socket and says hello again until a learner answers
(the lazy-pirate pattern), so a restarted learner gets its actors back by itself.

Optional CURVE (``apex keygen DIR``): every socket is encrypted and the learner accepts only
the actor public keys in ``DIR/authorized/``.

The learner's receiving side assumes an attacker: ZMQ_MAXMSGSIZE on every receiving socket,
at most ``MAX_CONTROL_PER_POLL`` control messages handled per loop iteration, hello rate
limits per connection and per peer address, bounded hello fields, an actor index that a
live actor keeps, and a weights socket that keeps state only for live sessions (PUB, and
XPUB even with manual subscriptions, keep every topic a subscriber sends: measured, 20 MiB
of random 1 KiB subscriptions grew the learner by 48 MB for good).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import shutil
import socket as pysocket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from apex import protocol
from apex.errors import ApexError, ProtocolError, RejectedMessage
from apex.logs import RateLimitedLog
from apex.protocol import Message

log = logging.getLogger(__name__)

DEFAULT_PORT = 5550
MAX_CONTROL_PER_POLL = 32  # control messages handled per loop iteration: the train loop goes on under a flood
MAX_ACTOR_INDEX = 65_536
MAX_HOST_CHARS = 255
HELLO_RATE_PER_S = 20.0  # hellos a connection may send a second (a burst of HELLO_BURST first)
HELLO_BURST = 40
HELLO_ADDRESS_FACTOR = 16  # an address's hellos: as many as this many connections may send
MAX_TRACKED_PEERS = 4096  # hello rate buckets kept (least recently seen dropped first)
TOKEN_BYTES = 16
AUTO_ID_PREFIX = b"\x00"  # routing ids that a ROUTER makes up start with a zero byte
MAX_ENVS_PER_ACTOR = 4096
CONTROL_HWM = 100  # control messages queued per peer before ZeroMQ stops reading its connection
WEIGHTS_PORT_MAX_BYTES = 512  # a registration (a session token), or a CURVE handshake command
ACTOR_MAX_MESSAGE_BYTES = protocol.DEFAULT_MAX_MESSAGE_BYTES  # what an actor accepts from its learner
POLL_SLICE_S = 0.1  # longest an actor waits without looking at should_stop
WAITING_LOG_S = 10.0
BACKOFF_FIRST_S = 0.25  # hello retries wait this long at first, doubling up to BACKOFF_MAX_S
BACKOFF_MAX_S = 5.0


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address to bind or serve on) stays on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    max_message_bytes: int = 64 * 1024 * 1024
    """Largest trajectory message the learner accepts (every array and frame of it too);
    also ZMQ_MAXMSGSIZE on its trajectory socket."""
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
        max_message_bytes=transport.max_message_bytes,
    )


class LearnerGone(ApexError):
    """No learner answered for ``give_up_after_s``: it stopped for good, or never came."""


class HandshakeRejected(ApexError):
    """The learner refused this actor; the message gives its reason."""


class Rejected(Exception):
    """Raised by a learner's welcome callback to turn an actor away with a reason."""


class Stopped(ApexError):
    """The actor process was told to stop (a signal) while waiting for the learner."""


# ---------------------------------------------------------------------------------------
# CURVE keys


KEY_PAIRS = ("learner", "actor", "serve", "client")


def generate_keys(directory: str | os.PathLike) -> dict[str, Path]:
    """Writes the key pairs of the learner and its actors, and of `apex serve`'s ZeroMQ
    frontend and its clients, and authorises the actor's and the client's public keys.

    Layout: learner.key / learner.key_secret, actor.key / actor.key_secret, authorized/actor.key;
    serve.key / serve.key_secret, client.key / client.key_secret, serve-clients/client.key.
    Actor hosts need actor.key_secret and learner.key; `apex serve` hosts those two and
    serve.key_secret with serve-clients/; client hosts client.key_secret and serve.key.
    """
    directory = Path(directory)
    authorized = directory / "authorized"
    clients = directory / "serve-clients"
    for name in KEY_PAIRS:
        if (directory / f"{name}.key_secret").exists():
            raise ApexError(f"{directory / (name + '.key_secret')} exists: choose an empty directory")
    # Created under umask 077: a secret key is never readable by others, not even for a moment.
    with _umask(0o077):
        authorized.mkdir(parents=True, exist_ok=True)
        clients.mkdir(parents=True, exist_ok=True)
        for name in KEY_PAIRS:
            zmq.auth.create_certificates(str(directory), name)
        shutil.copy(directory / "actor.key", authorized / "actor.key")
        shutil.copy(directory / "client.key", clients / "client.key")
    for public in [*directory.glob("*.key"), authorized / "actor.key", clients / "client.key"]:
        public.chmod(0o644)  # public keys are meant to be copied around
    return {
        "learner_secret": directory / "learner.key_secret",
        "learner_public": directory / "learner.key",
        "actor_secret": directory / "actor.key_secret",
        "actor_public": directory / "actor.key",
        "authorized": authorized,
        "serve_secret": directory / "serve.key_secret",
        "serve_public": directory / "serve.key",
        "client_secret": directory / "client.key_secret",
        "serve_clients": clients,
    }


def load_keypair(path: Path) -> tuple[bytes, bytes]:
    """(public, secret) of a .key_secret file; ApexError naming `apex keygen` if absent."""
    return _load_keypair(path)


def load_public(path: Path) -> bytes:
    if not path.exists():
        raise ApexError(f"CURVE key {path} not found: copy it from the directory `apex keygen` made")
    public, _ = zmq.auth.load_certificate(str(path))
    return public


@contextlib.contextmanager
def _umask(mask: int) -> Iterator[None]:
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


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


class RejectCounter:
    """Refused messages by reason (the keys of ``rejected_by_reason``), counted from any thread."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, reason: str) -> None:
        with self._lock:
            self._counts[reason] += 1

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(sorted(self._counts.items()))


@dataclass
class Session:
    """A welcomed actor: who it is, and what it has sent (its batches must carry ``token``
    and ever-growing sequence numbers)."""

    index: int
    identity: bytes
    token: bytes
    host: str
    pid: int
    num_envs: int
    last_seen: float
    last_seq: int = -1
    weights_identity: bytes | None = None  # its socket on the weights port, once it registered
    env_steps: int = 0  # derived from its batches, never from what it says
    episodes: int = 0
    step_budget: int = 0  # env steps its episode records may still claim (apex.schema.check_episodes)
    limits: dict[str, int] = field(default_factory=dict)  # batch sizes allowed (set by the learner)


class Sessions:
    """The live sessions, by routing identity and by token. The control loop opens and
    closes them; the ingest thread checks each batch against them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_identity: dict[bytes, Session] = {}
        self._by_token: dict[bytes, Session] = {}

    def __len__(self) -> int:
        return len(self._by_identity)

    def __iter__(self) -> Iterator[Session]:
        with self._lock:
            return iter(list(self._by_identity.values()))

    def get(self, identity: bytes) -> Session | None:
        return self._by_identity.get(identity)

    def by_token(self, token: bytes) -> Session | None:
        return self._by_token.get(token)

    def holding(self, index: int) -> Session | None:
        """The session that holds actor index ``index``, if any."""
        return next((s for s in self if s.index == index), None)

    def open(self, session: Session) -> None:
        with self._lock:
            self._by_identity[session.identity] = session
            self._by_token[session.token] = session

    def close(self, session: Session) -> None:
        with self._lock:
            self._by_identity.pop(session.identity, None)
            self._by_token.pop(session.token, None)

    def check_batch(self, fields: Mapping[str, Any]) -> Session:
        """The session a batch belongs to; raises RejectedMessage for a batch without a live
        session, from another actor's index, or repeated (a sequence number not above the
        last one accepted)."""
        with self._lock:
            session = self._by_token.get(fields["session"])
            if session is None:
                raise RejectedMessage("no_session", "a batch without a live session: the actor must say hello first")
            if fields["actor_index"] != session.index:
                raise RejectedMessage("wrong_actor", f"a batch of actor {fields['actor_index']} in the session of actor {session.index}")
            if fields["seq"] <= session.last_seq:
                raise RejectedMessage("replayed", f"batch {fields['seq']} of actor {session.index} again "
                                      f"(last accepted: {session.last_seq})")
            session.last_seq = fields["seq"]
            return session


class TokenBuckets:
    """A token bucket per key: events beyond ``rate`` a second (after a burst) are refused.
    Buckets of the least recently seen keys are forgotten first, so the table stays small."""

    def __init__(self, rate: float, burst: float, keys: int = MAX_TRACKED_PEERS) -> None:
        self.rate, self.burst, self.keys = rate, float(burst), keys
        self._buckets: OrderedDict[Any, tuple[float, float]] = OrderedDict()  # key -> (tokens, time)

    def allow(self, key: Any, now: float) -> bool:
        tokens, then = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - then) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._buckets) > self.keys:
            self._buckets.popitem(last=False)
        return allowed


class HelloLimiter:
    """Hellos per connection (routing id) and per peer address: one flooding connection
    cannot starve the other actors of its host, and many connections from one address
    together get a bounded share (HELLO_ADDRESS_FACTOR connections' worth)."""

    def __init__(self, rate: float = HELLO_RATE_PER_S, burst: int = HELLO_BURST) -> None:
        self._per_connection = TokenBuckets(rate, burst)
        self._per_address = TokenBuckets(rate * HELLO_ADDRESS_FACTOR, burst * HELLO_ADDRESS_FACTOR)

    def allow(self, address: str, identity: bytes, now: float) -> bool:
        return self._per_connection.allow((address, identity), now) and self._per_address.allow(address, now)


def _peer_address(frame: Any) -> str:
    try:
        return frame.get("Peer-Address")  # the sending host's IP (TCP)
    except (zmq.ZMQError, AttributeError):
        return "unknown"


class LearnerEndpoint:
    """The learner's control channel and weight publisher, plus its trajectory receiver.

    ``poll``, ``publish_weights`` and ``stop_actors`` belong to one thread (the learner's
    main loop); ``receiver`` is handed to the ingest thread, which is its only user.
    ``welcome`` is called for each hello with the message and the actor index to be
    assigned; it returns the spec sent back, or raises ``Rejected(reason)``.

    Weights go out over a ROUTER socket to the actors that registered their session on it,
    rather than over PUB/SUB: a PUB socket keeps every topic a subscriber sends, so any
    peer could grow the learner's memory at will.
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
        self.sessions = Sessions()
        self.rejected = RejectCounter()
        self.incarnation = os.urandom(8)  # tells actors that this is a new learner, whatever its versions
        self._stopping: str | None = None
        self._weights: tuple[int, list[bytes], bytes] | None = None  # version, frames, packed
        self._hellos = HelloLimiter()
        self._bad_log = RateLimitedLog(log)
        self._idle_poller: tuple[int | None, zmq.Poller] | None = None  # wait()'s, with the fd it watches
        try:
            curve = self._start_curve() if options.curve_dir else None
            # Control messages carry no arrays: a header's worth is the most a frame may hold.
            self.control = self._bind(zmq.ROUTER, host, self.ports.control, curve,
                                      max_message_bytes=protocol.MAX_HEADER_BYTES, rcvhwm=CONTROL_HWM)
            # An actor keeps its routing id across the fresh sockets it opens while retrying
            # (lazy pirate); the newest connection takes that id over, so its hellos are known
            # as one actor's, with one index, instead of leaving ghosts behind.
            self.control.setsockopt(zmq.ROUTER_HANDOVER, 1)
            # Registrations are a session token; room for the CURVE handshake's commands.
            self._weights_socket = self._bind(zmq.ROUTER, host, self.ports.weights, curve, sndhwm=1,
                                              max_message_bytes=WEIGHTS_PORT_MAX_BYTES, rcvhwm=CONTROL_HWM)
            self._weights_socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone actor raises, never blocks
            pull = self._bind(zmq.PULL, host, self.ports.trajectories, curve, rcvhwm=options.trajectory_hwm,
                              buffer_bytes=options.trajectory_buffer_bytes,
                              max_message_bytes=options.max_message_bytes + protocol.MAX_HEADER_BYTES)
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
        frames = protocol.encode("weights", {"version": int(version), "incarnation": self.incarnation},
                                 arrays, compress=False)
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
              buffer_bytes: int = 0, max_message_bytes: int = 0) -> zmq.Socket:
        sock = self.context.socket(kind)
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

    def _reject(self, reason: str, fmt: str, *args: Any) -> None:
        self.rejected.add(reason)
        self._bad_log.warning(fmt, *args)

    def _handle(self, frames: list) -> None:
        identity = frames[0].bytes
        try:
            # Actors send no arrays here: a message declaring any is refused before it is read.
            msg = protocol.decode(frames[1:], max_array_bytes=0, max_message_bytes=0)
        except ProtocolError as e:
            version = protocol.peek_version(frames[1]) if len(frames) > 1 else None
            if version is not None and version != protocol.PROTOCOL:
                reason = (f"protocol mismatch: actor speaks version {version}, learner {protocol.PROTOCOL}; "
                          "install the same apex version on both sides")
                self._send(identity, "reject", {"reason": reason, "retry": False})
            self._reject("malformed", "rejected control message: %s", e)
            return
        if msg.type == "hello" and identity.startswith(AUTO_ID_PREFIX):
            # A connection without a routing id of its own: an actor's superseded socket
            # (ROUTER_HANDOVER renames it while its queued hellos drain), or not an apex
            # actor (they always set one). A welcome could not reach it: nothing to do.
            return
        if msg.type == "hello":
            address = _peer_address(frames[0])
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
        fields = msg.fields
        problem = _hello_problem(fields)
        if problem is not None:
            self.rejected.add("hello_fields")
            self._send(identity, "reject", {"reason": problem, "retry": False})
            return
        previous = self.sessions.get(identity)
        requested = fields["actor_index"]
        if requested is None and previous is not None:
            requested = previous.index
        index = requested if requested is not None else self._free_index()
        holder = self.sessions.holding(index)
        if holder is not None and holder.identity != identity:
            # A live actor keeps its index: a restarted one takes it back once the old one
            # has gone silent (heartbeat timeout); a peer cannot take it over by saying hello.
            self._send(identity, "reject", {"retry": True, "reason": (
                f"actor index {index} is held by a live actor ({holder.host}, pid {holder.pid}); "
                f"retrying until it has been silent for {self.options.heartbeat_timeout_s:g}s")})
            return
        try:
            spec = dict(self._welcome(msg, index))
        except Rejected as e:
            self._send(identity, "reject", {"reason": str(e), "retry": False})
            log.info("rejected actor %s (pid %s): %s", fields["host"], fields["pid"], e)
            return
        if previous is not None and previous.index == index:
            session = previous  # the same actor again (a retry): same session, same sequence
            session.last_seen = time.monotonic()
        else:
            if previous is not None:
                self.sessions.close(previous)
            session = Session(index, identity, os.urandom(TOKEN_BYTES), fields["host"], fields["pid"],
                              spec.get("num_envs", fields["num_envs"]), time.monotonic())
            self.sessions.open(session)
        if not self._send(identity, "welcome", {"actor_index": index, "spec": spec, "session": session.token,
                                                "incarnation": self.incarnation}):
            self.sessions.close(session)
            return
        if self._weights is not None:
            with contextlib.suppress(zmq.Again):  # it is not reading: the weights port will do
                self.control.send_multipart([identity, *self._weights[1]], copy=False, flags=zmq.NOBLOCK)
        if previous is None or previous.index != index:
            log.info("actor %d joined from %s (pid %d)", index, fields["host"], fields["pid"])

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

    def _free_index(self) -> int:
        taken = {session.index for session in self.sessions}
        index = 0
        while index in taken:
            index += 1
        return index

    def _expire_silent_actors(self) -> None:
        deadline = time.monotonic() - self.options.heartbeat_timeout_s
        for session in self.sessions:
            if session.last_seen < deadline:
                self.sessions.close(session)
                log.info("actor %d (%s) went silent; dropped (its session sent %d env steps, %d episodes)",
                         session.index, session.host, session.env_steps, session.episodes)

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


def _hello_problem(fields: Mapping[str, Any]) -> str | None:
    """What is wrong with a hello's fields, or None."""
    index = fields["actor_index"]
    if index is not None and not 0 <= index < MAX_ACTOR_INDEX:
        return f"actor index must be in 0..{MAX_ACTOR_INDEX - 1}, got {index}"
    if not 0 <= fields["num_envs"] <= MAX_ENVS_PER_ACTOR:
        return f"num_envs must be in 1..{MAX_ENVS_PER_ACTOR} (0: the learner's actor.num_envs), got {fields['num_envs']}"
    if len(fields["host"]) > MAX_HOST_CHARS or not 0 <= fields["pid"] < 2**32:
        return f"host must be at most {MAX_HOST_CHARS} characters and pid in 0..2**32-1"
    return None


class TrajectoryReceiver:
    """The learner's end of the trajectory stream: decoded batches of live sessions; every
    other message is counted by reason, logged and skipped."""

    def __init__(self, sock: zmq.Socket, options: TransportOptions, sessions: Sessions, rejected: RejectCounter) -> None:
        self.socket = sock
        self.options = options
        self.sessions = sessions
        self.rejected = rejected
        self.lazy = False  # leave lz4 arrays compressed (protocol.decode(lazy=True))
        self._bad_log = RateLimitedLog(log)

    def recv(self, timeout_ms: int = 0) -> Message | None:
        """The next batch of a live session (``msg.session``), or None when none arrived
        within ``timeout_ms``."""
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
                    max_array_bytes=self.options.max_message_bytes,
                    max_message_bytes=self.options.max_message_bytes,
                    lazy=self.lazy,
                )
                if msg.type != "batch":
                    raise RejectedMessage("unexpected_type", f"a {msg.type!r} message on the trajectory stream")
                msg.session = self.sessions.check_batch(msg.fields)
            except ProtocolError as e:
                self.reject(e)
                continue
            msg.peer = _peer_address(frames[0])
            return msg

    def reject(self, error: ProtocolError) -> None:
        """Counts and logs a refused batch."""
        self.rejected.add(getattr(error, "reason", "malformed"))
        self._bad_log.warning("rejected trajectory message: %s", error)


# ---------------------------------------------------------------------------------------
# Actor side


class LearnerClient:
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
        options: TransportOptions = TransportOptions(),
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
        self._curve = self._load_curve() if options.curve_dir else None
        self._routing_id = b"actor-" + os.urandom(8).hex().encode()
        self.control = self._control_socket()
        self.trajectories = self._connect(zmq.PUSH, self.ports.trajectories, sndhwm=options.trajectory_hwm,
                                          buffer_bytes=options.trajectory_buffer_bytes)
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
            self._send_control("hello", {
                "actor_index": self.actor_index,
                "num_envs": self.num_envs,
                "host": pysocket.gethostname()[:MAX_HOST_CHARS],
                "pid": os.getpid(),
            })
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
                    self._welcomed(msg)
                    return msg
                if msg.type == "reject" and msg.fields["retry"]:
                    if not retry_logged:
                        log.info("learner asks to retry: %s", msg.fields["reason"])
                        retry_logged = True
                    answer_by = min(answer_by, time.monotonic() + wait)
                    break
                if msg.type == "reject":
                    raise HandshakeRejected(f"learner at {self.host}:{self.ports.control} rejected this actor: {msg.fields['reason']}")
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
            {"actor_index": self.actor_index, "weights_version": int(weights_version), "info": dict(info or {}),
             "session": self._session, "seq": self._seq},
            arrays,
        )
        self._seq += 1
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

    def _welcomed(self, msg: Message) -> None:
        self.welcome = msg
        self.actor_index = msg.fields["actor_index"]
        self._session = msg.fields["session"]
        self._last_heard = time.monotonic()
        if msg.fields["incarnation"] != self._incarnation:
            # A new learner (restarted, perhaps from an older checkpoint): its weights count
            # whatever their version, or the actor would ignore them for good.
            self._incarnation = msg.fields["incarnation"]
            self._weights_version = -1
        # Weights come on their own port to the sessions registered there.
        with contextlib.suppress(zmq.Again):
            self.weights_socket.send(self._session, flags=zmq.NOBLOCK)

    def _sleep_until(self, until: float) -> None:
        """Waits (for a retry) in slices, honouring should_stop."""
        while (left := until - time.monotonic()) > 0:
            if self.should_stop():
                raise Stopped("told to stop while waiting for the learner")
            time.sleep(min(left, POLL_SLICE_S))

    def _load_curve(self) -> tuple[bytes, bytes, bytes]:
        directory = Path(self.options.curve_dir)
        public, secret = _load_keypair(directory / "actor.key_secret")
        return public, secret, _load_public(directory / "learner.key")

    def _connect(self, kind: int, port: int, *, sndhwm: int = 0, conflate: bool = False,
                 buffer_bytes: int = 0, routing_id: bytes | None = None) -> zmq.Socket:
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
        if msg.type != "weights" or msg.fields["incarnation"] != self._incarnation:
            return  # not weights, or a previous learner's
        version = msg.fields["version"]
        if version > self._weights_version:  # never go back to older weights of this learner
            self._weights_version = version
            self._weights = msg
