"""`apex serve`'s ZeroMQ/msgpack frontend: many episodes per request, for throughput.

A ROUTER socket: a client sends one msgpack map per message (DEALER: one frame; REQ: the
empty delimiter first, echoed back) and gets one map back, ``{"id": <the request's id>,
"ok": true, ...}`` or ``{"id": ..., "ok": false, "status": 4xx, "error": "..."}``. The wire
format, op by op, is in docs/serve.md; ``apex.client.PolicyClient`` speaks
it. Requests are served in turn; a client that sends and never reads loses its replies
(ROUTER drops at the high-water mark), not the server's time.
"""

from __future__ import annotations

import asyncio
import math
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from apex.errors import ApexError
from apex.serve.episodes import RequestError
from apex.serve.request_checks import actions_json, known_fields
from apex.transport import load_keypair

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

    from apex.serve.server import Server

ARRAY_DTYPES = frozenset({"float32", "float64", "uint8", "int8", "int16", "int32", "int64", "uint16", "bool"})
MAX_ID_CHARS = 64


class ZmqFrontend:
    def __init__(
        self,
        server: Server,
        socket: zmq.asyncio.Socket,
        host: str,
        port: int,
        authenticator: ThreadAuthenticator | None = None,
    ) -> None:
        self.server, self.socket, self.host, self.port = server, socket, host, port
        self.authenticator = authenticator
        self.task: asyncio.Task[None] | None = None

    def describe(self) -> str:
        return f"tcp://{self.host}:{self.port} (ZeroMQ{', CURVE' if self.authenticator else ''})"

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
        self.socket.close(linger=0)
        if self.authenticator is not None:
            self.authenticator.stop()


def _curve(context: zmq.asyncio.Context, sock: zmq.asyncio.Socket, curve_dir: str) -> ThreadAuthenticator:
    """Makes ``sock`` a CURVE server with serve.key_secret that lets in only the client keys
    in serve-clients/ (as the learner does with authorized/); returns the authenticator."""
    from pathlib import Path

    from zmq.auth.thread import ThreadAuthenticator

    directory = Path(curve_dir)
    clients = directory / "serve-clients"
    public, secret = load_keypair(directory / "serve.key_secret")
    if not clients.is_dir() or not any(clients.glob("*.key")):
        raise ApexError(
            f"no authorised client keys in {clients}: `apex keygen NEWDIR` makes serve.key_secret, "
            "client.key_secret and serve-clients/"
        )
    # The authenticator answers on the context's ZAP endpoint: the same (synchronous) context.
    authenticator = ThreadAuthenticator(zmq.Context.shadow(context.underlying))
    authenticator.start()
    authenticator.configure_curve(domain="*", location=str(clients))
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_server = True
    return authenticator


def decode_array(value: object, what: str) -> np.ndarray | object:
    """A msgpack array of numbers, or ``{"dtype", "shape", "data"}`` (raw little-endian bytes)
    as an array; anything else as it came (ExternalEpisodes checks it)."""
    if isinstance(value, dict):
        dtype, shape, data = value.get("dtype"), value.get("shape"), value.get("data")
        if not isinstance(dtype, str) or dtype not in ARRAY_DTYPES:
            raise RequestError(400, "fields", f"{what}: dtype must be one of {', '.join(sorted(ARRAY_DTYPES))}")
        if not (
            isinstance(shape, list)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
            and len(shape) <= 8
        ):
            raise RequestError(400, "fields", f"{what}: shape must be a list of at most 8 non-negative integers")
        dt = np.dtype(dtype).newbyteorder("<")
        if not isinstance(data, bytes) or len(data) != math.prod(shape) * dt.itemsize:
            raise RequestError(
                400, "fields", f"{what}: data must be {math.prod(shape) * dt.itemsize} bytes for {dtype} {shape}"
            )
        return np.frombuffer(data, dt).reshape(shape)
    return value  # a nested list: ExternalEpisodes checks it


def _error_reply(request_id: int | str | None, error: RequestError) -> dict[str, Any]:
    return {"id": request_id, "ok": False, "status": error.status, "error": str(error)}


PER_AGENT = ("terminated", "truncated", "action_masks")  # a multi-agent run's maps by agent, an episode each
# what each op takes beside op, id and token
OP_FIELDS = {
    "spaces": (),
    "health": (),
    "start": ("count",),
    "act": ("episode_ids", "observations", "rewards", "end", *PER_AGENT),
    "log_action": ("episode_ids", "observations", "actions", "rewards", *PER_AGENT),
    "rewards": ("episode_ids", "rewards"),
    "end": ("episode_ids", "observations", "terminated", "truncated", "rewards"),
}


class Handler:
    def __init__(self, server: Server) -> None:
        self.server = server

    async def __call__(self, payload: bytes, peer: str = "") -> dict[str, Any]:
        """The reply to one request from ``peer`` (its address: whose episodes it starts)."""
        server = self.server
        try:
            request = msgpack.unpackb(payload, raw=False, strict_map_key=True)
        except Exception as e:  # whatever the bytes: msgpack's errors, bad UTF-8, too deep
            error = RequestError(400, "msgpack", f"not a msgpack message: {type(e).__name__}")
            server.refused(error)
            return _error_reply(None, error)
        request_id = request.get("id") if isinstance(request, dict) else None
        if not isinstance(request_id, int | str | None) or (
            isinstance(request_id, str) and len(request_id) > MAX_ID_CHARS
        ):
            request_id = None
        try:
            if not isinstance(request, dict):
                raise RequestError(400, "fields", "a request is a msgpack map with an 'op'")
            token = request.get("token")
            if not server.authorised(token if isinstance(token, str) else None):
                raise RequestError(
                    401,
                    "token",
                    "missing or wrong token: put it in the request's 'token' field "
                    "(apex serve --token-file or APEX_SERVE_TOKEN)",
                )
            return {"id": request_id, "ok": True, **await self.dispatch(request, peer)}
        except RequestError as e:
            server.refused(e)
            return _error_reply(request_id, e)
        except Exception:
            return _error_reply(request_id, server.internal_error())

    async def dispatch(self, request: dict[str, Any], peer: str = "") -> dict[str, Any]:
        server = self.server
        op = request.get("op")
        if isinstance(op, str) and op in OP_FIELDS:
            known_fields(request, ("op", "id", "token", *OP_FIELDS[op]), f"op {op}")
        if op == "spaces":
            return {"spaces": server.episodes.spaces}
        if op == "health":
            return server.health()
        if op == "start":
            return {"episode_ids": server.call("start", request.get("count", 1), peer)}
        ids = request.get("episode_ids")
        rewards = request.get("rewards")
        if op == "rewards":
            server.call("add_rewards", ids, rewards)
            return {}
        if op not in ("act", "log_action", "end"):
            raise RequestError(
                400, "fields", f"unknown op {str(op)[:32]!r}: spaces, health, start, act, log_action, rewards or end"
            )
        observations = decode_array(request.get("observations"), "observations")
        await server.wait_for_room()
        if op == "act":
            ended = request.get("end")
            if isinstance(ended, dict) and "observations" in ended:
                ended = {**ended, "observations": decode_array(ended["observations"], "end.observations")}
            actions = server.call("act", ids, observations, rewards, ended, **_per_agent(request))
            return {"actions": actions_json(actions)}
        if op == "log_action":
            chosen = decode_array(request.get("actions"), "actions")
            server.call("log_action", ids, observations, chosen, rewards, **_per_agent(request))
            return {}
        server.call(
            "end", ids, observations, request.get("terminated", False), request.get("truncated", False), rewards
        )
        return {}


def _per_agent(request: dict[str, Any]) -> dict[str, Any]:
    return {name: request.get(name) for name in PER_AGENT}


def _peer(frame: zmq.Frame) -> str:
    """The address a message came from (libzmq's Peer-Address; "" where it has none)."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, KeyError, TypeError):
        return ""


async def start(server: Server, host: str, port: int) -> ZmqFrontend:
    context = zmq.asyncio.Context.instance()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    frame_bytes = server.episodes.frame_elements * 8  # float64 observations at most
    sock.setsockopt(zmq.MAXMSGSIZE, server.options.max_episodes * frame_bytes * 2 + (1 << 20))
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(server.options.limits.handshake_timeout_s * 1000))
    authenticator = None
    try:
        if server.options.curve_dir:
            authenticator = _curve(context, sock, server.options.curve_dir)
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as e:
        sock.close(linger=0)
        if authenticator is not None:
            authenticator.stop()
        raise ApexError(f"--zmq {host}:{port}: cannot listen there ({e}); choose another port") from None
    except ApexError:
        sock.close(linger=0)
        raise
    frontend = ZmqFrontend(server, sock, host, port, authenticator)
    handler = Handler(server)

    async def loop() -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            if len(frames) < 2:
                continue
            reply = await handler(frames[-1].bytes, _peer(frames[-1]))
            try:
                await sock.send_multipart([*frames[:-1], msgpack.packb(reply)], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # a client that does not read its replies
            # A queued message is received without a pause: yield, or a flood of them would
            # starve the HTTP frontend that shares this loop.
            await asyncio.sleep(0)

    frontend.task = asyncio.get_running_loop().create_task(loop())
    return frontend
