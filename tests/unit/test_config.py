"""apex.config: YAML + overrides into typed dataclasses, with errors that say what to do."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from apex import config
from apex.config import Config
from apex.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_defaults_are_valid_and_equal_the_cartpole_config():
    Config().validate()
    assert config.load(CONFIGS / "cartpole_apex.yaml") == Config()


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    loaded = config.load(path)
    assert loaded.algo in config.ALGOS


def test_overrides_parse_values_as_yaml():
    c = config.load(None, ["env.id=Acrobot-v1", "model.hidden=[64, 32]", "learner.lr=1e-3", "env.max_episode_steps=200",
                           "transport.curve_dir=null", "actor.eval_envs=0"])
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


def alias_bomb(levels: int = 9) -> str:
    """A few hundred bytes of YAML that aliases expand to 9**levels values."""
    lines = ["env:", "  kwargs:", '    a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    lines += [f"    a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


def config_show(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "apex", "config", "show", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_hostile2_11_an_alias_bomb_is_refused_in_one_line_within_seconds(tmp_path):
    """Issue 30, item 11: 510 bytes of YAML aliases in env.kwargs kept `apex config show`
    busy past 10 s (a billion values); a config's YAML may expand to 100,000 values."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    assert len(bomb.read_bytes()) < 600
    # The CLI first (the old code never returned): one line, exit 2, in a couple of seconds with apex's start-up.
    started = time.monotonic()
    out = config_show(str(bomb), timeout=20)
    assert time.monotonic() - started < 10
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [f"apex config: error: {bomb}: its YAML aliases expand it past 100000 "
                                               "values (an alias bomb?): write the values out, or use fewer aliases"]
    started = time.monotonic()
    with pytest.raises(ConfigError, match="aliases expand it past 100000 values"):
        config.load(bomb)
    with pytest.raises(ConfigError, match="aliases expand it past"):
        config.load(None, ["env.kwargs={a: &a [x, x, x, x, x, x, x, x, x, x], b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, "
                           "*a], c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b], d: &d [*c, *c, *c, *c, *c, *c, *c, *c, "
                           "*c, *c], e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d, *d]}"])
    assert time.monotonic() - started < 2
    loop = tmp_path / "loop.yaml"
    loop.write_text("env:\n  kwargs: &k {self: *k}\n")
    with pytest.raises(ConfigError, match="refers to a value that holds it"):
        config.load(loop)
    deep = tmp_path / "deep.yaml"
    deep.write_text("env:\n  kwargs: {a: " + "[" * 50_000 + "]" * 50_000 + "}\n")
    with pytest.raises(ConfigError, match="nested too deep"):
        config.load(deep)
    # an honest config's few aliases still load
    shared = tmp_path / "shared.yaml"
    shared.write_text("env:\n  kwargs: {a: &v [1, 2], b: *v}\n")
    assert config.load(shared).env.kwargs == {"a": [1, 2], "b": [1, 2]}


HUGE = "1" * 5000  # past int()'s 4,300 digits: PyYAML's int() raised ValueError, a traceback


@pytest.mark.parametrize("key, text, message", [
    ("learner.batch_size", HUGE, "learner.batch_size must be within -2**53..2**53, got an integer of 5000 digits"),
    ("learner.batch_size", str(2**60), f"learner.batch_size must be within -2**53..2**53, got {2**60}"),
    ("learner.lr", HUGE, "learner.lr must be within -2**53..2**53, got an integer of 5000 digits"),
    ("env.kwargs", "{size: " + HUGE + "}", "env.kwargs holds an integer outside -2**53..2**53: an integer of 5000 digits"),
    ("learner.lr", ".inf", "learner.lr must be a finite number, got inf"),
    ("learner.lr", ".nan", "learner.lr must be a finite number, got nan"),
    ("learner.lr", "1e400", "learner.lr must be a finite number, got '1e400'"),
    ("transport.max_abs_reward", "-.inf", "transport.max_abs_reward must be a finite number, got -inf"),
    ("actor.eps_repeat_mu", ".inf", "actor.eps_repeat_mu must be a finite number or null, got inf"),
])
def test_hostile2_11_integers_out_of_range_and_non_finite_floats_are_one_line_naming_the_key(tmp_path, key, text,
                                                                                             message):
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


def test_hostile2_11_config_show_says_a_huge_integer_and_an_infinite_rate_in_one_line_each(tmp_path):
    for args, message in ((["--set", f"learner.batch_size={HUGE}"], "learner.batch_size must be within"),
                          (["--set", "learner.lr=.inf"], "learner.lr must be a finite number, got inf")):
        out = config_show(*args)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        [line] = out.stderr.strip().splitlines()
        assert line.startswith(f"apex config: error: invalid configuration: {message}") and len(line) < 200, line
    path = tmp_path / "c.yaml"
    path.write_text(f"learner:\n  batch_size: {HUGE}\n")
    out = config_show(str(path))
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "apex config: error: invalid configuration: learner.batch_size must be within -2**53..2**53, got an integer "
        "of 5000 digits"], out.stderr[-2000:]
