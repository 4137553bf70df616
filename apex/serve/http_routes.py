"""The HTTP/JSON API of `apex serve`: one handler per endpoint, and the middleware every
request passes first (the bearer token, its body's bytes in serve.max_body_bytes_in_flight,
and every refusal answered as JSON ``{"error": "..."}``).

The handlers are methods of one object, ``HttpRoutes``, because they share the server, the
limits and the largest body a request may have; each reads its JSON body, hands it to the
server's episodes (which check it whole before an episode moves) and answers JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.typedefs import Handler

from apex.serve.http_schema import openapi
from apex.serve.request_checks import RequestError, actions_json, known_fields

if TYPE_CHECKING:
    from apex.serve.http_limits import Limits
    from apex.serve.server import Server

ENDPOINTS = (
    "GET /v1/spaces, GET /v1/schema, GET /v1/health, POST /v1/episodes, "
    "POST /v1/episodes/{id}/action|log_action|rewards|end, POST /v1/batch/action|log_action|rewards|end"
)


class HttpRoutes:
    """The endpoints of one `apex serve` and their middleware, ``guard``."""

    def __init__(self, server: Server, limits: Limits) -> None:
        self.server = server
        self.limits = limits
        self.max_body = limits.max_body
        self.schema = openapi(server.episodes.spaces)

    def table(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/spaces", self.spaces),
            web.get("/v1/health", self.health),
            web.get("/v1/schema", self.openapi),
            web.post("/v1/episodes", self.start),
            web.post("/v1/episodes/{id}/action", self.action),
            web.post("/v1/episodes/{id}/log_action", self.log_action),
            web.post("/v1/episodes/{id}/rewards", self.rewards),
            web.post("/v1/episodes/{id}/end", self.end),
            web.post("/v1/batch/action", self.batch_action),
            web.post("/v1/batch/log_action", self.batch_log_action),
            web.post("/v1/batch/rewards", self.batch_rewards),
            web.post("/v1/batch/end", self.batch_end),
        ]

    # -- every request

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        gate = self.limits.gates.get(request.transport) if request.transport is not None else None
        if gate is not None:
            self.limits.busy(gate)
        try:
            response = await self._admitted(request, handler)
            if not request.content.is_eof():  # answered before its body came whole: dropped, then the connection closed
                response.force_close()
                if gate is not None:
                    gate.discarding = True
            # Written here, not after the middleware as aiohttp would: the connection is idle,
            # and may be closed for a new one (serve.max_connections), only once its reply is out.
            with contextlib.suppress(ConnectionResetError):  # the client gone: aiohttp's own writing says so, as before
                await response.prepare(request)
                await response.write_eof()
        finally:
            if gate is not None:
                self.limits.done(gate)
        return response

    async def _admitted(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        server = self.server
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
            reserved = self.limits.reserve(request)
            return await handler(request)
        except RequestError as e:
            server.refused(e, peer=peer)
            return _error(e.status, str(e))
        except web.HTTPException as e:  # aiohttp's own: an unknown path, a wrong method, a body too large
            server.refused(e.reason, f"http_{e.status}", peer)
            if e.status == 413:
                return _error(413, f"request body over {self.max_body} bytes")
            if e.status == 404:
                return _error(404, f"no such endpoint {request.method} {request.path}: see {ENDPOINTS}")
            return _error(e.status, e.reason)
        except Exception:
            error = server.internal_error()
            return _error(error.status, str(error))
        finally:
            self.limits.body_bytes -= reserved

    async def _body(self, request: web.Request, *fields: str) -> dict[str, Any]:
        """The request's JSON object, refused if it has a field beyond ``fields``."""
        data = await self._json(request)
        known_fields(data, fields, f"{request.method} {request.path}")
        return data

    async def _json(self, request: web.Request) -> dict[str, Any]:
        timeout_s = self.limits.idle_timeout_s
        try:
            if sys.version_info >= (3, 11):
                async with asyncio.timeout(timeout_s):
                    raw = await request.read()
            else:  # (no asyncio.timeout before 3.11)
                raw = await asyncio.wait_for(request.read(), timeout_s)
        except ConnectionError:  # the client went away mid-body: counted, not aiohttp's traceback
            raise RequestError(400, "disconnected", "the connection closed before the body arrived") from None
        except (TimeoutError, asyncio.TimeoutError):  # a slowloris: its connection is closed after the answer
            raise RequestError(
                408,
                "body_timeout",
                f"the body did not arrive within serve.idle_timeout_s ({timeout_s:g} s)",
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

    # -- one episode a request

    async def spaces(self, _request: web.Request) -> web.Response:
        return web.json_response(self.server.episodes.spaces)

    async def openapi(self, _request: web.Request) -> web.Response:
        return web.json_response(self.schema)

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response(self.server.health())

    async def start(self, request: web.Request) -> web.Response:
        data = await self._body(request, "count")
        client = request.remote or ""
        if "count" in data:  # many at once: {"count": n} -> {"episode_ids": [...]}
            return web.json_response({"episode_ids": self.server.call("start", data["count"], client)})
        (episode_id,) = self.server.call("start", 1, client)
        return web.json_response({"episode_id": episode_id})

    async def action(self, request: web.Request) -> web.Response:
        data = await self._body(request, "observation", "reward", *PER_AGENT)
        await self.server.wait_for_room()
        actions = self.server.call(
            "act",
            [request.match_info["id"]],
            [_need(data, "observation")],
            None if data.get("reward") is None else [data["reward"]],
            **_per_agent(data),
        )
        return web.json_response({"action": actions_json(actions)[0]})

    async def log_action(self, request: web.Request) -> web.Response:
        data = await self._body(request, "observation", "action", "reward", *PER_AGENT)
        await self.server.wait_for_room()
        self.server.call(
            "log_action",
            [request.match_info["id"]],
            [_need(data, "observation")],
            [_need(data, "action")],
            None if data.get("reward") is None else [data["reward"]],
            **_per_agent(data),
        )
        return web.json_response({})

    async def rewards(self, request: web.Request) -> web.Response:
        data = await self._body(request, "reward")
        self.server.call("add_rewards", [request.match_info["id"]], [_need(data, "reward")])
        return web.json_response({})

    async def end(self, request: web.Request) -> web.Response:
        data = await self._body(request, "observation", "terminated", "truncated", "reward")
        await self.server.wait_for_room()
        self.server.call(
            "end",
            [request.match_info["id"]],
            [_need(data, "observation")],
            [data.get("terminated", False)],
            [data.get("truncated", False)],
            None if data.get("reward") is None else [data["reward"]],
        )
        return web.json_response({})

    # -- the batched forms: many episodes a request, as the ZeroMQ ops take them

    async def batch_action(self, request: web.Request) -> web.Response:
        data = await self._body(request, "episode_ids", "observations", "rewards", "end", *BATCH_PER_AGENT)
        await self.server.wait_for_room()
        actions = self.server.call(
            "act",
            _need(data, "episode_ids"),
            _need(data, "observations"),
            data.get("rewards"),
            data.get("end"),
            **{name: data.get(name) for name in BATCH_PER_AGENT},
        )
        return web.json_response({"actions": actions_json(actions)})

    async def batch_log_action(self, request: web.Request) -> web.Response:
        data = await self._body(request, "episode_ids", "observations", "actions", "rewards", *BATCH_PER_AGENT)
        await self.server.wait_for_room()
        self.server.call(
            "log_action",
            _need(data, "episode_ids"),
            _need(data, "observations"),
            _need(data, "actions"),
            data.get("rewards"),
            **{name: data.get(name) for name in BATCH_PER_AGENT},
        )
        return web.json_response({})

    async def batch_rewards(self, request: web.Request) -> web.Response:
        data = await self._body(request, "episode_ids", "rewards")
        self.server.call("add_rewards", _need(data, "episode_ids"), _need(data, "rewards"))
        return web.json_response({})

    async def batch_end(self, request: web.Request) -> web.Response:
        data = await self._body(request, "episode_ids", "observations", "terminated", "truncated", "rewards")
        await self.server.wait_for_room()
        self.server.call(
            "end",
            _need(data, "episode_ids"),
            _need(data, "observations"),
            data.get("terminated", False),
            data.get("truncated", False),
            data.get("rewards"),
        )
        return web.json_response({})


# A multi-agent run's action requests also take maps by agent: done flags and action masks.
PER_AGENT = ("terminated", "truncated", "action_mask")
BATCH_PER_AGENT = ("terminated", "truncated", "action_masks")


def _per_agent(data: dict[str, Any]) -> dict[str, Any]:
    """One episode's per-agent fields as the batched call takes them (a list of one)."""
    return {batch: [data[one]] for one, batch in zip(PER_AGENT, BATCH_PER_AGENT) if data.get(one) is not None}


def _need(data: dict[str, Any], key: str) -> Any:
    if key not in data:
        raise RequestError(400, "fields", f"missing {key!r} in the body")
    return data[key]


def _error(status: int, message: str) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {"Retry-After": "1"} if status == 503 else None
    return web.json_response({"error": message}, status=status, headers=headers)
