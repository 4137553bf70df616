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
            "apex_dqn.lr=1e-3",
            "env.max_episode_steps=200",
            "transport.curve_dir=null",
            "apex_dqn.eval_envs=0",
        ],
    )
    assert c.env.id == "Acrobot-v1"
    assert c.model.hidden == [64, 32]
    assert c.apex_dqn.lr == 1e-3 and isinstance(c.apex_dqn.lr, float)
    assert c.env.max_episode_steps == 200
    assert c.transport.curve_dir is None
    assert c.apex_dqn.eval_envs == 0


def test_override_applies_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"apex_dqn": {"replay": {"capacity": 5000, "min_size": 100}}}))
    c = config.load(path, ["apex_dqn.replay.capacity=6000"])
    assert c.apex_dqn.replay.capacity == 6000 and c.apex_dqn.replay.min_size == 100


def test_unknown_keys_name_the_nearest_valid_one():
    with pytest.raises(ConfigError) as info:
        config.load(None, ["replay.capacty=10", "lerner.lr=1"])
    message = str(info.value)
    assert "unknown key apex_dqn.replay.capacty; did you mean apex_dqn.replay.capacity?" in message
    assert "unknown key lerner; did you mean learner?" in message


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        config.load(
            None, ["apex_dqn.replay.capacity=-5", "apex_dqn.gamma=1.5", "model.hidden=abc", "apex_dqn.eval_epsilon=0.5"]
        )
    message = str(info.value)
    assert "model.hidden must be a list of an integer, got 'abc'" in message
    # range checks run once the types are right
    with pytest.raises(ConfigError) as info:
        config.load(None, ["apex_dqn.replay.capacity=-5", "apex_dqn.gamma=1.5", "apex_dqn.eval_epsilon=0.5"])
    message = str(info.value)
    assert "apex_dqn.replay.capacity must be a positive integer, got -5" in message
    assert "apex_dqn.gamma must be in [0, 1], got 1.5" in message
    assert "apex_dqn.eval_epsilon must be in [0, 0.01], got 0.5" in message


@pytest.mark.parametrize(
    "override, message",
    [
        ("apex_dqn.batch_size=12.5", "apex_dqn.batch_size must be an integer"),
        ("model.dueling=yes please", "model.dueling must be true or false"),
        ("env=3", "env must be a mapping"),
        ("env.id.x=3", "env.id must be a string"),
        ("nokey", "--set expects key=value"),
        ("algo=ppo", "algo must be one of"),
        ("learner.device=tpu", "learner.device must be auto, cpu or cuda"),
        ("env.reward_scale=0", "env.reward_scale must be a positive number, got 0"),
        ("env.reward_scale=.nan", "env.reward_scale must be a finite number, got nan"),
        ("env.reward_scale=-1", "env.reward_scale must be a positive number"),
        ("logging.project=../../etc", "logging.project must be a plain name"),  # a tracker's path
        ("logging.project=a/b", "logging.project must be a plain name"),
        ("logging.project=.hidden", "logging.project must be a plain name"),
        ("logging.project=" + "x" * 10_000, "logging.project must be a plain name"),
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
        (
            "apex_dqn.batch_size",
            HUGE,
            "apex_dqn.batch_size must be within -2**53..2**53, got an integer of 5000 digits",
        ),
        ("apex_dqn.batch_size", str(2**60), f"apex_dqn.batch_size must be within -2**53..2**53, got {2**60}"),
        ("apex_dqn.lr", HUGE, "apex_dqn.lr must be within -2**53..2**53, got an integer of 5000 digits"),
        (
            "env.kwargs",
            "{size: " + HUGE + "}",
            "env.kwargs holds an integer outside -2**53..2**53: an integer of 5000 digits",
        ),
        ("apex_dqn.lr", ".inf", "apex_dqn.lr must be a finite number, got inf"),
        ("apex_dqn.lr", ".nan", "apex_dqn.lr must be a finite number, got nan"),
        ("apex_dqn.lr", "1e400", "apex_dqn.lr must be a finite number, got '1e400'"),
        ("transport.max_abs_reward", "-.inf", "transport.max_abs_reward must be a finite number, got -inf"),
        ("apex_dqn.eps_repeat_mu", ".inf", "apex_dqn.eps_repeat_mu must be a finite number or null, got inf"),
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


# -- Each algorithm's settings in its own section


def older_names(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "settings under their older names" in r.getMessage()]


def test_older_keys_are_read_under_their_new_names_with_one_warning_naming_each(caplog):
    """A config written before the move (as a checkpoint saved it: every key) loads with the
    same values; learner.lr is the config's own algorithm's lr."""
    older = {
        "algo": "impala",
        "learner": {"lr": 7e-4, "grad_clip": 33.0, "publish_interval": 2, "batch_size": 64, "device": "cpu"},
        "actor": {"num_envs": 8, "eval_envs": 1, "weights_update_steps": 5},
        "replay": {"capacity": 5000, "min_size": 100, "samples_per_insert": 8.0},
        "impala": {"unroll_length": 10},
    }
    with caplog.at_level("WARNING", logger="apex.config"):
        loaded = config.from_dict(older)
    assert (loaded.impala.lr, loaded.impala.grad_clip, loaded.impala.publish_interval) == (7e-4, 33.0, 2)
    assert (loaded.impala.weights_update_steps, loaded.impala.unroll_length) == (5, 10)
    assert (loaded.apex_dqn.batch_size, loaded.apex_dqn.eval_envs, loaded.apex_dqn.replay.capacity) == (64, 1, 5000)
    assert (loaded.learner.device, loaded.actor.num_envs) == ("cpu", 8)
    assert loaded.apex_dqn.lr == Config().apex_dqn.lr  # IMPALA's lr did not leak into Ape-X's
    assert loaded.apex_dqn.replay_ratio == 8.0  # moved twice: into apex_dqn.replay, then out of it
    [warning] = older_names(caplog)
    for moved in (
        "learner.lr -> impala.lr",
        "learner.batch_size -> apex_dqn.batch_size",
        "replay -> apex_dqn.replay",
        "apex_dqn.replay.samples_per_insert -> apex_dqn.replay_ratio",
    ):
        assert moved in warning
    assert config.from_dict(loaded.to_dict()) == loaded  # and the new names read back


def test_an_older_key_given_with_set_overrides_the_presets_new_one(caplog):
    with caplog.at_level("WARNING", logger="apex.config"):
        loaded = config.load("cartpole_impala", ["learner.lr=3e-4", "replay.capacity=7000"])
    assert loaded.impala.lr == 3e-4 and loaded.apex_dqn.replay.capacity == 7000
    assert "learner.lr -> impala.lr" in older_names(caplog)[0]
    # --algo comes as algo=..., wherever it is in the list: the older key follows it
    assert config.load(None, ["learner.lr=3e-4", "algo=impala"]).impala.lr == 3e-4


def test_the_replay_ratio_set_under_its_older_name_in_a_subsection_is_read(caplog):
    """apex_dqn.replay.samples_per_insert (before issue 48) is apex_dqn.replay_ratio, in a
    file and with --set, and Ape-X DDPG's alike; the rest of the replay section stays."""
    older = {"algo": "apex_ddpg", "apex_ddpg": {"replay": {"samples_per_insert": 16.0, "capacity": 9000}}}
    with caplog.at_level("WARNING", logger="apex.config"):
        loaded = config.from_dict(older)
        by_set = config.load(None, ["apex_dqn.replay.samples_per_insert=3"])
    assert (loaded.apex_ddpg.replay_ratio, loaded.apex_ddpg.replay.capacity) == (16.0, 9000)
    assert older["apex_ddpg"]["replay"]["samples_per_insert"] == 16.0  # the caller's dict untouched
    assert by_set.apex_dqn.replay_ratio == 3.0
    assert "apex_ddpg.replay.samples_per_insert -> apex_ddpg.replay_ratio" in older_names(caplog)[0]
    older_and_new = r"apex_dqn\.replay\.samples_per_insert \(the older name of apex_dqn\.replay_ratio\)"
    with pytest.raises(ConfigError, match=older_and_new):
        config.from_dict({"apex_dqn": {"replay_ratio": 2.0, "replay": {"samples_per_insert": 4.0}}})
    with pytest.raises(ConfigError, match=r"apex_dqn\.replay_ratio must be in \(0, 1000\.0\], got 0\.0"):
        config.from_dict({"apex_dqn": {"replay_ratio": 0.0}})
    for forged in (float("nan"), float("inf"), 1e300):  # a config from elsewhere, under the older name too
        with pytest.raises(ConfigError, match=r"apex_dqn\.replay_ratio must be (in|a finite number)"):
            config.from_dict({"apex_dqn": {"replay": {"samples_per_insert": forged}}})
    with pytest.raises(ConfigError, match=r"apex_dqn\.replay must be a mapping, got 5"):
        config.from_dict({"apex_dqn": {"replay": 5}})  # a section that is a value: named, not a crash


def test_an_older_key_and_its_new_one_set_differently_in_one_file_is_an_error():
    with pytest.raises(ConfigError, match=r"learner\.lr \(the older name of apex_dqn\.lr\) and apex_dqn\.lr are both"):
        config.from_dict({"learner": {"lr": 1e-3}, "apex_dqn": {"lr": 2e-3}})
    assert config.from_dict({"learner": {"lr": 1e-3}, "apex_dqn": {"lr": 1e-3}}).apex_dqn.lr == 1e-3


def test_each_algorithm_has_its_own_defaults():
    """--algo impala no longer inherits Ape-X's grad_clip 10, publish_interval 10 (or RMSProp)."""
    impala = config.load(None, ["algo=impala"])
    assert impala.algo_config is impala.impala
    assert (impala.impala.grad_clip, impala.impala.publish_interval, impala.impala.optimizer) == (40.0, 1, "adam")
    assert (impala.impala.weights_update_steps, Config().apex_dqn.weights_update_steps) == (10, 50)
    default = Config()
    assert default.algo_config is default.apex_dqn
    assert not hasattr(impala.learner, "lr") and not hasattr(impala, "replay")


def test_a_section_given_in_part_keeps_its_own_defaults_for_the_rest():
    """apex_ddpg.replay's defaults are not ReplayConfig's: one key set leaves the others its own."""
    ddpg = config.load(None, ["algo=apex_ddpg", "apex_ddpg.replay.alpha=0.5"])
    assert ddpg.algo_config is ddpg.apex_ddpg
    assert (ddpg.apex_ddpg.replay.alpha, ddpg.apex_ddpg.replay.capacity) == (0.5, 1_000_000)
    assert ddpg.apex_ddpg.replay_ratio == Config().apex_ddpg.replay_ratio == 32.0
    assert config.load(None, ["apex_dqn.replay.alpha=0.5"]).apex_dqn.replay.capacity == 100_000


def test_what_a_preset_tunes_for_its_task_is_named():
    tuned = config.tuned_settings(config.load("cartpole_impala"))
    assert {"env.reward_scale", "model.hidden"} <= set(tuned) and not any(k.startswith("apex_dqn") for k in tuned)
    assert "env.id" not in tuned and "impala.grad_clip" not in tuned  # the algorithm's own default
    assert config.tuned_settings(config.load(None, ["algo=impala", "env.id=Acrobot-v1"])) == {}


def test_a_preset_run_on_another_environment_is_warned_about(caplog):
    with caplog.at_level("WARNING", logger="apex.config"):
        config.load("cartpole_impala", ["env.id=Acrobot-v1"])
        config.load("cartpole_impala", ["impala.lr=1e-3"])
    [warning] = [r.getMessage() for r in caplog.records if "is tuned for" in r.getMessage()]
    assert "preset cartpole_impala.yaml is tuned for CartPole-v1" in warning and "env.reward_scale=0.1" in warning
    assert "--algo impala --env Acrobot-v1 alone" in warning
