"""env.id as module:Id made the same way in every process: `apex run` from the module's own
directory, and an actor that cannot import the env module says which."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from apex.bench.transport import free_base_port
from tests.support.paths import ROOT
from tests.support.processes import apex


def test_apex_run_with_module_colon_id_from_the_modules_directory(tmp_path):
    """The `apex` script does not put the working directory on sys.path (python -m does):
    apex looks there for env modules, as its child processes do."""
    (tmp_path / "corridor_env.py").write_text(
        "import gymnasium as gym\n"
        "gym.register('Corr-v0', entry_point='gymnasium.envs.classic_control:CartPoleEnv', max_episode_steps=100)\n"
    )
    script = Path(sys.executable).parent / "apex"
    out = subprocess.run(
        [
            str(script),
            "run",
            "--env",
            "corridor_env:Corr-v0",
            "--stop-env-steps",
            "2000",
            "--actors",
            "1",
            "--port",
            str(free_base_port()),
            "--logdir",
            "run",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "starting apex_dqn on corridor_env:Corr-v0" in out.stderr


def test_an_actor_that_cannot_import_the_env_module_says_which(tmp_path):
    port = free_base_port()
    learner = apex(
        "learner",
        "--port",
        str(port),
        "--logdir",
        str(tmp_path / "run"),
        "--stop-seconds",
        "60",
        "--set",
        "env.imports=[tests.probe_envs]",
        "--set",
        "env.id=apex-test/ProbeCartPole-v0",
        cwd=ROOT,
    )
    try:
        # from a directory where tests.probe_envs is not importable
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        start = time.monotonic()
        actor = subprocess.run(
            [
                sys.executable,
                "-m",
                "apex",
                "actor",
                "--learner",
                f"127.0.0.1:{port}",
                "--allow-import",
                "tests.probe_envs",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert actor.returncode == 2, actor.stderr
        last = actor.stderr.strip().splitlines()[-1]
        assert last.startswith("apex actor: error: cannot import 'tests.probe_envs'"), actor.stderr
        assert time.monotonic() - start < 30
    finally:
        learner.terminate()
        learner.communicate(timeout=30)
