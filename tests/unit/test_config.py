"""apex.config: YAML + overrides into typed dataclasses, with errors that say what to do."""

from __future__ import annotations

import pytest
import yaml

from apex import config
from apex.config import Config
from apex.errors import ConfigError
from tests.support.configs import HUGE
from tests.support.paths import ROOT

CONFIGS = ROOT / "configs"


def test_defaults_are_valid_and_equal_the_cartpole_config():
    Config().validate()
    assert config.load(CONFIGS / "cartpole_apex.yaml") == Config()


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    loaded = config.load(path)
    assert loaded.algo in config.ALGOS


def test_overrides_parse_values_as_yaml():
    c = config.load(
        None,
        [
            "env.id=Acrobot-v1",
            "model.hidden=[64, 32]",
            "learner.lr=1e-3",
            "env.max_episode_steps=200",
            "transport.curve_dir=null",
            "actor.eval_envs=0",
        ],
    )
    assert c.env.id == "Acrobot-v1"
    assert c.model.hidden == [64, 32]
    assert c.learner.lr == 1e-3 and isinstance(c.learner.lr, float)
    assert c.env.max_episode_steps == 200
    assert c.transport.curve_dir is None
    assert c.actor.eval_envs == 0


def test_override_applies_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"replay": {"capacity": 5000, "min_size": 100}}))
    c = config.load(path, ["replay.capacity=6000"])
    assert c.replay.capacity == 6000 and c.replay.min_size == 100


def test_unknown_keys_name_the_nearest_valid_one():
    with pytest.raises(ConfigError) as info:
        config.load(None, ["replay.capacty=10", "lerner.lr=1"])
    message = str(info.value)
    assert "unknown key replay.capacty; did you mean replay.capacity?" in message
    assert "unknown key lerner; did you mean learner?" in message


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        config.load(None, ["replay.capacity=-5", "learner.gamma=1.5", "model.hidden=abc", "actor.eval_epsilon=0.5"])
    message = str(info.value)
    assert "model.hidden must be a list of an integer, got 'abc'" in message
    # range checks run once the types are right
    with pytest.raises(ConfigError) as info:
        config.load(None, ["replay.capacity=-5", "learner.gamma=1.5", "actor.eval_epsilon=0.5"])
    message = str(info.value)
    assert "replay.capacity must be a positive integer, got -5" in message
    assert "learner.gamma must be in [0, 1], got 1.5" in message
    assert "actor.eval_epsilon must be in [0, 0.01], got 0.5" in message


@pytest.mark.parametrize(
    "override, message",
    [
        ("learner.batch_size=12.5", "learner.batch_size must be an integer"),
        ("model.dueling=yes please", "model.dueling must be true or false"),
        ("env=3", "env must be a mapping"),
        ("env.id.x=3", "env.id must be a string"),
        ("nokey", "--set expects key=value"),
        ("algo=ppo", "algo must be one of"),
        ("learner.device=tpu", "learner.device must be auto, cpu or cuda"),
        ("env.reward_scale=0", "env.reward_scale must be a positive number, got 0"),
        ("env.reward_scale=.nan", "env.reward_scale must be a finite number, got nan"),
        ("env.reward_scale=-1", "env.reward_scale must be a positive number"),
    ],
)
def test_bad_values_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        config.load(None, [override])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("env: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        config.load(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3")
    with pytest.raises(ConfigError, match="mapping of sections"):
        config.load(scalar)


def test_round_trip_through_dict():
    c = config.load(None, ["env.id=Acrobot-v1"])
    assert config.from_dict(c.to_dict()) == c


@pytest.mark.parametrize(
    "key, text, message",
    [
        ("learner.batch_size", HUGE, "learner.batch_size must be within -2**53..2**53, got an integer of 5000 digits"),
        ("learner.batch_size", str(2**60), f"learner.batch_size must be within -2**53..2**53, got {2**60}"),
        ("learner.lr", HUGE, "learner.lr must be within -2**53..2**53, got an integer of 5000 digits"),
        (
            "env.kwargs",
            "{size: " + HUGE + "}",
            "env.kwargs holds an integer outside -2**53..2**53: an integer of 5000 digits",
        ),
        ("learner.lr", ".inf", "learner.lr must be a finite number, got inf"),
        ("learner.lr", ".nan", "learner.lr must be a finite number, got nan"),
        ("learner.lr", "1e400", "learner.lr must be a finite number, got '1e400'"),
        ("transport.max_abs_reward", "-.inf", "transport.max_abs_reward must be a finite number, got -inf"),
        ("actor.eps_repeat_mu", ".inf", "actor.eps_repeat_mu must be a finite number or null, got inf"),
    ],
)
def test_integers_out_of_range_and_non_finite_floats_are_one_line_naming_the_key(tmp_path, key, text, message):
    """Issue 30, item 11: a 5,000-digit integer gave a traceback and learner.lr: .inf was
    taken; each is refused in one line naming the key, from --set and from a file."""
    with pytest.raises(ConfigError) as by_set:
        config.load(None, [f"{key}={text}"])
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {text}\n")
    with pytest.raises(ConfigError) as by_file:
        config.load(path)
    for error in (by_set, by_file):
        assert str(error.value) == f"invalid configuration: {message}"
