"""`apex serve`'s HTTP/JSON frontend, for clients in any language (curl included).

aiohttp serves it: one well-kept package that is both the HTTP server (its parser in C)
and the asyncio loop's citizen, with no separate ASGI server to run; FastAPI or Starlette
would add uvicorn and a validation layer that ``apex.external`` does already.

Every error is JSON ``{"error": "..."}`` with a 4xx status (5xx only for a learner that
does not take data); a bad request never changes an episode.
"""

from __future__ import annotations

import json
import math

import numpy as np
from aiohttp import web

from apex.errors import ApexError
from apex.external import RequestError

JSON_CHARS_PER_NUMBER = 32  # an observation's body: room for a long float per element
MAX_BODY_BYTES = 64 << 20  # whatever --max-episodes says: a body is read whole into memory


class HttpFrontend:
    def __init__(self, runner: web.AppRunner, host: str, port: int) -> None:
        self.runner, self.host, self.port = runner, host, port

    def describe(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def close(self) -> None:
        await self.runner.cleanup()


def _error(status: int, message: str) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.json_response({"error": message}, status=status, headers=headers)


def _action_json(action: np.ndarray):
    return action.tolist() if np.ndim(action) else int(action)


def make_app(server) -> web.Application:
    episodes = server.episodes
    frame_elements = math.prod(episodes.spec.frame_shape)
    # room for a batch of observations of every open episode (the batched forms)
    max_body = min(MAX_BODY_BYTES, max(64 * 1024, server.options.max_episodes * (
        frame_elements * JSON_CHARS_PER_NUMBER + 64) + 4096))

    @web.middleware
    async def guard(request: web.Request, handler):
        peer = request.remote or "?"
        header = request.headers.get("Authorization", "")
        presented = header[len("Bearer "):] if header.startswith("Bearer ") else None
        if not server.authorised(presented):
            server.refused("missing or wrong bearer token", "token", peer)
            return _error(401, "missing or wrong bearer token: send Authorization: Bearer <token> "
                               "(apex serve --token-file or APEX_SERVE_TOKEN)")
        try:
            return await handler(request)
        except RequestError as e:
            server.refused(e, peer=peer)
            return _error(e.status, str(e))
        except web.HTTPException as e:  # aiohttp's own: an unknown path, a wrong method, a body too large
            server.refused(e.reason, f"http_{e.status}", peer)
            if e.status == 413:
                return _error(413, f"request body over {max_body} bytes")
            if e.status == 404:
                return _error(404, f"no such endpoint {request.method} {request.path}: see GET /v1/spaces, "
                                   "POST /v1/episodes, POST /v1/episodes/{id}/action|log_action|rewards|end, "
                                   "POST /v1/batch/action|log_action|rewards|end")
            return _error(e.status, e.reason)
        except Exception:  # noqa: BLE001  a bug of ours that a request found: answered in JSON, serving on
            error = server.internal_error()
            return _error(error.status, str(error))

    async def body(request: web.Request) -> dict:
        try:
            raw = await request.read()
        except ConnectionError:  # the client went away mid-body: counted, not aiohttp's traceback
            raise RequestError(400, "disconnected", "the connection closed before the body arrived") from None
        try:
            data = json.loads(raw) if raw else {}
        except (ValueError, UnicodeDecodeError) as e:
            raise RequestError(400, "json", f"malformed JSON: {e}") from None
        except RecursionError:  # "[[[[..." nested past the parser's depth
            raise RequestError(400, "json", "malformed JSON: nested too deep") from None
        if not isinstance(data, dict):
            raise RequestError(400, "json", "the body must be a JSON object")
        return data

    def need(data: dict, key: str):
        if key not in data:
            raise RequestError(400, "fields", f"missing {key!r} in the body")
        return data[key]

    async def spaces(_request):
        return web.json_response(episodes.spaces)

    async def health(_request):
        return web.json_response(server.health())

    async def start(request):
        data = await body(request)
        if "count" in data:  # many at once: {"count": n} -> {"episode_ids": [...]}
            return web.json_response({"episode_ids": server.call("start", data["count"])})
        (episode_id,) = server.call("start", 1)
        return web.json_response({"episode_id": episode_id})

    async def action(request):
        data = await body(request)
        await server.wait_for_room()
        actions = server.call("act", [request.match_info["id"]], [need(data, "observation")],
                              None if data.get("reward") is None else [data["reward"]])
        return web.json_response({"action": _action_json(actions[0])})

    async def log_action(request):
        data = await body(request)
        await server.wait_for_room()
        server.call("log_action", [request.match_info["id"]], [need(data, "observation")], [need(data, "action")],
                    None if data.get("reward") is None else [data["reward"]])
        return web.json_response({})

    async def rewards(request):
        data = await body(request)
        server.call("add_rewards", [request.match_info["id"]], [need(data, "reward")])
        return web.json_response({})

    async def end(request):
        data = await body(request)
        await server.wait_for_room()
        server.call("end", [request.match_info["id"]], [need(data, "observation")],
                    [data.get("terminated", False)], [data.get("truncated", False)],
                    None if data.get("reward") is None else [data["reward"]])
        return web.json_response({})

    # The batched forms: many episodes a request, as the ZeroMQ ops take them.

    async def batch_action(request):
        data = await body(request)
        await server.wait_for_room()
        actions = server.call("act", need(data, "episode_ids"), need(data, "observations"), data.get("rewards"),
                              data.get("end"))
        return web.json_response({"actions": actions.tolist()})

    async def batch_log_action(request):
        data = await body(request)
        await server.wait_for_room()
        server.call("log_action", need(data, "episode_ids"), need(data, "observations"), need(data, "actions"),
                    data.get("rewards"))
        return web.json_response({})

    async def batch_rewards(request):
        data = await body(request)
        server.call("add_rewards", need(data, "episode_ids"), need(data, "rewards"))
        return web.json_response({})

    async def batch_end(request):
        data = await body(request)
        await server.wait_for_room()
        server.call("end", need(data, "episode_ids"), need(data, "observations"), data.get("terminated", False),
                    data.get("truncated", False), data.get("rewards"))
        return web.json_response({})

    app = web.Application(middlewares=[guard], client_max_size=max_body)
    app.add_routes([
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
    ])
    return app


async def start(server, host: str, port: int) -> HttpFrontend:
    runner = web.AppRunner(make_app(server), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError as e:
        await runner.cleanup()
        raise ApexError(f"--http {host}:{port}: cannot listen there ({e.strerror}); choose another port") from None
    bound = runner.addresses[0][1] if runner.addresses else port
    return HttpFrontend(runner, host, bound)
