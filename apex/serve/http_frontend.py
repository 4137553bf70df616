"""`apex serve`'s HTTP/JSON frontend, for clients in any language (curl included).

aiohttp serves it: one well-kept package that is both the HTTP server (its parser in C)
and the asyncio loop's citizen, with no separate ASGI server to run; FastAPI or Starlette
would add uvicorn and a validation layer that ``apex.serve.episodes`` does already.

Every error is JSON ``{"error": "..."}`` with a 4xx status (5xx only for a learner that
does not take data, or limits reached); a bad request never changes an episode.

What a client may hold is bounded (the serve section of the config): connections open at
once (serve.max_connections: one more is answered 503 at accept and closed), the request
bytes being read, all connections together (serve.max_body_bytes_in_flight, reserved by
Content-Length before a body is read: 503 when spent), and time (serve.idle_timeout_s: a
connection that sends no whole request head within it is closed, as is one whose body takes
longer). Each refusal is counted in rejected_by_reason and logged, rate-limited.
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
import sys
from typing import TYPE_CHECKING, Any

import numpy as np
from aiohttp import web
from aiohttp.typedefs import Handler
from aiohttp.web_protocol import RequestHandler

from apex.errors import ApexError
from apex.serve.episodes import RequestError

if TYPE_CHECKING:
    from apex.serve.server import Server

JSON_CHARS_PER_NUMBER = 32  # an observation's body: room for a long float per element
MAX_BODY_BYTES = 64 << 20  # whatever --max-episodes says: a body is read whole into memory
LINGER_S = 2.0  # a refused request's body is read and dropped this long, so that its client reads the error
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


class HttpFrontend:
    def __init__(self, runner: web.AppRunner, listener: asyncio.Server, host: str, port: int) -> None:
        self.runner, self.listener, self.host, self.port = runner, listener, host, port

    def describe(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        self.listener.close()
        await self.runner.cleanup()


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
        # at least one body of the largest size a request may have, or that request never could be read
        self.max_body_bytes = max(config.max_body_bytes_in_flight, max_body)
        self.body_bytes = 0  # reserved by the requests being handled
        self.gates: dict[asyncio.BaseTransport, Gate] = {}

    def admit(self, gate: Gate, transport: asyncio.Transport) -> RequestHandler | None:
        """aiohttp's protocol for a new connection, or None (answered 503 and closed)."""
        if len(self.gates) >= self.max_connections:
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
        return self.protocol()

    def release(self, gate: Gate, transport: asyncio.BaseTransport) -> None:
        self.gates.pop(transport, None)
        if gate.partial:  # a request head that never came whole: a slow client, or one gone
            self.server.refused(
                f"the connection closed with a request head unfinished (each must arrive within "
                f"serve.idle_timeout_s, {self.idle_timeout_s:g} s)",
                "incomplete",
                _peer(transport),
            )


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
    """One TCP connection: handed to aiohttp's protocol while under serve.max_connections;
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


def _error(status: int, message: str) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {"Retry-After": "1"} if status == 503 else None
    return web.json_response({"error": message}, status=status, headers=headers)


def _action_json(action: np.ndarray) -> int | list[Any]:
    return action.tolist() if np.ndim(action) else int(action)


def max_body_bytes(server: Server) -> int:
    """The largest request body: room for a batch of observations of every open episode
    (the batched forms)."""
    frame_elements = math.prod(server.episodes.spec.frame_shape)
    return min(
        MAX_BODY_BYTES,
        max(64 * 1024, server.options.max_episodes * (frame_elements * JSON_CHARS_PER_NUMBER + 64) + 4096),
    )


def make_app(server: Server, limits: Limits) -> web.Application:
    episodes = server.episodes
    max_body = max_body_bytes(server)

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        gate = limits.gates.get(request.transport) if request.transport is not None else None
        if gate is not None:
            gate.active += 1
            gate.partial = False
        try:
            response = await admitted(request, handler)
        finally:
            if gate is not None:
                gate.active -= 1
        if not request.content.is_eof():  # answered before its body came whole: dropped, then the connection closed
            response.force_close()
            if gate is not None:
                gate.discarding = True
        return response

    async def admitted(request: web.Request, handler: Handler) -> web.StreamResponse:
        peer = request.remote or "?"
        header = request.headers.get("Authorization", "")
        presented = header[len("Bearer ") :] if header.startswith("Bearer ") else None
        if not server.authorised(presented):
            server.refused("missing or wrong bearer token", "token", peer)
            return _error(
                401,
                "missing or wrong bearer token: send Authorization: Bearer <token> "
                "(apex serve --token-file or APEX_SERVE_TOKEN)",
            )
        reserved = 0
        try:
            reserved = reserve(request)
            return await handler(request)
        except RequestError as e:
            server.refused(e, peer=peer)
            return _error(e.status, str(e))
        except web.HTTPException as e:  # aiohttp's own: an unknown path, a wrong method, a body too large
            server.refused(e.reason, f"http_{e.status}", peer)
            if e.status == 413:
                return _error(413, f"request body over {max_body} bytes")
            if e.status == 404:
                return _error(
                    404,
                    f"no such endpoint {request.method} {request.path}: see GET /v1/spaces, "
                    "POST /v1/episodes, POST /v1/episodes/{id}/action|log_action|rewards|end, "
                    "POST /v1/batch/action|log_action|rewards|end",
                )
            return _error(e.status, e.reason)
        except Exception:
            error = server.internal_error()
            return _error(error.status, str(error))
        finally:
            limits.body_bytes -= reserved

    def reserve(request: web.Request) -> int:
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
        if length > max_body:
            raise RequestError(413, "http_413", f"request body over {max_body} bytes")
        if limits.body_bytes + length > limits.max_body_bytes:
            raise RequestError(
                503,
                "body_bytes",
                f"apex serve is reading as many request bytes as "
                f"serve.max_body_bytes_in_flight ({limits.max_body_bytes}) "
                "allows; try again",
            )
        limits.body_bytes += length
        sock = request.transport.get_extra_info("socket") if request.transport is not None else None
        if length > RECEIVE_BUFFER_BYTES and sock is not None:
            try:  # a body let in streams through the window of a connection made with small buffers
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, ADMITTED_RECEIVE_BUFFER_BYTES)
            except OSError:
                pass  # the connection is gone: its read says so
        return length

    async def body(request: web.Request) -> dict[str, Any]:
        try:
            if sys.version_info >= (3, 11):
                async with asyncio.timeout(limits.idle_timeout_s):
                    raw = await request.read()
            else:  # (no asyncio.timeout before 3.11)
                raw = await asyncio.wait_for(request.read(), limits.idle_timeout_s)
        except ConnectionError:  # the client went away mid-body: counted, not aiohttp's traceback
            raise RequestError(400, "disconnected", "the connection closed before the body arrived") from None
        except (TimeoutError, asyncio.TimeoutError):  # a slowloris: its connection is closed after the answer
            raise RequestError(
                408,
                "body_timeout",
                f"the body did not arrive within serve.idle_timeout_s ({limits.idle_timeout_s:g} s)",
            ) from None
        try:
            data = json.loads(raw) if raw else {}
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, "json", f"malformed JSON: {e}") from None
        except RecursionError:  # "[[[[..." nested past the parser's depth
            raise RequestError(400, "json", "malformed JSON: nested too deep") from None
        if not isinstance(data, dict):
            raise RequestError(400, "json", "the body must be a JSON object")
        return data

    def need(data: dict[str, Any], key: str) -> Any:
        if key not in data:
            raise RequestError(400, "fields", f"missing {key!r} in the body")
        return data[key]

    async def spaces(_request: web.Request) -> web.Response:
        return web.json_response(episodes.spaces)

    async def health(_request: web.Request) -> web.Response:
        return web.json_response(server.health())

    async def start(request: web.Request) -> web.Response:
        data = await body(request)
        if "count" in data:  # many at once: {"count": n} -> {"episode_ids": [...]}
            return web.json_response({"episode_ids": server.call("start", data["count"])})
        (episode_id,) = server.call("start", 1)
        return web.json_response({"episode_id": episode_id})

    async def action(request: web.Request) -> web.Response:
        data = await body(request)
        await server.wait_for_room()
        actions = server.call(
            "act",
            [request.match_info["id"]],
            [need(data, "observation")],
            None if data.get("reward") is None else [data["reward"]],
        )
        return web.json_response({"action": _action_json(actions[0])})

    async def log_action(request: web.Request) -> web.Response:
        data = await body(request)
        await server.wait_for_room()
        server.call(
            "log_action",
            [request.match_info["id"]],
            [need(data, "observation")],
            [need(data, "action")],
            None if data.get("reward") is None else [data["reward"]],
        )
        return web.json_response({})

    async def rewards(request: web.Request) -> web.Response:
        data = await body(request)
        server.call("add_rewards", [request.match_info["id"]], [need(data, "reward")])
        return web.json_response({})

    async def end(request: web.Request) -> web.Response:
        data = await body(request)
        await server.wait_for_room()
        server.call(
            "end",
            [request.match_info["id"]],
            [need(data, "observation")],
            [data.get("terminated", False)],
            [data.get("truncated", False)],
            None if data.get("reward") is None else [data["reward"]],
        )
        return web.json_response({})

    # The batched forms: many episodes a request, as the ZeroMQ ops take them.

    async def batch_action(request: web.Request) -> web.Response:
        data = await body(request)
        await server.wait_for_room()
        actions = server.call(
            "act", need(data, "episode_ids"), need(data, "observations"), data.get("rewards"), data.get("end")
        )
        return web.json_response({"actions": actions.tolist()})

    async def batch_log_action(request: web.Request) -> web.Response:
        data = await body(request)
        await server.wait_for_room()
        server.call(
            "log_action",
            need(data, "episode_ids"),
            need(data, "observations"),
            need(data, "actions"),
            data.get("rewards"),
        )
        return web.json_response({})

    async def batch_rewards(request: web.Request) -> web.Response:
        data = await body(request)
        server.call("add_rewards", need(data, "episode_ids"), need(data, "rewards"))
        return web.json_response({})

    async def batch_end(request: web.Request) -> web.Response:
        data = await body(request)
        await server.wait_for_room()
        server.call(
            "end",
            need(data, "episode_ids"),
            need(data, "observations"),
            data.get("terminated", False),
            data.get("truncated", False),
            data.get("rewards"),
        )
        return web.json_response({})

    app = web.Application(middlewares=[guard], client_max_size=max_body)
    app.add_routes(
        [
            web.get("/v1/spaces", spaces),
            web.get("/v1/health", health),
            web.post("/v1/episodes", start),
            web.post("/v1/episodes/{id}/action", action),
            web.post("/v1/episodes/{id}/log_action", log_action),
            web.post("/v1/episodes/{id}/rewards", rewards),
            web.post("/v1/episodes/{id}/end", end),
            web.post("/v1/batch/action", batch_action),
            web.post("/v1/batch/log_action", batch_log_action),
            web.post("/v1/batch/rewards", batch_rewards),
            web.post("/v1/batch/end", batch_end),
        ]
    )
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
