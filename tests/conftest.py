import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

# Deterministic property tests: the same examples on every run, no flaky deadlines on a
# loaded 2-core CI machine.
settings.register_profile(
    "default",
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

TESTS = Path(__file__).resolve().parent
# The tests by kind: tests/unit runs in-process in seconds (`pytest -m "not slow"`); what
# starts real processes, learns, benchmarks or deploys is in tests/system and tests/deploy.
SLOW = ("system", "deploy")


def pytest_collection_modifyitems(config, items):
    """Every test under tests/system and tests/deploy is marked ``slow``."""
    for item in items:
        path = item.path.resolve()
        if path.is_relative_to(TESTS) and path.relative_to(TESTS).parts[0] in SLOW:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A CartPole Ape-X checkpoint file whose greedy policy always pushes left."""
    import torch

    from apex.algos.apex_dqn.learner import ApexDqnLearner
    from apex.config import Config
    from apex.envs.make import env_spec

    config = Config()
    learner = ApexDqnLearner(config, env_spec(config.env), torch.device("cpu"))
    # Push "left" (action 0) hard: the greedy policy must then always push left.
    with torch.no_grad():
        learner.online.advantage.bias.copy_(torch.tensor([10.0, -10.0]))
    path = tmp_path / "ckpt-000000001.pt"
    torch.save({**learner.state_dict(), "config": config.to_dict()}, path)
    return path
