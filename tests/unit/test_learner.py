"""The learner core without sockets: rate limiting and that an update learns."""

from __future__ import annotations

import select
import threading
import time

import numpy as np
import pytest
import torch

from apex import config as config_module
from apex.algos.apex_dqn.learner import ApexDqnLearner
from apex.config import Config
from apex.envs.make import EnvSpec
from apex.learner.metrics import status_line
from apex.learner.runtime import pick_device
from apex.replay import RateLimiter
from apex.training.pipeline import Wakeup
from tests.support.replays import bandit_chunk


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


def test_updates_learn_the_better_action_and_lower_priorities():
    config = config_module.load(None, ["apex_dqn.batch_size=64", "apex_dqn.lr=1e-2"])
    spec = EnvSpec((3,), np.dtype(np.float32), 1, 2)
    learner = ApexDqnLearner(config, spec, torch.device("cpu"))
    assert learner.insert(bandit_chunk(500)) == 500
    first = learner.step()
    for _ in range(200):
        last = learner.step()
    q = learner.online(torch.zeros(1, 1, 3)).detach()[0]
    assert q[0].item() == pytest.approx(1.0, abs=0.1) and q[1].item() == pytest.approx(0.0, abs=0.1)
    assert last["td_abs_mean"] < first["td_abs_mean"]
    assert learner.replay.priorities(np.arange(500)).max() < 0.5  # written back
    weights = learner.weights()
    assert set(weights) == set(learner.online.state_dict())


def test_the_replay_ratio_is_what_was_trained_per_transition_inserted_and_is_on_the_status_line():
    config = config_module.load(
        None, ["apex_dqn.batch_size=64", "apex_dqn.replay.min_size=100", "apex_dqn.replay_ratio=2"]
    )
    learner = ApexDqnLearner(config, EnvSpec((3,), np.dtype(np.float32), 1, 2), torch.device("cpu"))
    assert learner.metrics()["replay_ratio"] is None  # nothing inserted past min_size yet
    learner.insert(bandit_chunk(500))
    for _ in range(5):
        learner.step()
    row = learner.metrics()
    assert (row["replay_ratio"], row["replay_ratio_target"]) == (5 * 64 / 400, 2.0)
    assert "replay       500 (  0%) ratio 0.80 of 2  actors" in status_line({**row, "time": 1.0})


def test_pick_device():
    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(Exception, match="CUDA is not available"):
            pick_device("cuda")


def validated(learner, arrays: dict, num_envs: int = 16) -> dict:
    """A batch as the learner process hands it to its core: checked against the schema."""
    return learner.schema.validate(arrays, learner.batch_limits(num_envs))[0]


def test_insert_many_merges_validated_batches():
    config = Config()
    spec = EnvSpec((3,), np.dtype(np.float32), 1, 2)
    learner = ApexDqnLearner(config, spec, torch.device("cpu"))
    errors = learner.insert_many([validated(learner, bandit_chunk(10)) for _ in range(3)])
    assert errors == [None, None, None]
    assert len(learner.replay) == 30 and learner.replay.frames.added == 33
    batch, _, _ = learner.replay.sample(64, 0.4)
    assert set(batch["reward"].tolist()) <= {0.0, 1.0}
    # Merged, each batch's indices still point into its own frames (rewards follow actions).
    assert np.array_equal(batch["reward"] == 1.0, batch["action"] == 0)


def test_lazily_decoded_batches_with_compressed_small_fields_go_in():
    """Large batches: actions and rewards compress too, not only frames (found with Acrobot)."""
    from apex.bench.batches import BATCH_FIELDS
    from apex.wire.protocol import decode, encode

    config = Config()
    spec = EnvSpec((3,), np.dtype(np.float32), 1, 2)
    learner = ApexDqnLearner(config, spec, torch.device("cpu"))
    big = bandit_chunk(2048)
    big["action"] = np.zeros(2048, np.int64)  # 16 kB of zeros: lz4
    lazy = decode(encode("batch", BATCH_FIELDS, big), lazy=True).arrays
    assert type(lazy["action"]).__name__ == "Compressed"
    small = decode(encode("batch", BATCH_FIELDS, bandit_chunk(10)), lazy=True).arrays
    errors = learner.insert_many([validated(learner, lazy, num_envs=64), validated(learner, small)])
    assert errors == [None, None]
    assert len(learner.replay) == 2058


def readable(fd: int, timeout_s: float = 0.0) -> bool:
    return bool(select.select([fd], [], [], timeout_s)[0])


def test_the_wakeup_rouses_a_waiting_loop_only():
    """The learner's loop blocks on its poller when it cannot train; the prefetch thread's
    notify makes the wake-up readable only while the loop waits (a training loop pays no
    write a batch), and drain leaves it quiet again."""
    wakeup = Wakeup()
    try:
        wakeup.notify()
        assert not readable(wakeup.fileno())
        wakeup.waiting = True
        threading.Timer(0.05, wakeup.notify).start()
        started = time.monotonic()
        assert readable(wakeup.fileno(), timeout_s=10)
        assert time.monotonic() - started < 5
        for _ in range(100_000):  # more wake-ups than the pipe holds: never blocks the prefetch thread
            wakeup.notify()
        wakeup.drain()
        assert not readable(wakeup.fileno())
    finally:
        wakeup.close()


def test_env_steps_by_host_holds_at_most_max_hosts_and_loses_no_step():
    """A peer with many addresses (an IPv6 network's) cannot grow the map that every metrics
    row and checkpoint carries: past MAX_HOSTS hosts, steps go under OTHER_HOSTS."""
    from apex.learner.ingest import MAX_HOSTS, OTHER_HOSTS, RunCounters

    counters = RunCounters()
    for i in range(MAX_HOSTS + 500):
        counters.add_host_steps(f"2001:db8::{i:x}", 3)
    counters.add_host_steps("2001:db8::0", 1)  # a host counted apart stays apart
    by_host = counters.env_steps_by_host
    assert len(by_host) == MAX_HOSTS + 1 and by_host[OTHER_HOSTS] == 500 * 3
    assert by_host["2001:db8::0"] == 4 and sum(by_host.values()) == (MAX_HOSTS + 500) * 3 + 1
