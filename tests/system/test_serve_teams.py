"""`apex serve` for a multi-agent run, through real processes: a client steps the relay (agent
`early` plays steps 1-3, `late` joins after step 2 and plays to step 6), every request a map
by agent id, over HTTP and ZeroMQ; each agent's policy gets its own stream at the learner,
every request and reply fits `GET /v1/schema`, and a bad value for any agent refuses the whole
request."""

from __future__ import annotations

import json

import jsonschema
import pytest

from apex.client import PolicyClient, PolicyServerError
from tests.multiagent_envs import Relay
from tests.support.processes import rss_mib, wait_for
from tests.support.runs import metrics
from tests.system.test_serve import TOKEN, start_served, stop


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    served = start_served(
        tmp_path_factory.mktemp("serve-teams"),
        extra=("--allow-import", "tests.multiagent_envs"),
        learner_args=("--env", "tests.multiagent_envs:relay", "--set", "multi_agent.mapping=per_agent"),
    )
    yield served
    stop(served)


def fits(document: dict, name: str, value) -> bool:
    schema = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def test_the_relay_over_http_gives_each_agents_policy_its_own_stream_and_fits_the_schema(served):
    status, spaces = served.http("GET", "/v1/spaces")
    assert status == 200 and {a: s["policy"] for a, s in spaces["agents"].items()} == {"early": "early", "late": "late"}
    status, document = served.http("GET", "/v1/schema")
    assert status == 200
    for schema in document["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    env = Relay()
    for seed in range(2):
        observations, _ = env.reset(seed=seed)
        status, started = served.http("POST", "/v1/episodes")
        episode = started["episode_id"]
        body: dict = {"observation": {a: o.tolist() for a, o in observations.items()}}
        acting = []
        while env.agents:
            assert fits(document, "ActionRequest", body), body
            status, reply = served.http("POST", f"/v1/episodes/{episode}/action", body)
            assert status == 200 and fits(document, "ActionReply", reply), reply
            acting.append(sorted(reply["action"]))
            observations, rewards, terminated, truncated, _ = env.step(reply["action"])
            body = {
                "observation": {a: o.tolist() for a, o in observations.items()},
                "reward": rewards,
                "terminated": terminated,
                "truncated": truncated,
            }
        assert acting == [["early"]] * 2 + [["early", "late"]] + [["late"]] * 3
        end = {"observation": body["observation"], "terminated": terminated, "reward": rewards}
        assert fits(document, "EndRequest", end)
        status, reply = served.http("POST", f"/v1/episodes/{episode}/end", end)
        assert status == 200, reply
    assert fits(document, "Spaces", spaces) and not fits(document, "ActionRequest", {"observation": {"x": [0.0]}})
    health = served.health()
    assert health["episodes_finished"] == 2 and health["env_steps"] == 2 * (3 + 4)

    def streams() -> dict:
        rows = metrics(served.logdir)
        return rows[-1].get("policies", {}) if rows else {}

    # each policy's own episodes, and the team's return (the mean of its agents', 3.5)
    wait_for(lambda: all(streams().get(p, {}).get("episodes") == 2 for p in ("early", "late")), 30, "both streams")
    row = metrics(served.logdir)[-1]
    assert row["train_return_mean_100"] == pytest.approx(3.5)
    # three transitions an episode for early, four for late, each in its own policy's replay
    assert {p: (f["train_return_mean_100"], f["inserted"]) for p, f in row["policies"].items()} == {
        "early": (3.0, 6),
        "late": (4.0, 8),
    }


def test_over_zeromq_a_bad_value_for_any_agent_refuses_the_request_and_nothing_moves(served):
    with PolicyClient(f"127.0.0.1:{served.zmq_port}", token=TOKEN) as client:
        first, second = client.start_episodes(2)
        one = {"early": [0.0]}
        actions = client.get_actions([first, second], [one, one])
        assert [sorted(a) for a in actions] == [["early"], ["early"]] and actions[0]["early"] in (0, 1)
        before = client.health()
        steps = before["env_steps"]
        cases = [
            ([one, {"early": [0.0], "nobody": [0.0]}], {}, 400, "no agent 'nobody'"),
            ([one, {"early": [99.0]}], {}, 400, "agent 'early'"),  # outside its Box(0, 10)
            ([one, one], {"terminated": [{"late": True}, {}]}, 400, "final observation"),
            ([one, one], {"action_masks": [{"early": [1, 1, 1]}, {}]}, 400, "action mask"),
            ([one, {}], {}, 400, "at least one agent"),
        ]
        for observations, fields, status, words in cases:
            with pytest.raises(PolicyServerError, match=words) as error:
                client.get_actions([first, second], observations, **fields)
            assert error.value.status == status
        after = client.health()
        assert after["env_steps"] == steps  # none of them moved an episode
        counted = sum(after["rejected_by_reason"].values()) - sum(before["rejected_by_reason"].values())
        assert counted == len(cases) and "internal" not in after["rejected_by_reason"], after["rejected_by_reason"]
        # an agent that finishes while another acts; the episode then ends
        reply = client.get_action(first, {"early": [1.0]}, {"early": 1.0}, action_mask={"early": [0, 1]})
        assert reply == {"early": 1}
        client.end_episodes([first, second], [{"early": [2.0]}, {}], [{"early": True}, {}], [False, False])
        assert client.health()["env_steps"] == steps + 2


def test_an_agent_that_ended_in_a_team_episode_can_neither_act_nor_end_again(served):
    with PolicyClient(f"127.0.0.1:{served.zmq_port}", token=TOKEN) as client:
        (team,) = client.start_episodes(1)
        client.get_action(team, {"early": [0.0]})
        client.get_action(team, {"early": [1.0], "late": [1.0]}, terminated={"early": True})  # early ends, late acts
        steps = client.health()["env_steps"]
        for fields in ({}, {"terminated": {"early": True}}):
            with pytest.raises(PolicyServerError, match="agent 'early' has ended in it") as error:
                client.get_action(team, {"early": [2.0], "late": [2.0]}, **fields)
            assert error.value.status == 409
        assert client.health()["env_steps"] == steps  # nothing moved: late's step was refused with it
        assert client.get_action(team, {"late": [2.0]}).keys() == {"late"}  # the others play on
        client.end_episodes([team], [{"late": [3.0]}], [{"late": True}], [False])


def test_hostile_team_requests_are_each_a_clear_4xx_and_move_nothing(served):
    """The attacks of issue 46 on serve's teams, over HTTP: a map of 10,000 agents, masks of
    the wrong shape or allowing nothing, one episode twice in a request, an agent acting after
    its team ended, two teams' requests interleaved. Each is refused with the status and words
    that name it, no step is counted for any refused request, the server's memory stays put,
    and the interleaved teams each end with their own steps."""
    _, started = served.http("POST", "/v1/episodes")
    team = started["episode_id"]
    path = f"/v1/episodes/{team}/action"
    assert served.http("POST", path, {"observation": {"early": [0.0]}})[0] == 200
    steps, memory = served.health()["env_steps"], rss_mib(served.serve.pid)
    attacks = {
        "10,000 agents": ({"observation": {f"a{i}": [0.0] for i in range(10_000)}}, 413, "request body over"),
        "5,000 agents": ({"observation": {f"a{i}": [0.0] for i in range(5_000)}}, 400, "no agent 'a0'"),
        "a mask of the wrong shape": (
            {"observation": {"early": [1.0]}, "action_mask": {"early": [1, 1, 1]}},
            400,
            "mask",
        ),
        "a mask allowing nothing": ({"observation": {"early": [1.0]}, "action_mask": {"early": [0, 0]}}, 400, "mask"),
        "a mask for an agent that does not act": (
            {"observation": {"early": [1.0]}, "action_mask": {"late": [1, 1]}},
            400,
            "action_masks",
        ),
    }
    for name, (body, status, words) in attacks.items():
        got, reply = served.http("POST", path, body)
        assert got == status and words in json.dumps(reply), (name, got, reply)
    for _ in range(20):  # a flood of the biggest that is parsed costs no memory that stays
        served.http("POST", path, attacks["5,000 agents"][0])
    assert rss_mib(served.serve.pid) - memory < 16
    got, reply = served.http(
        "POST", "/v1/batch/action", {"episode_ids": [team, team], "observations": [{"early": [1.0]}] * 2}
    )
    assert got == 400 and "twice" in json.dumps(reply), reply
    assert served.health()["env_steps"] == steps  # none of it moved a step

    # two teams, their requests interleaved; then one team's id after it ended
    _, other = served.http("POST", "/v1/episodes")
    second = other["episode_id"]
    for t in range(1, 3):
        for episode in (team, second):
            body: dict = {"observation": {"early": [float(t)]}}
            if episode == team or t > 1:  # a reward is for an action out
                body["reward"] = {"early": 1.0}
            got, reply = served.http("POST", f"/v1/episodes/{episode}/action", body)
            assert got == 200 and reply["action"].keys() == {"early"}, reply
    for episode in (team, second):
        end = {"observation": {"early": [3.0]}, "terminated": {"early": True}, "reward": {"early": 1.0}}
        assert served.http("POST", f"/v1/episodes/{episode}/end", end)[0] == 200
    # a step counts when the next observation closes it: team's three (the one before and its
    # two), second's two; a request applied to the wrong team would move these
    assert served.health()["env_steps"] == steps + 5
    got, reply = served.http("POST", path, {"observation": {"early": [4.0]}})
    assert got == 404 and "no open episode" in reply["error"], reply
