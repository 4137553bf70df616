"""Ape-X's replay ratio (apex_dqn.replay_ratio: transitions trained per transition inserted)
held by a real learner whether its actors outrun it or it outruns them, and reported in
metrics.jsonl beside the ratio set."""

from __future__ import annotations

import pytest

from apex.bench.transport import free_base_port
from tests.support.processes import apex, kill_leftovers, wait_for
from tests.support.runs import FAST, last_row

# (the ratio set, the env's seconds a step, the inserts to read it at): with plain CartPole an
# actor makes thousands of transitions a second, more than a learner training 16 samples on
# each can take, so the actors must be held back; at 4 ms a step (4 envs: ~250 transitions a second) a learner
# training 2 samples on each has time to spare, and must wait for data. Without the limit the
# ratios would be ~5 and ~100. The ratio counts samples trained, and up to
# apex_dqn.prefetch_batches drawn batches (CartPole's: 64 of 64 = 4,096 samples) wait to be:
# the fast run is read once that is under 3% of what was trained.
PACES = {"fast actors": (16.0, 0.0, 10_000), "slow actors": (2.0, 0.004, 3_000)}


@pytest.mark.parametrize("pace", PACES)
def test_the_learner_holds_the_replay_ratio_whatever_the_actors_pace(tmp_path, pace):
    ratio, step_seconds, inserts = PACES[pace]
    logdir = tmp_path / "run"
    overrides = [
        *FAST,
        "--set",
        f"apex_dqn.replay_ratio={ratio}",
        "--set",
        "apex_dqn.batch_size=64",
        "--set",
        "apex_dqn.replay.min_size=500",
        "--set",
        "apex_dqn.replay.rate_slack=64",  # the least allowed (one batch): the ratio held tightly
        "--set",
        "apex_dqn.chunk_transitions=16",  # a message of 4 envs: 64 transitions, inserted whole
    ]
    if step_seconds:
        wrapper = f"{{type: tests.envs.SlowSteps, kwargs: {{seconds: {step_seconds}}}}}"
        overrides += ["--set", f"env.wrappers=[{wrapper}]"]
    run = apex(
        "run", "--actors", "1", "--logdir", str(logdir), "--port", str(free_base_port()), "--stop-seconds", "60",
        *overrides,
    )  # fmt: skip
    try:

        def trained_enough() -> bool:
            row = last_row(logdir)
            return row.get("inserted", 0) >= inserts and row.get("replay_ratio") is not None

        wait_for(trained_enough, 55, f"{inserts:,} transitions inserted")
        row = last_row(logdir)
        assert row["replay_ratio_target"] == ratio
        assert row["replay_ratio"] == pytest.approx(ratio, rel=0.1), row
    finally:
        run.terminate()
        run.communicate(timeout=60)
        kill_leftovers([run])
