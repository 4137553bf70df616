"""apex.serve.teams without sockets: a multi-agent simulator stepped by a client makes the same
data, policy by policy, as MultiAgentActor makes stepping it itself; agents join and finish
inside an episode; and a bad request, for any agent of any episode in it, moves nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apex import algos
from apex.algos.impala import learner as impala
from apex.config import load_dict
from apex.envs.policy_map import multi_agent_spec
from apex.multiagent.learner import MultiPolicyLearner
from apex.serve.request_checks import RequestError, actions_json
from apex.serve.teams import ExternalTeams
from apex.serve.welcome import external_teams
from tests.multiagent_envs import Relay, meet, spread


def served(max_episodes: int = 4, **sections) -> ExternalTeams:
    """ExternalTeams as apex serve makes them from a multi-agent learner's welcome."""
    config = load_dict(sections)
    learner = MultiPolicyLearner(config, multi_agent_spec(config), torch.device("cpu"))
    setup = {"config": {}, "num_envs": 2, "seed": 0, **learner.actor_setup(0, 2)}
    return external_teams(config, setup, algos.get(config.algo).actor(), max_episodes, 10.0, max_episodes)


def play(teams: ExternalTeams, env, episodes: int = 1, seed: int = 0) -> list[dict]:
    """A client's loop over a PettingZoo ParallelEnv: every request carries what the env gave."""
    replies = []
    for e in range(episodes):
        observations, _ = env.reset(seed=seed + e)
        (team,) = teams.start(1, "client")
        rewards: dict = {}
        terminated: dict = {}
        truncated: dict = {}
        while env.agents:
            actions = teams.act([team], [observations], [rewards], terminated=[terminated], truncated=[truncated])[0]
            replies.append(actions)
            observations, rewards, terminated, truncated, _ = env.step(actions)
        teams.end([team], [observations], [terminated], [truncated], [rewards])
    return replies


def test_an_agent_that_finishes_early_and_one_that_joins_later_make_what_a_local_actor_makes():
    """The relay's agents as in test_multi_agent's local test: `early` plays steps 1-3, `late`
    joins after step 2 and plays to step 6; three transitions and four, each its own policy's."""
    teams = served(
        env={"id": "tests.multiagent_envs:relay"},
        multi_agent={"mapping": "per_agent"},
        apex_dqn={"n_step": 1, "chunk_transitions": 1000, "eval_envs": 2},  # both teams on evaluation rungs
    )
    replies = play(teams, Relay())
    assert [sorted(r) for r in replies] == [["early"]] * 2 + [["early", "late"]] + [["late"]] * 3
    made = teams.take_batches(flush=True)
    transitions = {info["policy"]: len(batch["action"]) for batch, info in made}
    assert transitions == {"early": 3, "late": 4}
    records = {info["policy"]: info["episodes"] for _, info in made}
    assert records == {"early": [[3.0, 3, True]], "late": [[4.0, 4, True]]}
    assert made[0][1]["teams"] == [[3.5, 6, True]] and made[1][1]["teams"] == []
    assert not teams.episodes and teams.finished == 1


def test_a_shared_policy_acts_for_both_agents_and_its_stream_holds_both_agents_steps():
    teams = served(env={"id": "tests.multiagent_envs:meet"}, apex_dqn={"n_step": 1, "chunk_transitions": 1000})
    replies = play(teams, meet(), episodes=3)
    assert all(sorted(r) == ["a_0", "a_1"] and all(a in (0, 1, 2) for a in r.values()) for r in replies)
    ((batch, info),) = teams.take_batches(flush=True)
    assert info["policy"] == "shared" and len(batch["action"]) == 2 * len(replies)
    assert len(info["teams"]) == 3 and all(record[1] >= 1 for record in info["teams"])
    assert actions_json([replies[0]]) == [{agent: int(a) for agent, a in replies[0].items()}]


def test_a_bad_value_for_any_agent_of_any_episode_refuses_the_whole_request():
    teams = served(env={"id": "tests.multiagent_envs:meet"}, multi_agent={"mapping": "per_agent"})
    first, second = teams.start(2, "client")
    good = {"a_0": [0.0] * 20, "a_1": [0.0] * 20}
    teams.act([first, second], [good, good])
    steps = teams.steps

    def refused(status: int, words: str, *args, **kwargs) -> None:
        with pytest.raises(RequestError, match=words) as error:
            teams.act(*args, **kwargs)
        assert error.value.status == status
        assert teams.steps == steps and all(e.acted for e in teams.episodes[first].state.agents.values())

    refused(400, "no agent 'a_9'", [first, second], [good, {**good, "a_9": [0.0] * 20}])
    refused(400, "agent 'a_1'.*outside", [first, second], [good, {**good, "a_1": [2.0] * 20}])
    refused(400, "a list of 2 maps", [first, second], [good])
    refused(400, "final observation", [first], [{"a_0": [0.0] * 20}], terminated=[{"a_1": True}])
    refused(400, "true or false", [first], [good], terminated=[{"a_0": 1}])
    refused(400, "action mask", [first], [good], action_masks=[{"a_0": [0, 0, 0]}])
    refused(400, "action mask", [first], [good], action_masks=[{"a_0": [1, 1]}])
    refused(400, "reward", [first], [good], [{"a_0": float("nan")}])
    refused(404, "no open episode", [first, "nope"], [good, good])
    refused(400, "single-agent", [first], [good], None, {"episode_ids": [second], "observations": [good]})
    with pytest.raises(RequestError, match="has no action out") as error:
        teams.act([teams.start(1, "c")[0]], [good], [{"a_0": 1.0}])
    assert error.value.status == 409
    with pytest.raises(RequestError, match="learns on-policy"):
        served(algo="impala", env={"id": "tests.multiagent_envs:meet"}).log_action(["x"], [good], [{}])
    # a masked agent acts within its mask
    for _ in range(20):
        (reply,) = teams.act([first], [good], action_masks=[{"a_0": [0, 0, 1], "a_1": [1, 0, 0]}])
        assert reply == {"a_0": 2, "a_1": 0}


def meet_team_after_one_step() -> tuple[ExternalTeams, str, dict[str, list[float]]]:
    """Meet's two agents on a policy each (one-step transitions, kept until flushed), one team
    that has taken one step, and the observation it took it at."""
    teams = served(
        env={"id": "tests.multiagent_envs:meet"},
        multi_agent={"mapping": "per_agent"},
        apex_dqn={"n_step": 1, "chunk_transitions": 1000},
    )
    (team,) = teams.start(1, "client")
    obs = {"a_0": [0.0] * 20, "a_1": [0.0] * 20}
    teams.act([team], [obs])
    return teams, team, obs


def test_end_finishes_the_agents_given_and_lets_the_others_go_at_their_last_observation():
    teams, team, obs = meet_team_after_one_step()
    for _ in range(2):
        teams.act([team], [obs], [{"a_0": 1.0, "a_1": 0.5}])
    teams.end([team], [{"a_0": [0.0] * 20}], {"a_0": True}, False, [{"a_0": 1.0, "a_1": 0.5}])
    made = {info["policy"]: (batch, info) for batch, info in teams.take_batches(flush=True)}
    # a_0: three steps, its last terminal; a_1: two (its third has no next observation)
    assert len(made["a_0"][0]["action"]) == 3 and made["a_0"][0]["discount"][-1] == 0  # terminal
    assert len(made["a_1"][0]["action"]) == 2 and (made["a_1"][0]["discount"] > 0).all()
    teams_records = [r for _, info in made.values() for r in info["teams"]]
    assert teams_records == [[(3.0 + 1.5) / 2, 3, True]]


def test_end_after_every_agent_finished_in_action_requests_closes_the_episode_once():
    teams, team, obs = meet_team_after_one_step()
    done = {"a_0": True, "a_1": True}
    assert teams.act([team], [obs], [{"a_0": 1.0, "a_1": 1.0}], terminated=[done]) == [{}]
    teams.end([team], [obs], done, False)  # the same final observations again: nothing finishes twice
    made = {info["policy"]: batch for batch, info in teams.take_batches(flush=True)}
    assert {name: len(batch["action"]) for name, batch in made.items()} == {"a_0": 1, "a_1": 1}
    with pytest.raises(RequestError, match="never played") as error:
        teams.end([teams.start(1, "client")[0]], [{"a_0": [0.0] * 20}], True, False)
    assert error.value.status == 409


def test_recurrent_continuous_agents_get_bounded_actions_and_their_unrolls_pass_the_learners_schema():
    teams = served(
        algo="impala",
        env={"id": "tests.multiagent_envs:spread", "action_bounds": "squash"},
        model={"recurrent": "lstm", "lstm_size": 8},
        impala={"unroll_length": 5},
    )
    replies = play(teams, spread(), episodes=2)
    assert all(np.all((np.asarray(a) >= 0) & (np.asarray(a) <= 1)) for r in replies for a in r.values())
    made = teams.take_batches(flush=True)
    assert made
    spec = teams.team_spec.policies["shared"].spec
    for batch, info in made:
        impala.batch_schema(spec, teams.config).validate(batch, impala.batch_limits(6, spec, teams.config))
        assert info["policy"] == "shared" and batch["core_h"].shape[1] == 8


def test_weights_reach_each_policy_and_a_weight_for_no_policy_is_refused():
    from apex.errors import ProtocolError
    from apex.wire.protocol import Message

    sections = {"env": {"id": "tests.multiagent_envs:meet"}, "multi_agent": {"mapping": "per_agent"}}
    learner = MultiPolicyLearner(load_dict(sections), multi_agent_spec(load_dict(sections)), torch.device("cpu"))
    teams = served(**sections)
    obs = {"a_0": [0.0] * 20, "a_1": [1.0] * 20}
    (team,) = teams.start(1, "client")
    before = teams.act([team], [obs])[0]
    arrays = {key: np.zeros_like(array) for key, array in learner.weights().items()}  # every Q-value 0
    teams.actor.set_weights(Message("weights", {"version": 7}, arrays))
    assert teams.actor.weights_version == 7
    assert {name: core.weights_version for name, core in teams.cores.items()} == {"a_0": 7, "a_1": 7}
    with pytest.raises(ProtocolError, match="unknown policy"):
        teams.actor.set_weights(Message("weights", {"version": 8}, {**arrays, "nobody/w": np.zeros(1)}))
    assert teams.actor.weights_version == 7 and sorted(before) == ["a_0", "a_1"]
