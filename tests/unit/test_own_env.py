"""env.id as module:Id, env.imports, env.kwargs, env.wrappers: made the same way in every
process, and every way they can be wrong said in one line before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from apex.bench.transport import free_base_port
from apex.config import ConfigError, EnvConfig, load
from apex.envs import make_env
from tests.test_e2e import apex

ROOT = Path(__file__).resolve().parent.parent


def test_module_colon_id_imports_the_module_first():
    env = make_env(EnvConfig(id="tests.probe_envs:apex-test/ProbeCartPole-v0", kwargs={"tag": "x"}))
    assert env.unwrapped.__class__.__name__ == "ProbeCartPole"
    env.close()


@pytest.mark.parametrize("env, message", [
    (EnvConfig(id="Corridor-v0"), "env.imports: [your_module] or env.id: your_module:Id"),
    (EnvConfig(id="no_such_module:Corridor-v0"), "cannot import 'no_such_module'"),
    (EnvConfig(imports=["no_such_module"]), "cannot import 'no_such_module'"),
    (EnvConfig(kwargs={"no_such_keyword": 1}), "env.kwargs {'no_such_keyword': 1} failed"),
    (EnvConfig(wrappers=["gymnasium.wrappers.NoSuchWrapper"]), "env.wrappers[0] 'gymnasium.wrappers.NoSuchWrapper'"),
    (EnvConfig(wrappers=["nowhere.Wrapper"]), "cannot import 'nowhere'"),
    (EnvConfig(wrappers=[{"type": "gymnasium.wrappers.ClipReward", "kwargs": {"nonsense": 1}}]),
     "env.wrappers[0] 'gymnasium.wrappers.ClipReward' failed"),
    (EnvConfig(wrappers=["builtins.repr"]), "returned str, not a gymnasium.Env"),
    # an allowed module's path may not walk out of it (issue 30: this reached subprocess.Popen)
    (EnvConfig(wrappers=["gymnasium.wrappers:atari_preprocessing.np.f2py.subprocess.Popen._execute_child"]),
     "'atari_preprocessing' is a module"),
    (EnvConfig(wrappers=["gymnasium.wrappers:TimeAwareObservation.__init__"]), "'__init__' is private"),
])
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


def test_apex_run_with_module_colon_id_from_the_modules_directory(tmp_path):
    """The `apex` script does not put the working directory on sys.path (python -m does):
    apex looks there for env modules, as its child processes do."""
    (tmp_path / "corridor_env.py").write_text(
        "import gymnasium as gym\n"
        "gym.register('Corr-v0', entry_point='gymnasium.envs.classic_control:CartPoleEnv', max_episode_steps=100)\n")
    script = Path(sys.executable).parent / "apex"
    out = subprocess.run([str(script), "run", "--env", "corridor_env:Corr-v0", "--stop-env-steps", "2000",
                          "--actors", "1", "--port", str(free_base_port()), "--logdir", "run"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "starting apex_dqn on corridor_env:Corr-v0" in out.stderr


def test_an_actor_that_cannot_import_the_env_module_says_which(tmp_path):
    port = free_base_port()
    learner = apex("learner", "--port", str(port), "--logdir", str(tmp_path / "run"), "--stop-seconds", "60",
                   "--set", "env.imports=[tests.probe_envs]", "--set", "env.id=apex-test/ProbeCartPole-v0",
                   cwd=ROOT)
    try:
        # from a directory where tests.probe_envs is not importable
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        start = time.monotonic()
        actor = subprocess.run([sys.executable, "-m", "apex", "actor", "--learner", f"127.0.0.1:{port}",
                                "--allow-import", "tests.probe_envs"],
                               cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
        assert actor.returncode == 2, actor.stderr
        last = actor.stderr.strip().splitlines()[-1]
        assert last.startswith("apex actor: error: cannot import 'tests.probe_envs'"), actor.stderr
        assert time.monotonic() - start < 30
    finally:
        learner.terminate()
        learner.communicate(timeout=30)
