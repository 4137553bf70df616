"""Where Ape-X explores: the epsilon ladder over the actors that join, and epsilon-greedy with
and without ez-greedy's held random actions (apex_dqn.eps_repeat_mu)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from apex import config as config_module
from apex.algos.apex_dqn import exploration
from apex.algos.apex_dqn.actor import ApexDqnActor
from apex.config import ApexDqnConfig
from apex.errors import ConfigError


def test_epsilon_ladder_matches_the_paper():
    n = 8
    expected = [0.4 ** (1 + 7 * i / (n - 1)) for i in range(n)]
    assert [exploration.epsilon_ladder(i, n) for i in range(n)] == pytest.approx(expected)
    assert exploration.epsilon_ladder(0, n) == pytest.approx(0.4)
    assert exploration.epsilon_ladder(7, n) == pytest.approx(0.4**8)
    assert exploration.epsilon_ladder(0, 1) == 0.4


def test_actor_epsilons_cover_the_ladder_across_actors():
    config = ApexDqnConfig(eval_envs=1, eval_epsilon=0.01)
    eps0, eval0 = exploration.actor_epsilons(0, 4, config)
    eps1, eval1 = exploration.actor_epsilons(1, 4, config)
    # two actors of 3 exploring envs: the rungs u = 0, 1/6, ..., 5/6 of the ladder, each once
    ladder = [exploration.ladder_epsilon(i / 6) for i in range(6)]
    assert sorted(eps0[:3] + eps1[:3]) == pytest.approx(sorted(ladder))
    assert eps0[3] == eps1[3] == 0.01
    # evaluation: the set-aside env and every rung at or below eval_epsilon
    assert eval0 == [e <= 0.01 for e in eps0] and eval0[3]
    assert not any(e for e, eps in zip(eval0 + eval1, eps0 + eps1) if eps > 0.01)


@pytest.mark.parametrize("actors", [3, 5, 8, 13])
def test_the_ladder_follows_the_actors_that_join(actors):
    """However many actors join, every exploring environment has its own epsilon."""
    config = ApexDqnConfig(eval_envs=1)
    epsilons = [exploration.actor_epsilons(i, 6, config)[0][:5] for i in range(actors)]
    flat = [e for eps in epsilons for e in eps]
    assert len(set(flat)) == len(flat) == actors * 5
    assert max(flat) == pytest.approx(0.4) and min(flat) < 0.4**7
    # spread: the positions on the ladder leave no gap wider than two even steps
    positions = sorted(math.log(e / 0.4, 0.4) / 7 for e in flat)
    assert max(b - a for a, b in itertools.pairwise(positions)) <= 2 / len(flat) + 1e-9


def test_actor_offsets_are_van_der_corput():
    assert [exploration.actor_offset(i) for i in range(8)] == [0, 0.5, 0.25, 0.75, 0.125, 0.625, 0.375, 0.875]


def run_lengths(actions: list[int]) -> list[int]:
    """Lengths of the runs of equal consecutive actions."""
    lengths, count = [], 1
    for previous, action in itertools.pairwise(actions):
        if action == previous:
            count += 1
        else:
            lengths.append(count)
            count = 1
    return [*lengths, count]


def play(explorer: exploration.Explorer, steps: int, greedy: int = 0) -> np.ndarray:
    """[steps, rows] actions of an explorer whose greedy action is always ``greedy``."""
    rows = len(explorer.epsilons)
    return np.stack([explorer.actions(np.full(rows, greedy)) for _ in range(steps)])


def test_plain_epsilon_greedy_explores_at_each_rows_rate():
    explorer = exploration.Explorer([0.0, 0.3, 1.0], 1000, np.random.default_rng(0))
    actions = play(explorer, 20000)
    assert (actions[:, 0] == 0).all()
    random_share = (actions != 0).mean(axis=0)  # a random action is 0 once in 1000
    assert random_share[1] == pytest.approx(0.3, abs=0.015) and random_share[2] == pytest.approx(1.0, abs=0.005)
    assert max(run_lengths(actions[:, 2].tolist())) <= 3  # no holds: 1000 actions rarely repeat


def test_ez_greedy_holds_random_actions_for_zeta_distributed_durations():
    explorer = exploration.Explorer([1.0, 0.0], 1000, np.random.default_rng(1), repeat_mu=2.0)
    actions = play(explorer, 40000)
    lengths = run_lengths(actions[:, 0].tolist())
    # zeta(2): P(n = 1) = 1 / zeta(2) = 6 / pi^2, P(n = 2) = P(n = 1) / 4, capped at MAX_REPEAT
    ones, twos = lengths.count(1) / len(lengths), lengths.count(2) / len(lengths)
    assert ones == pytest.approx(6 / math.pi**2, abs=0.03) and twos == pytest.approx(1.5 / math.pi**2, abs=0.02)
    assert max(lengths) <= exploration.MAX_REPEAT + 2 and max(lengths) >= 50
    assert (actions[:, 1] == 0).all()  # epsilon 0 never explores, holds or not


def test_ez_greedy_leaves_evaluation_rows_plain_and_drops_a_hold_at_episode_end():
    explorer = exploration.Explorer([1.0, 1.0], 1000, np.random.default_rng(2), repeat_mu=1.1, plain=[False, True])
    actions = play(explorer, 5000)
    assert max(run_lengths(actions[:, 1].tolist())) <= 3
    assert np.mean(run_lengths(actions[:, 0].tolist())) > 5
    while explorer.left[0] == 0:
        explorer.actions(np.zeros(2, np.int64))
    explorer.reset(0)
    assert explorer.left[0] == 0


def test_the_actor_plays_ez_greedy_where_the_config_says_so():
    overrides = [
        "actor.num_envs=4",
        "apex_dqn.eval_envs=1",
        "apex_dqn.eps_base=1.0",
        "apex_dqn.eps_alpha=0",
        "apex_dqn.eps_repeat_mu=1.5",
    ]
    config = config_module.load(None, overrides)
    welcome = {"epsilons": [1.0, 1.0, 1.0, 0.0], "eval_envs": [False, False, False, True]}
    actor = ApexDqnActor(config, welcome, seed=0)
    try:
        holds = 0
        for _ in range(200):
            actor.act()
            holds += int((actor.explorer.left[:3] > 0).sum())
            assert actor.explorer.left[3] == 0
        assert holds > 100
    finally:
        actor.close()


@pytest.mark.parametrize("value", ["1.0", "0.5", "inf", "nan"])
def test_eps_repeat_mu_must_be_a_zeta_exponent(value):
    # inf is refused as no float key takes one (a finite number), the others by the key's own rule
    with pytest.raises(ConfigError, match="apex_dqn.eps_repeat_mu must be (> 1|a finite number)"):
        config_module.load(None, [f"apex_dqn.eps_repeat_mu={value}"])
    assert config_module.load(None, ["apex_dqn.eps_repeat_mu=null"]).apex_dqn.eps_repeat_mu is None
