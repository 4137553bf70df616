"""Vector actors never import torch: a CartPole actor core made in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_a_cartpole_actor_core_never_imports_torch(algo):
    code = (
        "import sys\n"
        "from apex import algos\n"
        "from apex.config import Config\n"
        f"config = Config(algo={algo!r})\n"
        "welcome = {'num_envs': 2, 'epsilons': [0.5, 0.01], 'eval_envs': [False, True]}\n"
        f"actor = algos.get({algo!r}).actor().core(config, welcome, seed=0)\n"
        "for _ in range(50):\n"
        "    actor.act()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
