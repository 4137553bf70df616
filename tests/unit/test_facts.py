"""The facts table (apex.core.facts): every list of algorithms apex keeps comes from it, and
each row says what its implementation does."""

import dataclasses

import pytest

from apex import algos
from apex import config as config_module
from apex.config import Config
from apex.core import ALGO_ACTIONS, ALGO_SECTIONS, ALGOS, FACTS
from apex.core.facts import MODEL_CORES, WITHOUT_REPLAY, accepting_core
from apex.envs import spaces


def test_the_derived_tables_are_the_rows():
    assert ALGOS == tuple(FACTS) == ("apex_dqn", "impala", "appo", "apex_ddpg")
    assert {name: row.sections for name, row in FACTS.items()} == ALGO_SECTIONS
    assert spaces.ALGO_ACTIONS is ALGO_ACTIONS and ALGO_ACTIONS["apex_ddpg"] == ("Box",)
    assert MODEL_CORES == ("none", "lstm") and accepting_core("lstm") == ("impala", "appo")
    assert WITHOUT_REPLAY == ("impala", "appo")
    assert [row.preset("cartpole") for row in FACTS.values()] == [
        "cartpole_apex",
        "cartpole_impala",
        "cartpole_appo",
        "cartpole_apex_ddpg",
    ]
    assert {name: registered.facts for name, registered in algos.REGISTRY.items()} == FACTS


@pytest.mark.parametrize("algo", ALGOS)
def test_a_row_names_its_config_sections_and_its_policy_state(algo):
    row = FACTS[algo]
    fields = {f.name for f in dataclasses.fields(Config)}
    assert set(row.sections) <= fields
    config = config_module.load(None, [f"algo={algo}"] + (["env.id=Pendulum-v1"] if "Box" in row.actions[:1] else []))
    assert config.algo_config is getattr(config, row.sections[0])
    # The policy a checkpoint is evaluated with is one of the state dicts the row says it holds.
    assert algos.get(algo).learner().policy.checkpoint_key in row.state_keys


def test_the_model_check_reads_the_rows():
    for algo in accepting_core("lstm"):
        config_module.load(None, [f"algo={algo}", "model.recurrent=lstm"])
    with pytest.raises(config_module.ConfigError, match="model.recurrent lstm needs algo impala or appo"):
        config_module.load(None, ["model.recurrent=lstm"])
    with pytest.raises(config_module.ConfigError, match="model.recurrent must be one of none, lstm, got 'gtrxl'"):
        config_module.load(None, ["algo=impala", "model.recurrent=gtrxl"])
    with pytest.raises(config_module.ConfigError, match="env.normalize_reward true needs algo impala or appo"):
        config_module.load(None, ["algo=apex_ddpg", "env.id=Pendulum-v1", "env.normalize_reward=true"])


def test_an_unknown_algorithm_is_one_line_naming_the_choices():
    with pytest.raises(
        config_module.ConfigError, match=r"algo must be one of \('apex_dqn', 'impala', 'appo', 'apex_ddpg'\)"
    ):
        config_module.load(None, ["algo=dqn"])
    with pytest.raises(ValueError, match="unknown algorithm 'dqn': one of apex_dqn, impala, appo, apex_ddpg"):
        algos.get("dqn")
