"""The HTTP API of `apex serve` as an OpenAPI 3.1 document (``GET /v1/schema``): every request
and reply a JSON Schema (2020-12, OpenAPI 3.1's own), with the observation and the action
written out for the run's spaces (``apex.serve.request_checks.describe_spaces``), so that a
client in another language can be written, or generated, from it. The manual's copy
(docs/serve.md) is CartPole's.

What the schema cannot say, the server still checks: bounds of integer frames, finite
numbers, the reward caps, an episode's order of requests.
"""

from __future__ import annotations

from typing import Any

from apex import __version__

Schema = dict[str, Any]
NUMBER: Schema = {"type": "number"}
REF = "#/components/schemas/"


def _ref(name: str) -> Schema:
    return {"$ref": REF + name}


def _nested(shape: list[int], item: Schema) -> Schema:
    """Arrays nested to ``shape`` around ``item`` (a scalar for shape [])."""
    schema = item
    for size in reversed(shape):
        schema = {"type": "array", "items": schema, "minItems": size, "maxItems": size}
    return schema


def _bounded(low: Any, high: Any) -> Schema:
    """A number within one low and one high each (None or a list: no single bound to state)."""
    schema: Schema = {"type": "number"}
    if isinstance(low, int | float):
        schema["minimum"] = low
    if isinstance(high, int | float):
        schema["maximum"] = high
    return schema


def _values(shape: list[int], low: Any, high: Any, kind: str = "number") -> Schema:
    """Numbers nested to ``shape`` within their bounds: one low and high for all, or a list of
    them for a vector (a bound per value)."""
    schema = _nested(shape, {**_bounded(low, high), "type": kind})
    if len(shape) == 1 and (isinstance(low, list) or isinstance(high, list)):
        lows = low if isinstance(low, list) else [low] * shape[0]
        highs = high if isinstance(high, list) else [high] * shape[0]
        schema["prefixItems"] = [{**_bounded(lo, hi), "type": kind} for lo, hi in zip(lows, highs)]
    return schema


def observation_schema(space: dict[str, Any]) -> Schema:
    """One observation (a frame) as ``GET /v1/spaces``'s ``observation`` describes it."""
    kind = "integer" if space["dtype"].startswith(("int", "uint")) or space["dtype"] == "bool" else "number"
    schema = _values(list(space["shape"]), space["low"], space["high"], kind)
    return {**schema, "description": f"one frame: {space['dtype']} {space['shape']}"}


def action_schema(space: dict[str, Any]) -> Schema:
    """One action as ``GET /v1/spaces``'s ``action`` describes it."""
    if space["type"] == "Discrete":
        return {"type": "integer", "minimum": 0, "maximum": space["n"] - 1, "description": "an index"}
    if space["type"] == "MultiDiscrete":
        return {
            "type": "array",
            "prefixItems": [{"type": "integer", "minimum": 0, "maximum": n - 1} for n in space["nvec"]],
            "minItems": len(space["nvec"]),
            "maxItems": len(space["nvec"]),
            "description": "an index per component",
        }
    schema = _values(list(space["shape"]), space["low"], space["high"])
    return {**schema, "description": "a Box's values, within its bounds (GET /v1/spaces: low, high)"}


def _object(required: dict[str, Schema], optional: dict[str, Schema] | None = None, **extra: Any) -> Schema:
    return {
        "type": "object",
        "properties": {**required, **(optional or {})},
        "required": list(required),
        "additionalProperties": False,
        **extra,
    }


def _many(item: Schema) -> Schema:
    return {"type": "array", "items": item, "minItems": 1}


def _by_agent(agents: dict[str, Any], value: Any) -> Schema:
    """A multi-agent run's map from agent id to ``value(agent's spaces)``: any of its agents."""
    return {
        "type": "object",
        "properties": {agent: value(spaces) for agent, spaces in agents.items()},
        "additionalProperties": False,
    }


def _mask(spaces: dict[str, Any]) -> Schema:
    n = spaces["action"].get("n", 1)
    return _nested([n], {"type": "integer", "minimum": 0, "maximum": 1})


def _episode_values(spaces: dict[str, Any]) -> dict[str, Schema]:
    """An episode's observation, action, reward and done flag (one, and ``flags``: for many
    episodes), and ``per_agent``'s fields of an action request: for a multi-agent run
    (``spaces["agents"]``), maps by agent id."""
    agents = spaces.get("agents")
    if agents is None:
        flag: Schema = {"type": "boolean"}
        return {
            "observation": observation_schema(spaces["observation"]),
            "action": action_schema(spaces["action"]),
            "reward": {**NUMBER, "description": "added to the step under way (the previous action's outcome)"},
            "flag": flag,
            "flags": {"anyOf": [flag, _many(flag)], "description": "one for all, or one per episode"},
            "per_agent": {},
        }
    flag = {**_by_agent(agents, lambda _: {"type": "boolean"}), "description": "agents that finish here"}
    return {
        "observation": _by_agent(agents, lambda s: observation_schema(s["observation"])),
        "action": _by_agent(agents, lambda s: action_schema(s["action"])),
        "reward": {**_by_agent(agents, lambda _: NUMBER), "description": "each agent's, for its step under way"},
        "flag": {"anyOf": [{"type": "boolean"}, flag], "description": "for every agent, or by agent"},
        "flags": {"anyOf": [{"type": "boolean"}, _many({"type": "boolean"}), flag, _many(flag)]},
        "per_agent": {"terminated": flag, "truncated": flag, "action_mask": _by_agent(agents, _mask)},
    }


def component_schemas(spaces: dict[str, Any]) -> dict[str, Schema]:
    """Every request and reply body, named. A multi-agent run's (``spaces["agents"]``): an
    episode's observation, action, reward and done flags are maps by agent id, and an action
    request may say which agents finish at its observations and which actions are legal."""
    agents = spaces.get("agents")
    values = _episode_values(spaces)
    reward, flag, flags, per_agent = values["reward"], values["flag"], values["flags"], values["per_agent"]
    maybe_reward = {"anyOf": [reward, {"type": "null"}]}
    batch_per_agent = {
        ("action_masks" if name == "action_mask" else name): _many(schema) for name, schema in per_agent.items()
    }
    ids = _many({"type": "string", "maxLength": 64})
    observations = _many(_ref("Observation"))
    batch_end = _object(
        {"episode_ids": ids, "observations": observations},
        {"terminated": flags, "truncated": flags, "rewards": _many(reward)},
    )
    return {
        "Observation": values["observation"],
        "Action": values["action"],
        "Error": _object({"error": {"type": "string"}}),
        "Empty": _object({}),
        "Document": {"type": "object", "required": ["openapi", "paths"]},
        "Spaces": {
            "type": "object",
            "required": ["observation", "action", "frame_stack"] if agents is None else ["agents"],
            "properties": {
                "observation": {"type": "object"},
                "action": {"type": "object"},
                "frame_stack": {"type": "integer", "minimum": 1},
                "agents": {"type": "object", "description": "a multi-agent run's: each agent's policy and spaces"},
            },
        },
        "Health": {
            "type": "object",
            "required": ["status", "algo", "connected", "weights_version", "episodes_open", "env_steps"],
            "properties": {
                "status": {"enum": ["ok", "stopping"]},
                "algo": {"type": "string"},
                "connected": flag,
                "weights_version": {"type": "integer"},
                "episodes_open": {"type": "integer"},
                "env_steps": {"type": "integer"},
                "rejected_by_reason": {"type": "object", "additionalProperties": {"type": "integer"}},
            },
        },
        "StartRequest": _object({}, {"count": {"type": "integer", "minimum": 1}}),
        "StartReply": {
            "oneOf": [_object({"episode_id": {"type": "string"}}), _object({"episode_ids": _many({"type": "string"})})]
        },
        "ActionRequest": _object({"observation": _ref("Observation")}, {"reward": maybe_reward, **per_agent}),
        "ActionReply": _object({"action": _ref("Action")}),
        "LogActionRequest": _object(
            {"observation": _ref("Observation"), "action": _ref("Action")}, {"reward": maybe_reward, **per_agent}
        ),
        "RewardsRequest": _object({"reward": reward}),
        "EndRequest": _object(
            {"observation": {**_ref("Observation"), "description": "the final observation"}},
            {"terminated": flag, "truncated": flag, "reward": maybe_reward},
        ),
        "BatchActionRequest": _object(
            {"episode_ids": ids, "observations": observations},
            {
                "rewards": _many(reward),
                **({} if agents else {"end": {**batch_end, "description": "episodes that end first"}}),
                **batch_per_agent,
            },
        ),
        "BatchActionReply": _object({"actions": _many(_ref("Action"))}),
        "BatchLogActionRequest": _object(
            {"episode_ids": ids, "observations": observations, "actions": _many(_ref("Action"))},
            {"rewards": _many(reward), **batch_per_agent},
        ),
        "BatchRewardsRequest": _object({"episode_ids": ids, "rewards": _many(reward)}),
        "BatchEndRequest": batch_end,
    }


# path -> (method, summary, request body or None, reply body)
ENDPOINTS: dict[str, tuple[str, str, str | None, str]] = {
    "/v1/spaces": ("get", "the run's observation and action spaces", None, "Spaces"),
    "/v1/health": ("get", "the server's state and counts", None, "Health"),
    "/v1/schema": ("get", "this document", None, "Document"),
    "/v1/episodes": ("post", "start one episode, or `count` of them", "StartRequest", "StartReply"),
    "/v1/episodes/{id}/action": ("post", "the policy's action for an observation", "ActionRequest", "ActionReply"),
    "/v1/episodes/{id}/log_action": ("post", "an action the client chose", "LogActionRequest", "Empty"),
    "/v1/episodes/{id}/rewards": ("post", "a reward for the step under way", "RewardsRequest", "Empty"),
    "/v1/episodes/{id}/end": ("post", "the episode's end at its final observation", "EndRequest", "Empty"),
    "/v1/batch/action": ("post", "actions for many episodes", "BatchActionRequest", "BatchActionReply"),
    "/v1/batch/log_action": ("post", "actions many episodes' clients chose", "BatchLogActionRequest", "Empty"),
    "/v1/batch/rewards": ("post", "rewards for many episodes", "BatchRewardsRequest", "Empty"),
    "/v1/batch/end": ("post", "many episodes' ends", "BatchEndRequest", "Empty"),
}
ERRORS = {
    "400": "a malformed request (a wrong field, shape or value)",
    "401": "a missing or wrong bearer token",
    "404": "no such episode (ended, expired or never started) or endpoint",
    "409": "out of order (a reward before an action; past the time limit) or not taken (log_action)",
    "429": "too many episodes open",
    "503": "the learner takes no data now, or the server's limits are spent: retry",
}


def _json(name: str) -> Schema:
    return {"content": {"application/json": {"schema": _ref(name)}}}


def openapi(spaces: dict[str, Any]) -> Schema:
    """The OpenAPI 3.1 document of the HTTP API for a run of these spaces."""
    paths: dict[str, Schema] = {}
    for path, (method, summary, request, reply) in ENDPOINTS.items():
        operation: Schema = {
            "summary": summary,
            "responses": {
                "200": {"description": "done", **_json(reply)},
                **{status: {"description": why, **_json("Error")} for status, why in ERRORS.items()},
            },
        }
        if request is not None:
            operation["requestBody"] = {"required": request != "StartRequest", **_json(request)}
        if "{id}" in path:
            operation["parameters"] = [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}]
        paths[path] = {method: operation}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "apex serve",
            "version": __version__,
            "description": "External agents: environments stepped by clients ask for the policy's actions "
            "and report rewards; every refusal is {'error': ...} with its status and changes nothing.",
        },
        "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
        "components": {
            "schemas": component_schemas(spaces),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],
        "paths": paths,
    }
