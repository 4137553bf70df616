"""The multi-agent pieces one by one: the mapping forms, the PettingZoo stepping of both APIs,
the trust of what a config names, the masks in the actors and the losses, the learner's
interleaving of policies and its checkpoint state."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from apex.algos.apex_dqn.actor import ApexDqnEpisodeActor, NStepChunker
from apex.algos.apex_dqn.loss import dqn_loss
from apex.algos.impala.episode_actor import ImpalaEpisodeActor
from apex.algos.masks import legal_actions
from apex.config import load_dict
from apex.config.trust import check_imports, is_pettingzoo_env_id
from apex.core.episode import Episode
from apex.envs.multi_agent import is_multi_agent, make_pettingzoo
from apex.envs.policy_map import multi_agent_spec, policy_mapper
from apex.errors import ConfigError, RejectedMessage
from apex.multiagent.actor import MultiAgentActor, per_agent_setup
from apex.multiagent.learner import MultiPolicyLearner
from apex.wire.schema import BatchSchema, mask_rule

TICTACTOE = "pettingzoo.classic:tictactoe_v3"


def config(**sections):
    return load_dict(sections)


def test_each_mapping_form_names_the_policy_of_each_agent():
    def mapper(mapping):
        return policy_mapper(config(multi_agent={"mapping": mapping}))

    assert mapper("shared")("red_0") == "shared"
    assert mapper("per_agent")("red_0") == "red_0"
    by_pattern = mapper({"red_*": "red", "*": "others"})
    assert (by_pattern("red_3"), by_pattern("blue_1")) == ("red", "others")
    with pytest.raises(ConfigError, match="no pattern matches agent 'blue_1'"):
        mapper({"red_*": "red"})("blue_1")
    assert mapper("tests.unit.test_multi_agent:team_of")("blue_7") == "team_blue"
    with pytest.raises(ConfigError, match="a policy name is"):
        mapper("per_agent")("agent with spaces")


def team_of(agent: str) -> str:
    return "team_" + agent.split("_")[0]


def test_a_mapping_or_train_list_out_of_shape_is_one_line_naming_the_key():
    with pytest.raises(ConfigError, match="multi_agent.mapping must be shared, per_agent"):
        config(multi_agent={"mapping": "everyone"})
    with pytest.raises(ConfigError, match="multi_agent.self_play needs multi_agent.mapping: shared"):
        config(multi_agent={"mapping": "per_agent", "self_play": {"enabled": True}})
    with pytest.raises(ConfigError, match="multi_agent.train names policy 'blue'"):
        multi_agent_spec(config(env={"id": "tests.multiagent_envs:meet"}, multi_agent={"train": ["blue"]}))


def test_pettingzoos_own_ids_need_no_allowance_and_a_mapping_function_does():
    assert is_pettingzoo_env_id(TICTACTOE)
    assert not is_pettingzoo_env_id("pettingzoo.utils:wrappers")  # not an environment of a family
    check_imports(config(env={"id": TICTACTOE}).env, (), "a checkpoint")
    mapped = config(env={"id": TICTACTOE}, multi_agent={"mapping": "evil.module:policy_of"})
    with pytest.raises(ConfigError, match="names module 'evil.module' \\(multi_agent.mapping\\)"):
        check_imports(mapped.env, (), "a checkpoint", mapped.multi_agent.mapping_function)


def test_gymnasium_ids_stay_single_agent_and_pettingzoo_ones_are_told_apart_by_what_they_name():
    assert not is_multi_agent(config().env)
    assert not is_multi_agent(config(env={"id": "tests.envs:apex-test/Recall-v0"}).env)
    assert is_multi_agent(config(env={"id": TICTACTOE}).env)
    assert is_multi_agent(config(env={"id": "tests.multiagent_envs:meet"}).env)


def test_a_missing_package_of_environments_is_one_line_naming_the_extra_that_installs_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpe2", None)  # as if mpe2 were not installed
    with pytest.raises(ConfigError, match=r"'mpe2' is not installed: pip install 'apex-rl\[mpe\]'"):
        make_pettingzoo(config(env={"id": "mpe2:simple_spread_v3"}).env)
    monkeypatch.setitem(sys.modules, "pygame", None)  # classic's games import pygame
    monkeypatch.delitem(sys.modules, "pettingzoo.classic.tictactoe_v3", raising=False)
    monkeypatch.delitem(sys.modules, "pettingzoo.classic.tictactoe.tictactoe", raising=False)
    with pytest.raises(ConfigError, match=r"'pygame' is not installed: pip install 'apex-rl\[multiagent\]'"):
        make_pettingzoo(config(env={"id": TICTACTOE}).env)


def test_an_aec_environment_steps_one_agent_at_a_time_and_hands_each_its_reward_and_mask():
    cfg = config(env={"id": TICTACTOE})
    spec = multi_agent_spec(cfg)
    assert spec.api == "aec" and spec.policies["shared"].spec.action_masked
    assert spec.policies["shared"].spec.frame_shape == (18,)  # the board, without its mask
    env = spec.make(cfg)
    outcome = env.reset(seed=0)
    moves, totals = 0, {"player_1": 0.0, "player_2": 0.0}
    while not outcome.done:
        (turn,) = outcome.turns
        legal = np.flatnonzero(turn.mask)
        assert len(legal) == 9 - moves  # each move fills a square
        outcome = env.step({turn.agent: legal[0]})  # the first free square: player 1 wins on the diagonal
        moves += 1
        for agent, reward in outcome.rewards.items():
            totals[agent] += reward
    assert sorted(e.agent for e in outcome.ended) == ["player_1", "player_2"]
    assert all(e.terminated and not e.truncated for e in outcome.ended)
    assert totals == {"player_1": 1.0, "player_2": -1.0}
    env.close()


def test_the_episode_time_limit_truncates_every_agent_of_a_parallel_environment():
    cfg = config(env={"id": "tests.multiagent_envs:meet", "max_episode_steps": 2})
    env = multi_agent_spec(cfg).make(cfg)
    env.reset(seed=0)
    env.step({"a_0": 1, "a_1": 1})  # both stay: they cannot meet
    outcome = env.step({"a_0": 1, "a_1": 1})
    assert outcome.done and {(e.agent, e.terminated, e.truncated) for e in outcome.ended} == {
        ("a_0", False, True),
        ("a_1", False, True),
    }


def test_an_agents_seats_share_their_environments_rung_of_the_ladder():
    setup = {"epsilons": [0.4, 0.01], "eval_envs": [False, True], "other": 3}
    assert per_agent_setup(setup, num_envs=2, seats=3) == {
        "epsilons": [0.4, 0.4, 0.4, 0.01, 0.01, 0.01],
        "eval_envs": [False, False, False, True, True, True],
        "other": 3,
    }


def test_the_double_dqn_target_never_bootstraps_from_an_illegal_next_action():
    class Fixed(torch.nn.Module):
        def __init__(self, q):
            super().__init__()
            self.q = torch.nn.Parameter(torch.tensor(q))

        def forward(self, obs):
            return self.q.expand(len(obs), -1)

    q = [[0.0, 1.0, 100.0]]  # the illegal action 2 is worth the most to both networks
    args = (torch.zeros(1, 1), torch.tensor([0]), torch.tensor([0.0]), torch.tensor([1.0]), torch.zeros(1, 1))
    masked = dqn_loss(Fixed(q), Fixed(q), *args, torch.ones(1), torch.tensor([[1, 1, 0]], dtype=torch.uint8))
    unmasked = dqn_loss(Fixed(q), Fixed(q), *args, torch.ones(1))
    assert masked.priorities.item() == pytest.approx(1.0)  # |0 + 1 * Q(s', 1) - Q(s, 0)|
    assert unmasked.priorities.item() == pytest.approx(100.0)


def test_a_chunk_carries_the_mask_of_each_transitions_bootstrap_observation():
    chunker = NStepChunker(1, n_step=2, gamma=0.9, chunk_transitions=100, clip_rewards=False, mask_actions=3)
    masks = [np.array([1, 0, 1]), np.array([0, 1, 1]), np.array([1, 1, 0]), np.array([0, 0, 1])]
    chunker.start(np.zeros(1, np.float32))
    for t, mask in enumerate(masks):
        chunker.record_action(1, 0.0, 0.0, mask)
        chunker.record_step(0.0, np.full(1, t + 1, np.float32))
    chunk = chunker.end_episode(False, 0.0)
    # transitions 0, 1 bootstrap at steps 2, 3; 2 and 3 at the final observation (all legal)
    assert chunk["next_mask"].tolist() == [[1, 1, 0], [0, 0, 1], [1, 1, 1], [1, 1, 1]]


@pytest.mark.parametrize("core_type", [ApexDqnEpisodeActor, ImpalaEpisodeActor])
def test_an_episode_actor_never_chooses_a_masked_action(core_type):
    cfg = config(env={"id": TICTACTOE}, algo="apex_dqn" if core_type is ApexDqnEpisodeActor else "impala")
    spec = multi_agent_spec(cfg).policies["shared"].spec
    setup = {"num_envs": 64, "epsilons": [1.0] * 32 + [0.0] * 32, "eval_envs": [False] * 64}
    core = core_type(cfg, setup, spec, seed=1)
    rng = np.random.default_rng(0)
    episodes = []
    for slot in range(64):
        episode = Episode(str(slot), slot, 0.0)
        core.begin(episode)
        episode.mask = rng.random(9) < 0.3
        episode.mask[rng.integers(9)] = True
        episodes.append(episode)
    for _ in range(20):
        actions = core.act(episodes, rng.random((64, 1, 18), dtype=np.float32), None)
        assert all(e.mask[a] for e, a in zip(episodes, actions))
        for episode in episodes:
            episode.acted = True


def test_legal_actions_replaces_only_the_illegal_ones():
    mask = np.array([[True, False], [False, True]])
    assert legal_actions(np.random.default_rng(0), np.array([0, 0]), mask).tolist() == [0, 1]


def test_a_mask_that_allows_no_action_is_refused():
    schema = BatchSchema((mask_rule("mask", ("rows", 3)),))
    schema.validate({"mask": np.array([[0, 1, 0]], np.uint8)}, {"rows": 4})
    with pytest.raises(RejectedMessage, match="allows no action") as refused:
        schema.validate({"mask": np.array([[0, 1, 0], [0, 0, 0]], np.uint8)}, {"rows": 4})
    assert refused.value.reason == "empty_mask"


def test_the_learner_interleaves_policies_by_the_data_each_has_and_checkpoints_each():
    cfg = config(
        env={"id": "tests.multiagent_envs:speaker_listener"},
        multi_agent={"mapping": "per_agent"},
        apex_dqn={"batch_size": 8, "replay": {"min_size": 8}},
        actor={"num_envs": 2},
    )
    spec = multi_agent_spec(cfg)
    learner = MultiPolicyLearner(cfg, spec, torch.device("cpu"))
    setup = {"num_envs": 2, "seed": 0, **learner.actor_setup(0, 2)}
    actor = MultiAgentActor(cfg, setup, seed=0, spec=spec)
    sent = {"speaker": 0, "listener": 0}
    while min(sent.values()) < 2:
        batch, _ = actor.act()
        if batch is not None:
            policy = actor.batch_info([])["policy"]
            arrays, _ = learner.cores[policy].schema.validate(batch, learner.policy_limits(policy, 2))
            learner.cores[policy].insert_many([arrays])
            sent[policy] += 1
    trained = [learner.step() for _ in range(6)]
    assert all(trained)
    assert {name: core.updates for name, core in learner.cores.items()} == {"speaker": 3, "listener": 3}
    assert set(learner.weights()) == {f"{p}/{k}" for p in ("speaker", "listener") for k in learner.cores[p].weights()}
    state = learner.state_dict()
    learner.check_state(state)
    with pytest.raises(Exception, match="holds the policies"):
        learner.check_state({"updates": 6, "policies": {"shared": state["policies"]["speaker"]}})
    actor.close()


def test_a_self_play_actor_takes_the_pool_from_the_weights_and_refuses_forged_snapshots():
    from apex.errors import ProtocolError
    from apex.wire.protocol import Message

    cfg = config(
        env={"id": TICTACTOE},
        multi_agent={"self_play": {"enabled": True, "pool_size": 2}},
        actor={"num_envs": 2},
    )
    spec = multi_agent_spec(cfg)
    learner = MultiPolicyLearner(cfg, spec, torch.device("cpu"))
    actor = MultiAgentActor(cfg, {"num_envs": 2, "seed": 0, **learner.actor_setup(0, 2)}, seed=0, spec=spec)
    own = learner.cores["shared"].weights()

    def message(*snapshots: str) -> Message:
        arrays = {f"shared/{k}": v for k, v in own.items()}
        for snapshot in snapshots:
            arrays.update({f"shared@{snapshot}/{k}": v for k, v in own.items()})
        return Message("weights", {"version": 1}, arrays)

    actor.set_weights(message("3", "4"))
    assert actor.pool == [3, 4]
    actor.set_weights(message("4", "5"))
    assert actor.pool == [4, 5]  # 3 left the pool
    with pytest.raises(ProtocolError, match="more snapshots than the pool holds"):
        actor.set_weights(message("6", "7", "8"))
    with pytest.raises(ProtocolError, match="unknown policy"):
        actor.set_weights(message("x"))
    for _ in range(50):  # episodes against the pool's snapshots and the others play on
        actor.act()
    actor.close()


def test_an_actor_is_refused_when_one_batch_of_all_its_seats_would_not_fit_impalas_queue():
    from apex.errors import ApexError

    cfg = config(algo="impala", env={"id": "tests.multiagent_envs:meet"}, impala={"queue_size": 8, "batch_unrolls": 8})
    learner = MultiPolicyLearner(cfg, multi_agent_spec(cfg), torch.device("cpu"))
    learner.actor_setup(0, 4)  # 4 environments x 2 seats: 8 unrolls a batch
    with pytest.raises(ApexError, match="queue_size"):
        learner.actor_setup(0, 5)


def test_an_agent_that_ends_early_stops_making_transitions_and_one_that_joins_later_starts_its_own():
    cfg = config(
        env={"id": "tests.multiagent_envs:relay"},
        multi_agent={"mapping": "per_agent"},
        apex_dqn={"n_step": 1, "chunk_transitions": 1000, "eval_envs": 1},
        actor={"num_envs": 1},
    )
    spec = multi_agent_spec(cfg)
    learner = MultiPolicyLearner(cfg, spec, torch.device("cpu"))
    actor = MultiAgentActor(cfg, {"num_envs": 1, "seed": 0, **learner.actor_setup(0, 1)}, seed=0, spec=spec)
    teams = []
    for _ in range(6):  # one episode (the relay's asserts check that only the agents playing act)
        teams += actor.act()[1]
    made = {name: actor.players[name].take(flush=True) for name in ("early", "late")}
    transitions = {name: sum(len(b["action"]) for b, _ in batches) for name, batches in made.items()}
    assert transitions == {"early": 3, "late": 4}
    records = {name: [r for _, rs in batches for r in rs] for name, batches in made.items()}
    assert records == {"early": [[3.0, 3, True]], "late": [[4.0, 4, True]]}
    assert teams == [[3.5, 6, True]]  # the mean of the agents' returns; the environment's 6 steps
    actor.close()


def test_recurrent_continuous_impala_agents_act_within_their_bounds_and_make_valid_unrolls():
    """IMPALA's episode actor carries an LSTM's state per agent and bounds Gaussian samples
    (env.action_bounds squash): the environment gets them unchanged (not squashed twice),
    and each batch passes the learner's schema (core state, done flags, float actions)."""
    from apex.algos.impala import learner as impala

    cfg = config(
        algo="impala",
        env={"id": "tests.multiagent_envs:spread", "action_bounds": "squash"},
        model={"recurrent": "lstm", "lstm_size": 8},
        impala={"unroll_length": 5},
        actor={"num_envs": 1},
        apex_dqn={"eval_envs": 0},
    )
    spec = multi_agent_spec(cfg)
    view = spec.views["agent_0"]
    inside = np.array([0.1, 0.9, 0.5, 0.0, 1.0], np.float32)  # spread's actions: Box(0, 1, (5,))
    np.testing.assert_allclose(view.env_action(inside), inside)
    learner = MultiPolicyLearner(cfg, spec, torch.device("cpu"))
    actor = MultiAgentActor(cfg, {"num_envs": 1, "seed": 0, **learner.actor_setup(0, 1)}, seed=0, spec=spec)
    batches = []
    for _ in range(12):
        batch, _ = actor.act()
        if batch is not None:
            batches.append(batch)
    assert batches
    shared = spec.policies["shared"].spec
    for batch in batches:
        impala.batch_schema(shared, cfg).validate(batch, impala.batch_limits(3, shared, cfg))
        assert batch["core_h"].shape == (3, 8) and batch["action"].dtype == np.float32
    actor.close()


def test_the_actor_side_of_multi_agent_runs_imports_no_torch():
    """An actor of vector observations never pays for torch (~0.7 s and ~190 MB a process)."""
    import subprocess
    import sys

    code = "import sys, apex.actor.process, apex.multiagent.actor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_forged_self_play_matches_are_refused_and_honest_ones_move_the_rating():
    from apex.config.multi_agent import SelfPlayConfig
    from apex.multiagent.selfplay import LATEST, RANDOM, SnapshotPool, check_matches

    pool = SnapshotPool("shared", SelfPlayConfig(enabled=True, snapshot_every_updates=10, pool_size=2))
    assert pool.maybe_snapshot(10, lambda: {"w": np.ones(2, np.float32)})
    issued = pool.next_id
    assert issued == 1
    for forged in (
        [[7, 1]],  # a snapshot the pool never held
        [[0, 2]],  # an outcome past a win
        [[0, True]],  # a bool is no outcome
        [[0, 1, 1]],
        "matches",
        [[0, 1]] * 5000,  # more than a batch may hold
    ):
        with pytest.raises(ValueError):
            check_matches(forged, issued)
    pool.record(check_matches([[0, 1], [0, 1], [RANDOM, -1], [LATEST, 0]], issued))
    assert pool.rating > 1000
    assert pool.metrics()["win_rate_vs_pool"] == 1.0 and pool.metrics()["loss_rate_vs_random"] == 1.0


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
@pytest.mark.parametrize("train_opponents", [False, True])
def test_episodes_whose_snapshot_leaves_the_pool_finish_with_the_newest_weights(algo, train_opponents):
    """The pool rotates every few steps under 8 environments' episodes in play: no lookup of a
    departed snapshot fails, every episode ends, and each match names an opponent the
    learner knows (the newest weights for one whose snapshot left)."""
    from apex.multiagent.selfplay import LATEST, RANDOM, check_matches
    from apex.wire.protocol import Message

    cfg = config(
        algo=algo,
        env={"id": TICTACTOE},
        multi_agent={
            "self_play": {
                "enabled": True,
                "pool_size": 2,
                "latest_prob": 0.0,
                "train_opponents": train_opponents,
            }
        },
        actor={"num_envs": 8},
    )
    spec = multi_agent_spec(cfg)
    learner = MultiPolicyLearner(cfg, spec, torch.device("cpu"))
    actor = MultiAgentActor(cfg, {"num_envs": 8, "seed": 0, **learner.actor_setup(0, 8)}, seed=0, spec=spec)
    own = learner.cores["shared"].weights()

    def message(version: int, *snapshots: int) -> Message:
        arrays = {f"shared/{k}": v for k, v in own.items()}
        for snapshot in snapshots:
            arrays.update({f"shared@{snapshot}/{k}": v for k, v in own.items()})
        return Message("weights", {"version": version}, arrays)

    teams, matches = 0, []
    for step in range(500):
        newest = step // 5  # a new snapshot every 5 steps: one leaves the full pool each time
        if step % 5 == 0:
            actor.set_weights(message(step, *range(max(0, newest - 1), newest + 1)))
        batch, records = actor.act()
        teams += len(records)
        if batch is not None:  # as the learner checks them: ids it has issued
            played = actor.batch_info([])["matches"]
            check_matches(played, newest + 1)
            matches += played
    assert teams > 100
    opponents = [opponent for opponent, _ in matches]
    assert LATEST in opponents, "no episode was handed over to the newest weights"
    assert len(set(opponents) - {LATEST, RANDOM}) > 10, "episodes against the pool's snapshots did not end"
    actor.close()
