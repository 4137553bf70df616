"""TrajectoryReceiver: the learner's end of the trajectory stream."""

from __future__ import annotations

import logging
import time

import zmq

from apex.config import TransportConfig
from apex.errors import ProtocolError, RejectedMessage
from apex.system.logs import RateLimitedLog
from apex.transport.sessions import BatchSessions, RejectCounter, peer_address
from apex.wire import protocol
from apex.wire.protocol import Message

log = logging.getLogger("apex.transport")


class TrajectoryReceiver:
    """The learner's end of the trajectory stream: decoded batches of live sessions; every
    other message is counted by reason, logged and skipped."""

    def __init__(
        self, sock: zmq.Socket[bytes], options: TransportConfig, sessions: BatchSessions, rejected: RejectCounter
    ) -> None:
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
            msg.peer = peer_address(frames[0])
            return msg

    def reject(self, error: ProtocolError) -> None:
        """Counts and logs a refused batch."""
        self.rejected.add(getattr(error, "reason", "malformed"))
        self._bad_log.warning("rejected trajectory message: %s", error)
