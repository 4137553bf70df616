"""env.id as module:Id, env.imports, env.kwargs, env.wrappers in-process: what they make, and
every way they can be wrong said in one line before anything starts (real processes:
tests/system/test_own_env.py)."""

from __future__ import annotations

import pytest

from apex.config import ConfigError, EnvConfig, load
from apex.envs.make import make_env


def test_module_colon_id_imports_the_module_first():
    env = make_env(EnvConfig(id="tests.probe_envs:apex-test/ProbeCartPole-v0", kwargs={"tag": "x"}))
    assert env.unwrapped.__class__.__name__ == "ProbeCartPole"
    env.close()


@pytest.mark.parametrize(
    "env, message",
    [
        (EnvConfig(id="Corridor-v0"), "env.imports: [your_module] or env.id: your_module:Id"),
        (EnvConfig(id="no_such_module:Corridor-v0"), "cannot import 'no_such_module'"),
        (EnvConfig(imports=["no_such_module"]), "cannot import 'no_such_module'"),
        (EnvConfig(kwargs={"no_such_keyword": 1}), "env.kwargs {'no_such_keyword': 1} failed"),
        (
            EnvConfig(wrappers=["gymnasium.wrappers.NoSuchWrapper"]),
            "env.wrappers[0] 'gymnasium.wrappers.NoSuchWrapper'",
        ),
        (EnvConfig(wrappers=["nowhere.Wrapper"]), "cannot import 'nowhere'"),
        (
            EnvConfig(wrappers=[{"type": "gymnasium.wrappers.ClipReward", "kwargs": {"nonsense": 1}}]),
            "env.wrappers[0] 'gymnasium.wrappers.ClipReward' failed",
        ),
        (EnvConfig(wrappers=["builtins.repr"]), "returned str, not a gymnasium.Env"),
        # an allowed module's path may not walk out of it (issue 30: this reached subprocess.Popen)
        (
            EnvConfig(wrappers=["gymnasium.wrappers:atari_preprocessing.np.f2py.subprocess.Popen._execute_child"]),
            "'atari_preprocessing' is a module",
        ),
        (EnvConfig(wrappers=["gymnasium.wrappers:TimeAwareObservation.__init__"]), "'__init__' is private"),
    ],
)
def test_what_cannot_be_made_is_said_in_one_line(env, message):
    with pytest.raises(ConfigError) as error:
        make_env(env)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_wrappers_and_kwargs_are_validated_as_config():
    with pytest.raises(ConfigError, match=r"env.wrappers\[0\]: unknown keys \['typ'\]"):
        load(None, ["env.wrappers=[{typ: a.B}]"])
    with pytest.raises(ConfigError, match="env.kwargs must be a mapping"):
        load(None, ["env.kwargs=[1, 2]"])
    config = load(None, ["env.kwargs={length: 12, names: [a, b]}", "env.wrappers=[a.B, {type: c:D, kwargs: {k: 1}}]"])
    assert config.env.kwargs == {"length": 12, "names": ["a", "b"]}
    assert config.env.wrappers == ["a.B", {"type": "c:D", "kwargs": {"k": 1}}]
