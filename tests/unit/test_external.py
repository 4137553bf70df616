"""apex.serve.episodes and the algorithms' episode actors without sockets: what external episodes
become (n-step transitions, unrolls) and that every bad request is refused before it
changes anything."""

from __future__ import annotations

import numpy as np
import pytest

from apex import config as config_module
from apex.algos.apex_dqn import learner as apex_dqn
from apex.algos.apex_dqn.actor import ApexDqnEpisodeActor
from apex.algos.apex_dqn.exploration import actor_epsilons
from apex.algos.impala import learner as impala
from apex.algos.impala.episode_actor import ImpalaEpisodeActor
from apex.envs.make import env_spaces
from apex.serve.episodes import ExternalEpisodes, RequestError

K = 4  # the session's num_envs: rungs (Ape-X), unrolls per batch (IMPALA)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(algo: str, clock=None, max_episodes: int = 8, max_per_client: int | None = None, **sets) -> ExternalEpisodes:
    overrides = [
        f"algo={algo}",
        f"{algo}.gamma=0.9",
        "apex_dqn.n_step=3",
        "apex_dqn.chunk_transitions=4",
        "impala.unroll_length=4",
        f"actor.num_envs={K}",
        *(f"{k}={v}" for k, v in sets.items()),
    ]
    config = config_module.load(None, overrides)
    spec, low, high = env_spaces(config.env, algo)
    if algo == "apex_dqn":
        epsilons, eval_mask = actor_epsilons(0, K, config.apex_dqn)
        actor = ApexDqnEpisodeActor(config, {"epsilons": epsilons, "eval_envs": eval_mask}, spec, 0)
    else:
        actor = ImpalaEpisodeActor(config, {"num_envs": K}, spec, 0)
    return ExternalEpisodes(
        config,
        spec,
        low,
        high,
        actor,
        max_episodes=max_episodes,
        episode_timeout_s=10.0,
        max_per_client=max_per_client,
        clock=clock or Clock(),
    )


def obs(t: float) -> list[float]:
    return [0.1 * t, 0.0, 0.0, 0.0]  # CartPole observations, told apart by their first value


def play(
    episodes: ExternalEpisodes,
    episode_id: str,
    steps: int,
    *,
    first: int = 0,
    terminated: bool = True,
    truncated: bool = False,
) -> None:
    """An episode of ``steps`` steps with reward t + 1 at step t, observations obs(first + t)."""
    for t in range(steps):
        episodes.act([episode_id], [obs(first + t)], None if t == 0 else [float(t)])
    episodes.end([episode_id], [obs(first + steps)], [terminated], [truncated], [float(steps)])


def validate(algo: str, episodes: ExternalEpisodes, batch: dict) -> None:
    module = apex_dqn if algo == "apex_dqn" else impala
    module.batch_schema(episodes.spec, episodes.config).validate(
        batch, module.batch_limits(K, episodes.spec, episodes.config)
    )


def test_apex_episode_makes_the_n_step_transitions_a_local_actor_would():
    episodes = make("apex_dqn")
    (episode_id,) = episodes.start()
    play(episodes, episode_id, 6)
    ((batch, records),) = episodes.take(flush=True)
    validate("apex_dqn", episodes, batch)
    rewards = np.arange(1.0, 7.0)
    order = np.argsort(batch["frames"][batch["obs_frame"], 0])
    for i, t in enumerate(range(6)):
        row = order[i]
        expected = sum(0.9**k * rewards[t + k] for k in range(3) if t + k < 6)
        assert batch["reward"][row] == pytest.approx(expected, rel=1e-6)
        assert batch["discount"][row] == pytest.approx(0.9**3 if t + 3 < 6 else 0.0)
        assert batch["frames"][batch["obs_frame"][row], 0] == pytest.approx(0.1 * t)
        assert batch["frames"][batch["next_obs_frame"][row], 0] == pytest.approx(0.1 * min(t + 3, 6))
    assert records == [[21.0, 6, records[0][2]]]  # 1 + 2 + ... + 6 over 6 steps
    assert episodes.steps == 6 and episodes.finished == 1 and not episodes.episodes


def test_apex_learns_from_logged_actions_and_keeps_them_out_of_evaluation():
    episodes = make("apex_dqn", **{"apex_dqn.eval_envs": K})  # every rung an evaluation one
    (episode_id,) = episodes.start()
    episodes.log_action([episode_id], [obs(0)], [1])
    episodes.log_action([episode_id], [obs(1)], [0], [1.0])
    episodes.end([episode_id], [obs(2)], [True], [False], [1.0])
    ((batch, records),) = episodes.take(flush=True)
    assert sorted(batch["action"].tolist()) == [0, 1]
    assert records == [[2.0, 2, False]]
    with pytest.raises(RequestError, match="actions must be in 0..1") as error:
        episodes.log_action(episodes.start(), [obs(0)], [2])
    assert error.value.status == 400


def test_impala_episodes_share_a_slot_row_as_local_environments_reset_within_an_unroll():
    episodes = make("impala", max_episodes=1)  # one slot: the second episode continues the row
    first = episodes.start()[0]
    play(episodes, first, 6)
    second = episodes.start()[0]
    for t in range(3):
        episodes.act([second], [obs(10 + t)], None if t == 0 else [1.0])
    ((batch, records),) = episodes.take(flush=True)
    validate("impala", episodes, batch)
    assert batch["action"].shape == (2, 4)
    seen = batch["frames"][batch["obs_frame"], 0] / 0.1  # [unrolls, T + 1] observation indices
    np.testing.assert_allclose(seen, [[0, 1, 2, 3, 4], [4, 5, 10, 11, 12]], atol=1e-5)
    np.testing.assert_allclose(batch["reward"], [[1, 2, 3, 4], [5, 6, 1, 1]])
    np.testing.assert_allclose(batch["discount"], [[0.9] * 4, [0.9, 0.0, 0.9, 0.9]])
    assert records == [[21.0, 6, True]]  # with the unroll that holds the episode's last step


def test_impala_refuses_client_chosen_actions_and_bootstraps_a_time_limit():
    episodes = make("impala")
    (episode_id,) = episodes.start()
    with pytest.raises(RequestError, match="on-policy") as error:
        episodes.log_action([episode_id], [obs(0)], [0])
    assert error.value.status == 409
    episodes.act([episode_id], [obs(0)])
    slot = episodes.episodes[episode_id].slot
    episodes.end([episode_id], [obs(1)], [False], [True], [1.0])
    value = float(episodes.actor.net(np.asarray([[obs(1)]], np.float32))[1][0])
    row = episodes.actor._rows[slot]
    # a time limit: no future in the unroll (discount 0), its worth gamma * V(final) in the reward
    assert row.t == 1 and row.discount[0] == 0.0
    assert row.reward[0] == pytest.approx(1.0 + 0.9 * value, rel=1e-5)


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_bad_requests_are_refused_before_anything_changes(algo):
    episodes = make(algo)
    good, other = episodes.start(2)
    episodes.act([good], [obs(0)])
    before = (episodes.steps, episodes.episodes[good].length, episodes.episodes[good].reward)
    cases = [
        (lambda: episodes.act([good], [[0.0, 0.0, 0.0]]), 400, "shape"),
        (lambda: episodes.act([good], [[0.0, float("nan"), 0.0, 0.0]]), 400, "finite"),
        (lambda: episodes.act([good], [[9.0, 0.0, 0.0, 0.0]]), 400, "outside the observation space"),
        (lambda: episodes.act([good], [["a", "b", "c", "d"]]), 400, "numbers"),
        (lambda: episodes.act([good, "nope"], [obs(1), obs(1)]), 404, "no open episode"),
        (lambda: episodes.act([good, good], [obs(1), obs(1)]), 400, "twice"),
        (lambda: episodes.act([good], [obs(1)], [float("inf")]), 400, "finite"),
        (lambda: episodes.act([good], [obs(1)], [1e7]), 400, "max_abs_reward"),
        (lambda: episodes.add_rewards([other], [1.0]), 409, "before its first action"),
        (lambda: episodes.end([good], [obs(1)], ["yes"], [False]), 400, "terminated"),
        (lambda: episodes.act([], []), 400, "non-empty"),
        (lambda: episodes.start(0), 400, "positive"),
        (lambda: episodes.start(100), 429, "--max-episodes"),
    ]
    for call, status, words in cases:
        with pytest.raises(RequestError, match=words) as error:
            call()
        assert error.value.status == status
    assert (episodes.steps, episodes.episodes[good].length, episodes.episodes[good].reward) == before
    assert len(episodes.episodes) == 2
    episodes.act([good], [obs(1)], [1.0])  # and the episode goes on
    assert episodes.steps == 1


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_an_act_request_that_carries_ends_makes_what_separate_requests_make(algo):
    """One round trip a step: episodes ended inside the next act request give the same data
    as an end request followed by an act request."""

    def run(combined: bool):
        episodes = make(algo)
        a, b = episodes.start(2)
        for t in range(3):
            episodes.act([a, b], [obs(t), obs(5 + t)], None if t == 0 else [1.0, 2.0])
        c = episodes.start()[0]
        ended = {"episode_ids": [a], "observations": [obs(3)], "terminated": [True], "rewards": [4.0]}
        if combined:
            episodes.act([b, c], [obs(8), obs(20)], [2.0, 0.0], ended=ended)
        else:
            episodes.end([a], [obs(3)], [True], [False], [4.0])
            episodes.act([b, c], [obs(8), obs(20)], [2.0, 0.0])
        episodes.end([b, c], [obs(9), obs(21)], False, True, [3.0, 1.0])
        return episodes, episodes.take(flush=True)

    separate, expected = run(False)
    together, got = run(True)
    assert (together.steps, together.finished) == (separate.steps, separate.finished) == (8, 3)
    assert [records for _, records in got] == [records for _, records in expected]
    for (batch, _), (want, _) in zip(got, expected, strict=True):
        validate(algo, together, batch)
        assert batch.keys() == want.keys()
        for name in want:  # IMPALA's behaviour_logp too: the same weights and the same draws
            np.testing.assert_allclose(batch[name], want[name], rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_an_act_request_with_ends_is_refused_whole(algo):
    episodes = make(algo)
    a, b = episodes.start(2)
    episodes.act([a, b], [obs(0), obs(1)])
    before = (episodes.steps, episodes.finished, len(episodes.episodes))
    end_a = {"episode_ids": [a], "observations": [obs(2)], "terminated": [True]}
    cases = [
        (lambda: episodes.act([b], [[0.0, 0.0]], ended=end_a), 400, "shape"),  # a bad act part: a does not end
        (lambda: episodes.act([b], [obs(2)], ended={**end_a, "observations": [[9.0, 0, 0, 0]]}), 400, "outside"),
        (lambda: episodes.act([b], [obs(2)], ended={**end_a, "episode_ids": ["nope"]}), 404, "no open episode"),
        (lambda: episodes.act([a], [obs(2)], ended=end_a), 400, "both in end"),
        (lambda: episodes.act([b], [obs(2)], ended={**end_a, "terminated": ["yes"]}), 400, "terminated"),
        (lambda: episodes.act([b], [obs(2)], ended={**end_a, "rewards": [1e9]}), 400, "max_abs_reward"),
        (lambda: episodes.act([b], [obs(2)], ended={**end_a, "extra": 1}), 400, "end must be a map"),
        (lambda: episodes.act([b], [obs(2)], ended=[a]), 400, "end must be a map"),
        (lambda: episodes.act([b], [obs(2)], ended={"episode_ids": [a]}), 400, "end must be a map"),
    ]
    for call, status, words in cases:
        with pytest.raises(RequestError, match=words) as error:
            call()
        assert error.value.status == status
        assert (episodes.steps, episodes.finished, len(episodes.episodes)) == before
    episodes.act([b], [obs(2)], [1.0], ended=end_a)
    assert (episodes.steps, episodes.finished, list(episodes.episodes)) == (2, 1, [b])


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_idle_episodes_expire_keeping_what_they_played(algo):
    clock = Clock()
    episodes = make(algo, clock=clock, max_episodes=2)
    idle, busy = episodes.start(2)
    for t in range(5):
        episodes.act([idle], [obs(t)], None if t == 0 else [1.0])
    clock.now += 5
    episodes.act([busy], [obs(0)])
    clock.now += 6  # idle: 11 s since its last request; busy: 6 s
    assert episodes.expire() == 1
    assert set(episodes.episodes) == {busy} and episodes.expired == 1
    with pytest.raises(RequestError, match="expired") as error:
        episodes.act([idle], [obs(6)], [1.0])
    assert error.value.status == 404
    assert episodes.start() and len(episodes.episodes) == 2  # its slot is free again
    if algo == "apex_dqn":
        ((batch, records),) = episodes.take(flush=True)
        assert len(batch["action"]) == 4 and records == []  # the 4 steps with an outcome, cut there
        validate(algo, episodes, batch)
        assert batch["discount"].min() > 0  # a time limit: bootstrapped, not terminal


def test_a_full_server_expires_idle_episodes_before_refusing_new_ones():
    clock = Clock()
    episodes = make("apex_dqn", clock=clock, max_episodes=2)
    episodes.start(2)
    with pytest.raises(RequestError) as error:
        episodes.start()
    assert error.value.status == 429
    clock.now += 11
    assert len(episodes.start()) == 1 and episodes.expired == 2


def test_one_client_cannot_hold_every_slot():
    """serve.max_episodes_per_client: a client at its cap gets 429 while another still gets
    episodes; an episode that ends, or expires, gives its client the room back."""
    clock = Clock()
    episodes = make("apex_dqn", clock=clock, max_episodes=8, max_per_client=3)
    greedy = episodes.start(3, "10.0.0.1")
    with pytest.raises(RequestError, match="serve.max_episodes_per_client") as error:
        episodes.start(1, "10.0.0.1")
    assert error.value.status == 429 and error.value.reason == "client_episodes"
    assert len(episodes.start(3, "10.0.0.2")) == 3  # another client is served
    episodes.act(greedy[:1], [obs(0)])
    episodes.end(greedy[:1], [obs(1)], [True], [False], [1.0])
    (replaced,) = episodes.start(1, "10.0.0.1")  # room for one again
    assert episodes.episodes[replaced].owner == "10.0.0.1"
    with pytest.raises(RequestError, match="holds 3 open episodes"):
        episodes.start(1, "10.0.0.1")
    clock.now += 11  # all 6 idle: expired, the room back
    assert len(episodes.start(3, "10.0.0.1")) == 3 and episodes.expired == 6


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_episodes_started_ahead_take_a_slot_only_when_they_act_and_expire_cleanly(algo):
    clock = Clock()
    episodes = make(algo, clock=clock, max_episodes=4)
    ahead = episodes.start(3)
    assert all(episodes.episodes[i].slot is None for i in ahead)
    (playing,) = episodes.start()
    episodes.act([playing], [obs(0)])
    episodes.end([playing], [obs(1)], [True], [False], [1.0])
    episodes.act([ahead[0]], [obs(0)])
    if algo == "impala":  # the slot the ended episode left, with its row under way
        assert episodes.episodes[ahead[0]].slot == 0 and episodes.actor._rows[0].t == 1
    clock.now += 11
    assert episodes.expire() == 3 and not episodes.episodes


def test_an_episode_is_stopped_at_the_envs_time_limit_so_that_the_learner_takes_its_batch():
    episodes = make("apex_dqn", **{"env.max_episode_steps": 5})
    (episode_id,) = episodes.start()
    for t in range(5):
        episodes.act([episode_id], [obs(t)], None if t == 0 else [1.0])
    with pytest.raises(RequestError, match="time limit") as error:
        episodes.act([episode_id], [obs(5)], [1.0])
    assert error.value.status == 409
    episodes.end([episode_id], [obs(5)], [False], [True], [1.0])
    ((batch, records),) = episodes.take(flush=True)
    assert records[0][1] == 5  # within the learner's 1..step_limit
    from apex.wire.schema import check_episodes

    check_episodes(
        {"episodes": records},
        max_episodes=len(batch["action"]),
        step_limit=5,
        max_abs_reward=1e6,
        step_budget=len(batch["action"]),
    )


def test_apex_external_episodes_hold_ez_greedy_actions_each_on_its_own():
    """With apex_dqn.eps_repeat_mu, each external episode holds its own random action: two
    episodes acting in one request do not share a hold, and an episode's hold survives
    between requests."""
    episodes = make(
        "apex_dqn",
        **{"apex_dqn.eps_base": 1.0, "apex_dqn.eps_alpha": 0, "apex_dqn.eval_envs": 0, "apex_dqn.eps_repeat_mu": 1.1},
    )
    ids = episodes.start(2)
    episodes.act(ids, [obs(0), obs(0)])
    states = [episodes.episodes[i].state for i in ids]
    held_steps = 0
    for t in range(1, 300):
        t %= 40  # CartPole's x stays within its space
        holding = [(s.left, s.held) for s in states]
        actions = episodes.act(ids, [obs(t), obs(t)], [0.0, 0.0])
        for (left, held), action in zip(holding, actions.tolist()):
            if left > 0:  # a hold from an earlier request decides this one's action
                assert action == held
                held_steps += 1
    assert held_steps > 150
