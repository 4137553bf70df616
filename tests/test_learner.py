"""The learner core without sockets: rate limiting and that an update learns."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from apex.config import Config
from apex.envs import EnvSpec
from apex.algos.apex_dqn import Learner as ApexLearner
from apex.learner import LearnerProcess, pick_device
from apex.replay import RateLimiter


def test_rate_limiter_holds_the_ratio_within_the_slack():
    limiter = RateLimiter(samples_per_insert=4.0, min_size=100, slack=400)
    assert limiter.can_insert() and not limiter.can_sample(32)
    limiter.inserted(100)  # min size reached: no samples owed yet
    assert limiter.can_sample(32)
    limiter.inserted(100)  # 400 samples owed = the slack: inserts may go on, one more batch
    assert limiter.can_insert()
    limiter.inserted(50)
    assert not limiter.can_insert()  # the learner is 600 samples behind
    limiter.sampled(600)
    assert limiter.can_insert()
    limiter.sampled(400)  # 400 ahead of the ratio: the learner must wait
    assert not limiter.can_sample(32)
    assert not limiter.wait_to_sample(32, timeout=0.01)
    limiter.inserted(10)
    assert limiter.can_sample(32)


def bandit_chunk(n: int) -> dict:
    """One state; action 0 pays 1, action 1 pays 0; episodes end at once."""
    rng = np.random.default_rng(0)
    action = rng.integers(0, 2, n)
    return {
        "frames": np.zeros((n + 1, 3), np.float32),
        "obs_frame": np.zeros(n, np.int32),
        "next_obs_frame": np.ones(n, np.int32),
        "action": action,
        "reward": (action == 0).astype(np.float32),
        "discount": np.zeros(n, np.float32),
        "priority": np.ones(n, np.float32),
    }


def test_updates_learn_the_better_action_and_lower_priorities():
    config = Config()
    config.learner.batch_size = 64
    config.learner.lr = 1e-2
    spec = EnvSpec((3,), np.dtype(np.float32), 1, 2)
    learner = ApexLearner(config, spec, torch.device("cpu"))
    assert learner.insert(bandit_chunk(500)) == 500
    first = learner.step()
    for _ in range(200):
        last = learner.step()
    q = learner.online(torch.zeros(1, 1, 3)).detach()[0]
    assert q[0].item() == pytest.approx(1.0, abs=0.1) and q[1].item() == pytest.approx(0.0, abs=0.1)
    assert last["td_abs_mean"] < first["td_abs_mean"]
    assert learner.replay.transitions.priorities(np.arange(500)).max() < 0.5  # written back
    weights = learner.weights()
    assert set(weights) == set(learner.online.state_dict())


def test_pick_device():
    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="CUDA is not available"):
            pick_device("cuda")


@pytest.mark.parametrize(
    "info",
    [
        {"env_steps": -1},
        {"env_steps": 1.5},
        {"episodes": "x"},
        {"episodes": [[1.0, 2]]},
        {"episodes": [[float("nan"), 2, True]]},
        {"episodes": [[1.0, 2, "yes"]]},
    ],
)
def test_batch_info_is_validated(info):
    with pytest.raises(ValueError):
        LearnerProcess._check_info(info)
    assert LearnerProcess._check_info({"episodes": [[3.0, 10, True]], "env_steps": 16}) == ([[3.0, 10, True]], 16)


def test_insert_many_merges_good_batches_and_reports_bad_ones():
    config = Config()
    spec = EnvSpec((3,), np.dtype(np.float32), 1, 2)
    learner = ApexLearner(config, spec, torch.device("cpu"))
    good = bandit_chunk(10)
    bad_action = {**bandit_chunk(10), "action": np.full(10, 5)}
    # Indices past its own 11 frames: merged with others they would point into a neighbour's.
    stray = {**bandit_chunk(10), "next_obs_frame": np.full(10, 15, np.int32)}
    errors = learner.insert_many([good, bad_action, bandit_chunk(10), stray])
    assert errors[0] is None and errors[2] is None
    assert "actions must be in" in str(errors[1]) and "must index stacks" in str(errors[3])
    assert len(learner.replay) == 20 and learner.replay.frames.added == 22
    batch, _, _ = learner.replay.sample(64, 0.4)
    assert set(batch["reward"].tolist()) <= {0.0, 1.0}


def test_lazily_decoded_batches_with_compressed_small_fields_go_in():
    """Large batches: actions and rewards compress too, not only frames (found with Acrobot)."""
    from apex.protocol import decode, encode

    config = Config()
    spec = EnvSpec((3,), np.dtype(np.float32), 1, 2)
    learner = ApexLearner(config, spec, torch.device("cpu"))
    fields = {"actor_index": 0, "weights_version": 0, "info": {}}
    big = bandit_chunk(2048)
    big["action"] = np.zeros(2048, np.int64)  # 16 kB of zeros: lz4
    lazy = decode(encode("batch", fields, big), lazy=True).arrays
    assert type(lazy["action"]).__name__ == "Compressed"
    broken = dict(lazy, reward="not an array")
    errors = learner.insert_many([lazy, broken, decode(encode("batch", fields, bandit_chunk(10)), lazy=True).arrays])
    assert errors[0] is None and errors[1] is not None and errors[2] is None
    assert len(learner.replay) == 2058
    assert learner.insert(decode(encode("batch", fields, big), lazy=True).arrays) == 2048
