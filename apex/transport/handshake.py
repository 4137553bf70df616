"""What the learner answers an actor's hello: a welcome with a session, or a reject.

The checks of a hello's fields, the actor index it gets (the one it asks for, the one its
live session holds, or the lowest free one), the rank its batches go to, and the session it
opens. No sockets here: ``LearnerEndpoint`` sends the answer and closes the session when
the welcome cannot be sent.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from apex.config import MAX_ENVS_PER_ACTOR
from apex.transport.errors import Rejected
from apex.transport.ports import MAX_HOST_CHARS
from apex.transport.sessions import RejectCounter, Session, Sessions, SessionSigner
from apex.wire.protocol import Message

log = logging.getLogger("apex.transport")

MAX_ACTOR_INDEX = 65_536
TOKEN_BYTES = 16


@dataclass(frozen=True)
class Refusal:
    """A hello refused: the reject message's fields."""

    reason: str
    retry: bool


@dataclass(frozen=True)
class Admission:
    """A hello admitted: its session and the welcome's setup."""

    session: Session
    setup: dict[str, Any]
    joined: bool  # a new session, not the same actor's live one again (a retry)


class Handshake:
    """Answers hellos for one learner endpoint, opening sessions in ``sessions``.

    ``setup_for`` is called with the hello and the actor index to be assigned; it returns
    the actor's setup or raises ``Rejected(reason)``. In a learner group ``signer`` issues
    tokens that every rank can check, and ``routes`` holds each rank's ``trajectories`` for
    the welcome (None for rank 0, whose port the actor already knows)."""

    def __init__(
        self,
        sessions: Sessions,
        rejected: RejectCounter,
        setup_for: Callable[[Message, int], Mapping[str, Any]],
        heartbeat_timeout_s: float,
        signer: SessionSigner | None,
        routes: Sequence[Mapping[str, Any] | None],
    ) -> None:
        self.sessions = sessions
        self.rejected = rejected
        self.setup_for = setup_for
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.signer = signer
        self.routes = routes

    def answer(self, identity: bytes, msg: Message) -> Admission | Refusal:
        fields = msg.fields
        problem = hello_problem(fields)
        if problem is not None:
            self.rejected.add("hello_fields")
            return Refusal(problem, retry=False)
        previous = self.sessions.get(identity)
        requested = fields["actor_index"]
        if requested is None and previous is not None:
            requested = previous.index
        index = requested if requested is not None else self._free_index()
        holder = self.sessions.holding(index)
        if holder is not None and holder.identity != identity:
            # A live actor keeps its index: a restarted one takes it back once the old one
            # has gone silent (heartbeat timeout); a peer cannot take it over by saying hello.
            return Refusal(
                f"actor index {index} is held by a live actor ({holder.host}, pid {holder.pid}); "
                f"retrying until it has been silent for {self.heartbeat_timeout_s:g}s",
                retry=True,
            )
        try:
            setup = dict(self.setup_for(msg, index))
        except Rejected as e:
            log.info("rejected actor %s (pid %s): %s", fields["host"], fields["pid"], e)
            return Refusal(str(e), retry=False)
        if previous is not None and previous.index == index:
            # the same actor again (a retry): same session, same sequence, same rank
            session, joined = previous, False
            session.last_seen = time.monotonic()
        else:
            if previous is not None:
                self.sessions.close(previous)
            session, joined = self._open(identity, index, fields, setup.get("num_envs", fields["num_envs"])), True
        route = self.routes[session.rank]
        if route is not None:  # its batches go to another rank of the group
            setup["trajectories"] = dict(route)
        return Admission(session, setup, joined)

    def _open(self, identity: bytes, index: int, fields: Mapping[str, Any], num_envs: int) -> Session:
        rank = self._least_loaded_rank()
        token = os.urandom(TOKEN_BYTES) if self.signer is None else self.signer.token(index, num_envs, rank)
        session = Session(index, identity, token, fields["host"], fields["pid"], num_envs, time.monotonic(), rank=rank)
        self.sessions.open(session)
        return session

    def _least_loaded_rank(self) -> int:
        """The rank a new session's batches go to: the one with the fewest live sessions (a
        silent one's place comes back when it expires)."""
        counts = self.sessions.per_rank(len(self.routes))
        return counts.index(min(counts))

    def _free_index(self) -> int:
        taken = {session.index for session in self.sessions}
        index = 0
        while index in taken:
            index += 1
        return index


def hello_problem(fields: Mapping[str, Any]) -> str | None:
    """What is wrong with a hello's fields, or None."""
    index = fields["actor_index"]
    if index is not None and not 0 <= index < MAX_ACTOR_INDEX:
        return f"actor index must be in 0..{MAX_ACTOR_INDEX - 1}, got {index}"
    if not 0 <= fields["num_envs"] <= MAX_ENVS_PER_ACTOR:
        return (
            f"num_envs must be in 1..{MAX_ENVS_PER_ACTOR} (0: the learner's actor.num_envs), got {fields['num_envs']}"
        )
    if len(fields["host"]) > MAX_HOST_CHARS or not 0 <= fields["pid"] < 2**32:
        return f"host must be at most {MAX_HOST_CHARS} characters and pid in 0..2**32-1"
    return None
