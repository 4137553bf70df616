"""`apex serve`'s HTTP/JSON frontend, for clients in any language (curl included).

aiohttp serves it: one well-kept package that is both the HTTP server (its parser in C)
and the asyncio loop's citizen, with no separate ASGI server to run; FastAPI or Starlette
would add uvicorn and a validation layer that ``apex.serve.episodes`` does already.

Every error is JSON ``{"error": "..."}`` with a 4xx status (5xx only for a learner that
does not take data, or limits reached); a bad request never changes an episode.

This module sets the server up; ``apex.serve.http_limits`` bounds what clients may hold of
it, and ``apex.serve.http_routes`` holds its endpoints.
"""

from __future__ import annotations

import asyncio
import socket
from typing import TYPE_CHECKING

from aiohttp import web

from apex.errors import ApexError
from apex.serve.http_limits import READ_BUFFER_BYTES, RECEIVE_BUFFER_BYTES, Gate, Limits
from apex.serve.http_routes import HttpRoutes

if TYPE_CHECKING:
    from apex.serve.server import Server

JSON_CHARS_PER_NUMBER = 32  # an observation's body: room for a long float per element
MAX_BODY_BYTES = 64 << 20  # whatever --max-episodes says: a body is read whole into memory
LINGER_S = 2.0  # a refused request's body is read and dropped this long, so that its client reads the error


class HttpFrontend:
    def __init__(self, runner: web.AppRunner, listener: asyncio.Server, host: str, port: int) -> None:
        self.runner, self.listener, self.host, self.port = runner, listener, host, port

    def describe(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        self.listener.close()
        await self.runner.cleanup()


def max_body_bytes(server: Server) -> int:
    """The largest request body: room for a batch of observations of every open episode
    (the batched forms)."""
    frame_elements = server.episodes.frame_elements
    return min(
        MAX_BODY_BYTES,
        max(64 * 1024, server.options.max_episodes * (frame_elements * JSON_CHARS_PER_NUMBER + 64) + 4096),
    )


def make_app(server: Server, limits: Limits) -> web.Application:
    routes = HttpRoutes(server, limits)
    app = web.Application(middlewares=[routes.guard], client_max_size=limits.max_body)
    app.add_routes(routes.table())
    return app


async def start(server: Server, host: str, port: int) -> HttpFrontend:
    # aiohttp's keep-alive timer closes a connection that has no whole request head within
    # the idle timeout, from its start or from its last answer (a slowloris's dribbled head).
    limits = Limits(server, max_body_bytes(server))
    runner = web.AppRunner(
        make_app(server, limits),
        access_log=None,
        handle_signals=False,
        keepalive_timeout=limits.idle_timeout_s,
        lingering_time=LINGER_S,
        read_bufsize=READ_BUFFER_BYTES,
    )
    await runner.setup()
    limits.protocol = runner.server
    # aiohttp's low-level serving (its Server is the protocol factory), each connection
    # through a Gate: TCPSite has no place for a cap on connections.
    try:
        listener = await asyncio.get_running_loop().create_server(
            lambda: Gate(limits), sock=_listening_socket(host, port)
        )
    except OSError as e:
        await runner.cleanup()
        raise ApexError(f"--http {host}:{port}: cannot listen there ({e.strerror}); choose another port") from None
    bound = listener.sockets[0].getsockname()[1]
    return HttpFrontend(runner, listener, host, bound)


def _listening_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket whose connections' kernel receive buffer is
    RECEIVE_BUFFER_BYTES (set before listen: accepted sockets inherit it)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)
        sock.bind(address)
        sock.listen(128)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
