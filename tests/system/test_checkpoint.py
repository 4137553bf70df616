"""Checkpoints given to real processes: a real `apex eval RUN` and a real `apex learner
--resume` on a run directory with something planted in it (hostile files, round two:
issue 30, items 7-9)."""

from __future__ import annotations

import json
import os
import pathlib
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from apex.bench.transport import free_base_port
from apex.checkpoint import CheckpointWriter
from tests.support.checkpoints import rewrite_state
from tests.support.processes import wait_for

# -- hostile files, round two (issue 30, items 7-9): a real `apex eval RUN` and a real
# `apex learner --resume` given a run directory with something planted in it


def learner_run(logdir: pathlib.Path) -> list[pathlib.Path]:
    """A run directory with two checkpoints of a real CartPole Ape-X learner, as
    LearnerProcess.save_checkpoint writes them; their state files, oldest first."""
    from apex.algos.apex_dqn.learner import ApexDqnLearner
    from apex.config import Config
    from apex.envs.make import env_spec
    from apex.learner.ingest import RunCounters

    config = Config()
    learner = ApexDqnLearner(config, env_spec(config.env), torch.device("cpu"))
    writer = CheckpointWriter(logdir / "checkpoints", keep=5)
    for n in (1, 2):
        saved = {**learner.state_dict(), **RunCounters().state_dict(), "time": float(n), "config": config.to_dict()}
        assert writer.save(f"ckpt-{n:09d}", saved, learner.checkpoint_replay)
    return sorted((logdir / "checkpoints").glob("ckpt-*.pt"))


def _address_space(limit: int):
    def set_limit() -> None:  # in the child
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return set_limit


EVAL_ADDRESS_SPACE = 3 << 30  # apex eval of CartPole needs under 1 GiB of it (RSS 0.25 GB)


def apex_eval(run: pathlib.Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """A real `apex eval RUN` of the newest checkpoint that loads, its address space bounded;
    TimeoutExpired (the child killed) if it takes longer than ``timeout``."""
    return subprocess.run(
        [sys.executable, "-m", "apex", "eval", "--checkpoint", str(run), "--which", "newest", "--episodes", "1"],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=_address_space(EVAL_ADDRESS_SPACE),
    )


class Resumed:
    """A real `apex learner --resume RUN`, its output in a file, stopped by SIGTERM."""

    def __init__(self, run: pathlib.Path, log: pathlib.Path, *extra: str) -> None:
        self.run, self.log = run, log
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "apex",
                "learner",
                "--resume",
                str(run),
                "--port",
                str(free_base_port()),
                "--stop-seconds",
                "600",
                *extra,
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            text=True,
        )

    def text(self) -> str:
        return self.log.read_text()

    def wait_resumed(self, timeout: float = 60) -> str:
        """The name of the checkpoint it resumed from, once it says so."""
        wait_for(
            lambda: "resumed from" in self.text() or self.process.poll() is not None,
            timeout,
            f"the learner to resume: {self.text()[-2000:]}",
        )
        found = re.search(r"resumed from (ckpt-\d+)", self.text())
        assert found, self.text()[-2000:]
        return found.group(1)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def shared_lists(levels: int, width: int) -> list:
    """Lists of lists, each level ``width`` references to every list of the level below:
    kilobytes to pickle, ``width ** levels`` paths to walk."""
    level = [[0.0] for _ in range(width)]
    for _ in range(levels):
        level = [list(level) for _ in range(width)]
    return level


def test_a_checkpoint_of_shared_lists_loads_in_seconds_in_eval_and_on_resume(tmp_path):
    # Walking every path through 8 ** 40 of them kept `apex eval RUN` busy for ever, and a
    # resume never started. They sit where a resume does not look (the run's own optimizer
    # options are used), so the checkpoint loads once the walk visits each list once.
    run = tmp_path / "run"
    pts = learner_run(run)
    saved = torch.load(pts[-1], weights_only=True)
    saved["optimizer"]["param_groups"][0]["shared"] = shared_lists(40, 8)
    rewrite_state(pts[-1], saved)
    assert pts[-1].stat().st_size < 400_000
    started = time.monotonic()
    evaluated = apex_eval(run)
    assert evaluated.returncode == 0, evaluated.stderr
    assert f"{pts[-1].stem} refused" not in evaluated.stderr
    assert time.monotonic() - started < 60
    resumed = Resumed(run, tmp_path / "learner.log")
    try:
        assert resumed.wait_resumed() == pts[-1].stem
    finally:
        assert resumed.stop() == 0


def _plant(pts: list[pathlib.Path], what: str) -> str:
    """Replaces the newest checkpoint's manifest with a link to /dev/zero, or its state file
    with a FIFO nobody writes; what the refusal says it is."""
    if what == "manifest link to /dev/zero":
        manifest = pts[-1].with_suffix(".json")
        manifest.unlink()
        manifest.symlink_to("/dev/zero")
        return "is a symbolic link, not a regular file"
    pts[-1].unlink()
    os.mkfifo(pts[-1])
    return "is a FIFO, not a regular file"


@pytest.mark.parametrize("what", ["manifest link to /dev/zero", "state FIFO"])
def test_run_files_that_are_not_regular_files_are_refused_in_one_line(tmp_path, what):
    # The link was read until MemoryError (1.6 GB, a traceback), the FIFO blocked the loader
    # until it was killed: both are set aside in one line and the checkpoint before is used.
    run = tmp_path / "run"
    pts = learner_run(run)
    shutil.copytree(run, tmp_path / "run-resumed")
    said = _plant(pts, what)
    evaluated = apex_eval(run)  # within 60 s and 3 GiB of address space
    assert evaluated.returncode == 0, evaluated.stderr
    refused = [line for line in evaluated.stderr.splitlines() if "refused" in line]
    assert len(refused) == 1 and f"checkpoint {pts[-1].stem} refused: " in refused[0] and said in refused[0], (
        evaluated.stderr
    )
    assert evaluated.stdout.count("over 1 episodes") == 1  # the one before played
    resumed_run = tmp_path / "run-resumed"
    _plant(sorted((resumed_run / "checkpoints").glob("ckpt-*.pt")), what)
    resumed = Resumed(resumed_run, tmp_path / "learner.log")
    try:
        assert resumed.wait_resumed() == pts[-2].stem
        assert len([line for line in resumed.text().splitlines() if said in line]) == 1, resumed.text()
    finally:
        assert resumed.stop() == 0


def test_a_resumed_checkpoint_with_impossible_returns_neither_stops_the_run_nor_is_its_best(tmp_path):
    # Returns of 1e300 in a checkpoint's episode statistics stopped the resumed run at once as
    # solved (--stop-return) and made them the run's best; no actor's episode record could
    # bring one (transport.max_abs_reward a step, CartPole's 500 steps).
    run = tmp_path / "run"
    pts = learner_run(run)
    saved = torch.load(pts[-1], weights_only=True)
    saved["episode_stats"] = {"eval": [1e300] * 100, "train": [1e300] * 100, "episodes": 100, "best": 1e300}
    rewrite_state(pts[-1], saved)
    resumed = Resumed(run, tmp_path / "learner.log", "--stop-return", "450")
    try:
        assert resumed.wait_resumed() == pts[-2].stem
        assert (
            f"checkpoint {pts[-1].stem} refused: {pts[-1].name}: episode_stats.eval holds a return of 1e+300"
            in resumed.text()
        )
        time.sleep(3)
        assert resumed.process.poll() is None, resumed.text()[-2000:]
    finally:
        assert resumed.stop() == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "signal SIGTERM" and summary["best_return_mean_100"] is None, summary
    assert summary["return_mean_100"] is None
