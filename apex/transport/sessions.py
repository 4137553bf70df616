"""The learner's bookkeeping of its actors: sessions, rejection counts, hello rate limits."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from apex.errors import RejectedMessage

HELLO_RATE_PER_S = 20.0  # hellos a connection may send a second (a burst of HELLO_BURST first)
HELLO_BURST = 40
HELLO_ADDRESS_FACTOR = 16  # an address's hellos: as many as this many connections may send
MAX_TRACKED_PEERS = 4096  # hello rate buckets kept (least recently seen dropped first)


class RejectCounter:
    """Refused messages by reason (the keys of ``rejected_by_reason``), counted from any thread."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, reason: str, count: int = 1) -> None:
        with self._lock:
            self._counts[reason] += count

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
    step_budget: int = 0  # env steps its episode records may still claim (apex.wire.schema.check_episodes)
    step_budget_set: bool = False  # (by the learner, at its first batch)
    # batch sizes allowed, by policy (set by the learner; a single-agent run's under None)
    limits: dict[str | None, dict[str, int]] = field(default_factory=dict)
    rank: int = 0  # of the learner group: the one rank its batches go to (rank 0 chose it)


class BatchSessions(Protocol):
    """What the trajectory receiver checks each batch against: rank 0's ``Sessions``, or a
    follower rank's ``SignedSessions``."""

    def check_batch(self, fields: Mapping[str, Any]) -> Session: ...


class Sessions:
    """The live sessions, by routing identity and by token. The control loop opens and
    closes them; the ingest thread checks each batch against them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_identity: dict[bytes, Session] = {}
        self._by_token: dict[bytes, Session] = {}
        self._closed: list[bytes] = []  # tokens closed since ``take_closed`` (for a group's other ranks)

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
            if self._by_token.pop(session.token, None) is not None:
                self._closed.append(session.token)
                del self._closed[: -SignedSessions.MAX_CLOSED]

    def take_closed(self) -> list[bytes]:
        """The tokens closed since the last call."""
        with self._lock:
            closed, self._closed = self._closed, []
            return closed

    def per_rank(self, ranks: int) -> list[int]:
        """Live sessions routed to each of ``ranks`` ranks."""
        counts = [0] * ranks
        for session in self:
            counts[session.rank] += 1
        return counts

    def check_batch(self, fields: Mapping[str, Any]) -> Session:
        """The session a batch belongs to; raises RejectedMessage for a batch without a live
        session, of a session routed to another rank of the group (its batches are counted
        there), from another actor's index, or repeated (a sequence number not above the last
        one accepted)."""
        with self._lock:
            session = self._by_token.get(fields["session"])
            if session is None:
                raise RejectedMessage("no_session", "a batch without a live session: the actor must say hello first")
            if session.rank != 0:
                raise RejectedMessage(
                    "wrong_rank",
                    f"a batch of actor {session.index}, whose batches go to rank {session.rank}, sent to rank 0",
                )
            if fields["actor_index"] != session.index:
                raise RejectedMessage(
                    "wrong_actor", f"a batch of actor {fields['actor_index']} in the session of actor {session.index}"
                )
            if fields["seq"] <= session.last_seq:
                raise RejectedMessage(
                    "replayed",
                    f"batch {fields['seq']} of actor {session.index} again (last accepted: {session.last_seq})",
                )
            session.last_seq = fields["seq"]
            return session


class SessionSigner:
    """Session tokens that every rank of a learner group can check without a shared table:
    a nonce, the actor's index, environment count and rank (where its batches go), and an
    HMAC of them under the group's secret (shared when the group forms). Rank 0 issues them at
    the welcome; the rank an actor sends its batches to verifies them (``SignedSessions``),
    and every other rank refuses them."""

    _FIELDS = struct.Struct("<8sIII")  # nonce, actor index, num_envs, rank
    MAC_BYTES = 16
    TOKEN_BYTES = _FIELDS.size + MAC_BYTES

    def __init__(self, secret: bytes) -> None:
        if len(secret) < 16:
            raise ValueError("a session secret needs at least 16 bytes")
        self._secret = secret

    def _mac(self, fields: bytes) -> bytes:
        return hmac.new(self._secret, fields, hashlib.sha256).digest()[: self.MAC_BYTES]

    def token(self, index: int, num_envs: int, rank: int) -> bytes:
        fields = self._FIELDS.pack(os.urandom(8), index, num_envs, rank)
        return fields + self._mac(fields)

    def verify(self, token: bytes) -> tuple[int, int, int] | None:
        """(actor index, num_envs, rank) of a token this group issued, else None."""
        if not isinstance(token, bytes) or len(token) != self.TOKEN_BYTES:
            return None
        fields, mac = token[: self._FIELDS.size], token[self._FIELDS.size :]
        if not hmac.compare_digest(mac, self._mac(fields)):
            return None
        _, index, num_envs, rank = self._FIELDS.unpack(fields)
        return index, num_envs, rank


class SignedSessions:
    """A follower rank's sessions: a token the group issued for this rank is good (checked by
    its HMAC, which covers the rank), its session is made on the first batch; rank 0 tells
    which it closed (``close_tokens``), and those stay refused. Batches must carry
    ever-growing sequence numbers, as on rank 0."""

    MAX_CLOSED = 65_536  # closed tokens remembered (the oldest forgotten first)

    def __init__(self, signer: SessionSigner, rank: int) -> None:
        self._signer = signer
        self.rank = rank
        self._lock = threading.Lock()
        self._by_token: dict[bytes, Session] = {}
        self._closed: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_token)

    def close_tokens(self, tokens: list[bytes]) -> None:
        with self._lock:
            for token in tokens:
                self._by_token.pop(token, None)
                self._closed[token] = None
            while len(self._closed) > self.MAX_CLOSED:
                self._closed.popitem(last=False)

    def check_batch(self, fields: Mapping[str, Any]) -> Session:
        token = fields["session"]
        with self._lock:
            session = self._by_token.get(token)
            if session is None:
                issued = None if token in self._closed else self._signer.verify(token)
                if issued is None:
                    raise RejectedMessage(
                        "no_session", "a batch without a live session: the actor must say hello first"
                    )
                index, num_envs, rank = issued
                if rank != self.rank:  # e.g. a batch another rank accepted, sent here again
                    raise RejectedMessage(
                        "wrong_rank",
                        f"a batch of actor {index}, whose batches go to rank {rank}, sent to rank {self.rank}",
                    )
                session = Session(index, b"", token, "", 0, num_envs, last_seen=time.monotonic(), rank=rank)
                self._by_token[token] = session
            if fields["actor_index"] != session.index:
                raise RejectedMessage(
                    "wrong_actor", f"a batch of actor {fields['actor_index']} in the session of actor {session.index}"
                )
            if fields["seq"] <= session.last_seq:
                raise RejectedMessage(
                    "replayed",
                    f"batch {fields['seq']} of actor {session.index} again (last accepted: {session.last_seq})",
                )
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


def peer_address(frame: Any) -> str:
    try:
        address: str = frame.get("Peer-Address")  # the sending host's IP (TCP)
        return address
    except (zmq.ZMQError, AttributeError):
        return "unknown"
