"""What HTTP clients may hold of `apex serve`, all of them together (the serve section of the
config): connections open at once (serve.max_connections: one more closes the connection that
has been idle longest, one with no request being handled; only when every one is busy is it
answered 503 at accept and closed), the request bytes being read (serve.max_body_bytes_in_flight, reserved by
Content-Length before a body is read: 503 when spent), and time (serve.idle_timeout_s: a
connection that sends no whole request head within it is closed, as is one whose body takes
longer). Each refusal and closed connection is counted in rejected_by_reason and logged,
rate-limited.

Closing the idlest connection rather than refusing the newest is what keeps a flood of idle
connections from starving clients that send requests: the flood's connections, which never
start one, are always the idlest. A keep-alive connection closed between requests is opened
again by the client (apex.client does so once, as HTTP clients do).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import OrderedDict
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from apex.serve.request_checks import RequestError

if TYPE_CHECKING:
    from apex.serve.server import Server

# What the kernel and aiohttp take in from a connection before a handler has looked at its
# request: the first reads of hundreds of connections land in one turn of the loop, before
# any of their handlers runs, each as much as the kernel holds (with its own autotuned
# buffers, a client's whole body: 300 bodies of 200 kB grew the server by 70 MiB). Small
# buffers keep that in kilobytes. A body let in gets a larger one, but a connection's window
# is fixed at its start (no window scaling below 64 KiB), so a body arrives at 64 KiB a round
# trip at most: 64 MB/s at 1 ms.
RECEIVE_BUFFER_BYTES = 16 * 1024
ADMITTED_RECEIVE_BUFFER_BYTES = 256 * 1024  # room for the 64 KiB window
READ_BUFFER_BYTES = 16 * 1024  # aiohttp's: it stops reading a connection past twice this unread


class Limits:
    """The connections and request bytes that all clients together hold (see the module's
    docstring), and each connection's gate, by transport."""

    def __init__(self, server: Server, max_body: int) -> None:
        self.server = server
        self.protocol: web.Server | None = (
            None  # aiohttp's Server, once set up: it makes each connection's RequestHandler
        )
        config = server.options.limits
        self.max_connections = config.max_connections
        self.idle_timeout_s = config.idle_timeout_s
        self.max_body = max_body  # one request's body, at most
        # at least one body of the largest size a request may have, or that request never could be read
        self.max_body_bytes = max(config.max_body_bytes_in_flight, max_body)
        self.body_bytes = 0  # reserved by the requests being handled
        self.gates: dict[asyncio.BaseTransport, Gate] = {}
        # the admitted connections with no request being handled, the longest idle first
        self.idle: OrderedDict[Gate, None] = OrderedDict()

    def admit(self, gate: Gate, transport: asyncio.Transport) -> RequestHandler | None:
        """aiohttp's protocol for a new connection (closing the idlest one if there are
        serve.max_connections), or None (every one busy: answered 503 and closed)."""
        if len(self.gates) >= self.max_connections and not self._close_idlest():
            self.server.refused(
                f"{self.max_connections} connections are open (serve.max_connections); closed at accept",
                "connections",
                _peer(transport),
            )
            transport.write(_BUSY_AT_ACCEPT)
            transport.close()
            return None
        if self.protocol is None:
            raise RuntimeError("a connection came before the HTTP server was set up")
        self.gates[transport] = gate
        self.idle[gate] = None
        return self.protocol()

    def _close_idlest(self) -> bool:
        """Closes the connection idle longest to make room for a new one; False if none is idle."""
        if not self.idle:
            return False
        gate, _ = self.idle.popitem(last=False)
        if gate.transport is not None:
            self.gates.pop(gate.transport, None)
            self.server.refused(
                f"{self.max_connections} connections are open (serve.max_connections); the one idle longest closed",
                "idle_closed",
                _peer(gate.transport),
            )
            gate.partial = False  # counted here, not again as an unfinished head
            gate.transport.close()
        return True

    def busy(self, gate: Gate) -> None:
        """A request of ``gate``'s begins."""
        gate.active += 1
        gate.partial = False
        self.idle.pop(gate, None)

    def done(self, gate: Gate) -> None:
        """A request of ``gate``'s ends: idle again once none is being handled."""
        gate.active -= 1
        if not gate.active and gate.transport in self.gates:
            self.idle[gate] = None  # the most recently idle, last

    def release(self, gate: Gate, transport: asyncio.BaseTransport) -> None:
        self.gates.pop(transport, None)
        self.idle.pop(gate, None)
        if gate.partial:  # a request head that never came whole: a slow client, or one gone
            self.server.refused(
                f"the connection closed with a request head unfinished (each must arrive within "
                f"serve.idle_timeout_s, {self.idle_timeout_s:g} s)",
                "incomplete",
                _peer(transport),
            )

    def reserve(self, request: web.Request) -> int:
        """Reserves the request's body bytes in serve.max_body_bytes_in_flight (by its
        Content-Length, before a byte of it is read); returns them, or raises RequestError."""
        if "chunked" in request.headers.get("Transfer-Encoding", "").lower():
            raise RequestError(
                411,
                "no_length",
                "send the body with a Content-Length (apex serve takes no "
                "chunked bodies: it reserves room for a body before reading it)",
            )
        length = request.content_length or 0
        if length > self.max_body:
            raise RequestError(413, "http_413", f"request body over {self.max_body} bytes")
        if self.body_bytes + length > self.max_body_bytes:
            raise RequestError(
                503,
                "body_bytes",
                f"apex serve is reading as many request bytes as "
                f"serve.max_body_bytes_in_flight ({self.max_body_bytes}) "
                "allows; try again",
            )
        self.body_bytes += length
        sock = request.transport.get_extra_info("socket") if request.transport is not None else None
        if length > RECEIVE_BUFFER_BYTES and sock is not None:
            try:  # a body let in streams through the window of a connection made with small buffers
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, ADMITTED_RECEIVE_BUFFER_BYTES)
            except OSError:
                pass  # the connection is gone: its read says so
        return length


def _peer(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else "?"


_BUSY_BODY = json.dumps(
    {"error": "apex serve has as many connections open as serve.max_connections allows; try again later"}
).encode()
_BUSY_AT_ACCEPT = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


class Gate(asyncio.Protocol):
    """One TCP connection: handed to aiohttp's protocol while admitted (serve.max_connections);
    notes whether it holds part of a request that no handler has begun (a slowloris's head,
    which aiohttp's keep-alive timer closes)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.handler: RequestHandler | None = None  # aiohttp's, once admitted
        self.transport: asyncio.BaseTransport | None = None
        self.active = 0  # requests being handled
        self.partial = False  # bytes arrived since the last request began
        self.discarding = False  # a refused request's body arrives (and is dropped) before the close

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not isinstance(transport, asyncio.Transport):  # what a stream server's connections have
            raise TypeError(f"a stream transport expected, got {type(transport).__name__}")
        self.transport = transport
        self.handler = self.limits.admit(self, transport)
        if self.handler is not None:
            self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.handler is not None:
            if not self.active and not self.discarding:
                self.partial = True
            self.handler.data_received(data)

    def eof_received(self) -> None:  # (None: the transport closes itself, as aiohttp's handler says)
        if self.handler is not None:
            self.handler.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.handler is not None and self.transport is not None:  # (a handler came with its transport)
            self.limits.release(self, self.transport)
            self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.handler is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.handler is not None:
            self.handler.resume_writing()
