"""Long runs: a killed learner resumed with its replay, apex run's learner supervisor, actors
that give up on a learner gone for good, TensorBoard files, the console status line."""

from __future__ import annotations

import io
import json
import os
import signal
import time

import pytest

from apex.bench.transport import free_base_port
from apex.learner.metrics import MetricsWriter, status_line
from tests.support.processes import apex, kill_leftovers, processes_mentioning, wait_for
from tests.support.runs import FAST, metrics

CHECKPOINT_OFTEN = ["--set", "learner.checkpoint_interval_s=1", "--set", "apex_dqn.replay.capacity=20000"]


def newest_manifest(logdir) -> dict | None:
    manifests = sorted((logdir / "checkpoints").glob("ckpt-*.json"))
    return json.loads(manifests[-1].read_text()) if manifests else None


def checkpoint_with_replay(logdir, min_items: int) -> bool:
    manifest = newest_manifest(logdir)
    if manifest is None or manifest["replay_header"] is None:
        return False
    start, _, end = manifest["replay_header"]["items"]
    return end - start >= min_items and manifest["name"] != "ckpt-000000000"


def test_learner_killed_and_resumed_keeps_its_replay_and_its_actors(tmp_path):
    logdir, port = tmp_path / "run", free_base_port()
    learner = apex("learner", "--logdir", str(logdir), "--port", str(port), *FAST, *CHECKPOINT_OFTEN)
    actors = [apex("actor", "--learner", f"127.0.0.1:{port}", *FAST[:4]) for _ in range(2)]
    try:
        wait_for(lambda: checkpoint_with_replay(logdir, 5000), 90, "a checkpoint holding 5000 transitions")
        learner.send_signal(signal.SIGKILL)
        learner.wait(timeout=10)
        checkpoint = newest_manifest(logdir)
        saved = json.loads((logdir / "checkpoints" / f"{checkpoint['name']}.json").read_text())
        time.sleep(2)
        assert all(a.poll() is None for a in actors), "actors must outlive the learner"
        rows_before = len(metrics(logdir))

        target = 40_000
        resumed = apex("learner", "--resume", str(logdir), "--port", str(port), "--stop-env-steps", str(target))
        _out, err = resumed.communicate(timeout=120)
        assert resumed.returncode == 0, err
        assert f"resumed from {saved['name']}" in err
        rows = metrics(logdir)[rows_before:]
        first = rows[0]
        # The replay came back: training went on at once, from the saved counters.
        assert first["replay_size"] >= 5000
        assert first["learner_updates"] >= int(saved["name"].split("-")[1])
        summary = json.loads((logdir / "summary.json").read_text())
        assert summary["resumed_from"] == saved["name"] and summary["env_steps"] >= target
        # The same actor processes reconnected by themselves and were told to stop.
        for actor in actors:
            _, actor_err = actor.communicate(timeout=20)
            assert actor.returncode == 0, actor_err
            assert "new handshake" in actor_err or "reconnecting" in actor_err
            assert actor_err.count(" envs of ") == 1, "the same process, its environments kept"
    finally:
        kill_leftovers([learner, *actors])


def test_run_restarts_a_killed_learner_from_its_checkpoint(tmp_path):
    logdir = tmp_path / "run"
    run = apex(
        "run",
        "--actors",
        "2",
        "--logdir",
        str(logdir),
        "--port",
        str(free_base_port()),
        "--stop-env-steps",
        "60000",
        *FAST,
        *CHECKPOINT_OFTEN,
    )
    try:
        wait_for(lambda: checkpoint_with_replay(logdir, 2000), 90, "a checkpoint")
        learners = [line for line in processes_mentioning(str(logdir)) if " learner " in line]
        assert len(learners) == 1, learners
        os.kill(int(learners[0].split()[0]), signal.SIGKILL)
        _out, err = run.communicate(timeout=150)
    finally:
        kill_leftovers([run])
    assert run.returncode == 0, err
    assert "learner exited with -9; restarting it from its newest checkpoint" in err
    summary = json.loads((logdir / "summary.json").read_text())
    assert summary["resumed_from"] is not None and summary["env_steps"] >= 60000
    assert processes_mentioning(str(logdir)) == []


def test_resume_without_checkpoints_is_a_clear_error(tmp_path):
    proc = apex("learner", "--resume", str(tmp_path), "--port", str(free_base_port()))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip().splitlines()[-1].startswith(f"apex learner: error: no checkpoints in {tmp_path}")


def test_actor_gives_up_on_a_learner_that_never_answers(tmp_path):
    start = time.monotonic()
    proc = apex(
        "actor", "--learner", f"127.0.0.1:{free_base_port()}", *FAST[:4], "--set", "transport.give_up_after_s=3"
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "no learner answered" in err and "transport.give_up_after_s" in err
    assert time.monotonic() - start < 30


ROW = {
    "time": 12.0,
    "env_steps": 5000,
    "learner_updates": 40,
    "env_steps_per_s": 1000.0,
    "updates_per_s": 8.0,
    "return_mean_100": 21.5,
    "replay_size": 2500,
    "replay_capacity": 10000,
    "actors_connected": 2,
    "policy_lag_mean": 3.0,
    "loss": 0.25,
    "priority_mean": 0.5,
    "queue_unrolls": 3,
    "weights_version": 40,
}


class Console(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_status_line_on_a_terminal_and_plain_lines_every_30s_otherwise(tmp_path):
    tty, pipe = Console(True), Console(False)
    rows = [{**ROW, "time": t} for t in (2.0, 4.0, 31.0, 33.0, 62.0)]
    for console, logdir in ((tty, tmp_path / "a"), (pipe, tmp_path / "b")):
        writer = MetricsWriter(logdir, console=console, tensorboard=False)
        for row in rows:
            writer.write(row)
        writer.close()
        assert [json.loads(line) for line in (logdir / "metrics.jsonl").read_text().splitlines()] == rows
    # a terminal: one line redrawn in place; a pipe (Slurm, nohup): whole lines, every 30 s of run time
    assert tty.getvalue().count("\r") == len(rows) and tty.getvalue().count("\n") == 1
    assert pipe.getvalue().splitlines() == [status_line(rows[i]) for i in (0, 2, 4)]
    line = status_line({**ROW, "eval_episodes_in_window": 100})
    for part in (
        "env steps",
        "5,000",
        "1,000/s",
        "updates",
        "eval return    21.5 over 100 ep",
        "2,500 ( 25%)",
        "actors 2",
        "policy lag 3 updates",
    ):
        assert part in line, part
    assert "over" not in status_line(ROW) and "policy lag -" in status_line({**ROW, "policy_lag_mean": None})


def test_tensorboard_reads_the_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    writer = MetricsWriter(tmp_path, console=Console(False))
    writer.write(ROW)
    writer.write({**ROW, "env_steps": 9000, "return_mean_100": 30.0})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "return/return_mean_100",
        "throughput/updates_per_s",
        "lag/policy_lag_mean",
        "replay/replay_size",
        "replay/priority_mean",
        "replay/queue_unrolls",
        "loss/loss",
        "system/actors_connected",
    } <= tags
    returns = events.Scalars("return/return_mean_100")
    assert [(e.step, e.value) for e in returns] == [(5000, 21.5), (9000, 30.0)]


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_a_stopped_run_resumed_goes_on_from_its_counters(tmp_path, algo):
    logdir, port = tmp_path / "run", free_base_port()
    first = apex(
        "run",
        "--actors",
        "1",
        "--logdir",
        str(logdir),
        "--port",
        str(port),
        "--stop-env-steps",
        "8000",
        "--set",
        f"algo={algo}",
        "--set",
        "apex_dqn.replay.min_size=1000",
        *FAST,
    )
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    before = json.loads((logdir / "summary.json").read_text())
    second = apex("run", "--actors", "1", "--resume", str(logdir), "--port", str(port), "--stop-env-steps", "16000")
    _, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    after = json.loads((logdir / "summary.json").read_text())
    assert after["resumed_from"] == f"ckpt-{before['learner_updates']:09d}"
    assert after["env_steps"] >= 16000 and after["learner_updates"] > before["learner_updates"]
    assert after["wall_seconds"] > before["wall_seconds"]  # the run's clock went on
    manifest = newest_manifest(logdir)
    assert (manifest["replay_header"] is not None) == (algo == "apex_dqn")


def test_soak_with_churning_actors_keeps_the_learner_flat_and_leaves_nothing(tmp_path):
    from apex.bench import soak

    result = soak.run(
        seconds=35,
        actors=2,
        churn_s=3,
        checkpoint_s=5,
        overrides=("apex_dqn.replay.capacity=20000", "actor.num_envs=4"),
        logdir=str(tmp_path / "soak"),
    )
    assert result["passed"], result["problems"]
    assert result["actor_kills"] >= 3 and result["checkpoints_written"] >= 3
    assert result["learner_exit"] == 0 and result["leftover_pids"] == []
    assert result["rss_variation_percent"] < soak.RSS_LIMIT_PERCENT
