"""`GET /v1/schema`: the OpenAPI 3.1 document of `apex serve`'s HTTP API, checked against what
a real server takes and answers: every request an honest client sends and every reply (errors
too) fits its schema, and requests the server refuses mostly do not."""

from __future__ import annotations

import jsonschema
import pytest

from tests.system.test_serve import TOKEN, start_served, stop


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = start_served(tmp_path_factory.mktemp("serve-schema"))
    yield served
    stop(served)


@pytest.fixture(scope="module")
def document(served):
    status, document = served.http("GET", "/v1/schema")
    assert status == 200
    return document


def fits(document: dict, name: str, value) -> bool:
    """Whether ``value`` fits the component schema ``name``."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def exchange(served, document: dict, path: str, request: str | None, reply: str, body=None) -> dict:
    """One request whose body fits ``request`` and whose 200 reply fits ``reply``."""
    if request is not None:
        assert fits(document, request, body), (request, body)
    status, answer = served.http("GET" if request is None else "POST", path, body)
    assert status == 200, answer
    assert fits(document, reply, answer), (reply, answer)
    return answer


def test_the_document_names_every_endpoint_and_is_valid_json_schema(document):
    assert document["openapi"].startswith("3.1")
    assert {"/v1/spaces", "/v1/health", "/v1/episodes", "/v1/episodes/{id}/action", "/v1/batch/end"} <= set(
        document["paths"]
    )
    for schema in document["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    # the run's spaces written out: CartPole's 4 floats and 2 actions
    assert document["components"]["schemas"]["Observation"]["minItems"] == 4
    assert document["components"]["schemas"]["Action"]["maximum"] == 1


def test_every_request_and_reply_of_honest_episodes_fits_the_schema(served, document):
    import gymnasium as gym

    exchange(served, document, "/v1/spaces", None, "Spaces")
    exchange(served, document, "/v1/health", None, "Health")
    env = gym.make("CartPole-v1")
    obs, _ = env.reset(seed=0)
    episode = exchange(served, document, "/v1/episodes", "StartRequest", "StartReply", {})["episode_id"]
    path = f"/v1/episodes/{episode}"
    action = exchange(served, document, f"{path}/action", "ActionRequest", "ActionReply", {"observation": obs.tolist()})
    obs, reward, *_ = env.step(action["action"])
    exchange(served, document, f"{path}/rewards", "RewardsRequest", "Empty", {"reward": reward})
    exchange(
        served, document, f"{path}/log_action", "LogActionRequest", "Empty", {"observation": obs.tolist(), "action": 0}
    )
    obs, *_ = env.step(0)
    end = {"observation": obs.tolist(), "terminated": False, "truncated": True, "reward": 1.0}
    exchange(served, document, f"{path}/end", "EndRequest", "Empty", end)
    ids = exchange(served, document, "/v1/episodes", "StartRequest", "StartReply", {"count": 3})["episode_ids"]
    observations = [[0.01 * i, 0.0, 0.0, 0.0] for i in range(3)]
    batch = {"episode_ids": ids, "observations": observations}
    exchange(served, document, "/v1/batch/action", "BatchActionRequest", "BatchActionReply", batch)
    exchange(
        served,
        document,
        "/v1/batch/rewards",
        "BatchRewardsRequest",
        "Empty",
        {"episode_ids": ids, "rewards": [1.0] * 3},
    )
    logged = {**batch, "actions": [1, 0, 1], "rewards": [0.0] * 3}
    exchange(served, document, "/v1/batch/log_action", "BatchLogActionRequest", "Empty", logged)
    ending = {"episode_ids": ids[:1], "observations": observations[:1], "terminated": [True], "rewards": [1.0]}
    asked = {"episode_ids": ids[1:], "observations": observations[1:], "end": ending}
    exchange(served, document, "/v1/batch/action", "BatchActionRequest", "BatchActionReply", asked)
    ended = {"episode_ids": ids[1:], "observations": observations[1:], "terminated": True}
    exchange(served, document, "/v1/batch/end", "BatchEndRequest", "Empty", ended)


@pytest.mark.parametrize(
    "body",
    [
        {"observation": [0.0, 0.0, 0.0]},  # a wrong shape
        {"observation": [0.0, 0.0, 9.0, 0.0]},  # outside the observation space
        {"observation": "four numbers"},
        {"observation": [0.0] * 4, "reward": "one"},
        {"observation": [0.0] * 4, "typo": 1},
    ],
)
def test_a_request_that_does_not_fit_the_schema_is_refused_with_an_error_that_does(served, document, body):
    assert not fits(document, "ActionRequest", body)
    (episode,) = served.http("POST", "/v1/episodes", {"count": 1})[1]["episode_ids"]
    status, reply = served.http("POST", f"/v1/episodes/{episode}/action", body)
    assert status == 400 and fits(document, "Error", reply), reply


def test_the_schema_needs_the_token_as_every_endpoint(served):
    status, reply = served.http("GET", "/v1/schema", token=None)
    assert status == 401 and "token" in reply["error"]
    assert served.http("GET", "/v1/schema", token=TOKEN)[0] == 200
