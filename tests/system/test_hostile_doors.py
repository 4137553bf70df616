"""Hostile input, round three (issue 46, item 2): an attack pass over the doors that
multi-agent runs, self-play, serve's teams, APPO, Ape-X DDPG, the trackers and the learner's
run directory opened, as an attacker with the source would make it. Real learner processes
and real sockets where the door is a socket; each test asserts what a broken defence would
not give: the forgery counted by its reason, nothing it claims believed, training going on,
finite weights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from apex.bench.transport import free_base_port
from tests.support import processes
from tests.support.checkpoints import rewrite_state
from tests.support.paths import ROOT
from tests.support.peers import multi_agent_batch
from tests.support.processes import kill_leftovers, wait_for
from tests.support.runs import last_row
from tests.system.test_checkpoint import Resumed
from tests.system.test_hostile import Run, forged, honest_batch, send, trains_on_with_finite_weights

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def apex(*args: str, log: Path) -> subprocess.Popen:
    return processes.apex(*args, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


# -- the multi-agent wire


def multi_agent_forgeries(batch: dict, info: dict, other: str) -> dict[str, tuple[dict, dict]]:
    """What a peer with a live session can send to a learner of two policies: each forgery a
    (batch, info) that a learner that believed it would train on or count."""
    arrays = dict(batch)
    steps = int(np.prod(arrays["action"].shape[:2]))  # an unroll's [T, B] steps; a transition batch's [N]
    short = {**arrays, "action": arrays["action"][:-1]}
    return {
        "claims the other policy's name": (arrays, {**info, "policy": other}),
        "names agents the env has not": (arrays, {**info, "agents": ["ghost"]}),
        "a team return of 1e30": (arrays, {**info, "teams": [[1e30, 1, False]]}),
        "a NaN team return": (arrays, {**info, "teams": [[float("nan"), 1, False]]}),
        "a team a billion steps long": (arrays, {**info, "teams": [[0.0, 10**9, False]]}),
        "more teams than steps": (arrays, {**info, "teams": [[0.0, 1, True]] * (steps + 1)}),
        "an agent return of -1e30": (arrays, {**info, "episodes": [[-1e30, 1, True]]}),
        "matches without self-play": (arrays, {**info, "matches": [[-1, 1]]}),
        "rows that disagree in length": (short, info),
        "a policy name of 40 kB": (arrays, {**info, "policy": "p" * 40_000}),  # (the header cap refuses 64 kB)
    }


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_forged_multi_agent_batches_are_each_refused_and_believed_in_nothing(tmp_path, algo):
    """A learner of two policies of different spaces (speaker, listener), an honest actor, and
    a peer with a live session that sends each forgery of ``multi_agent_forgeries`` once: every
    one is refused (the count rises by exactly their number), none of the returns it claims
    reaches the run's figures, and training goes on."""
    port = free_base_port()
    logdir = tmp_path / "run"
    env = ["--env", "tests.multiagent_envs:speaker_listener", "--set", "multi_agent.mapping=per_agent"]
    env += ["--algo", algo, "--set", "learner.metrics_interval_s=0.5"]
    learner = apex(
        "learner", "--port", str(port), "--logdir", str(logdir), "--stop-seconds", "120", *env, log=tmp_path / "l.log"
    )
    actor = apex("actor", "--learner", f"127.0.0.1:{port}", "--allow-import", "tests", log=tmp_path / "a.log")
    peer = None
    try:
        wait_for(lambda: last_row(logdir).get("learner_updates", 0) > 20, 90, "updates")
        peer, core, batch, info = multi_agent_batch(port)
        other = next(name for name in ("speaker", "listener") if name != info["policy"])
        forgeries = multi_agent_forgeries(batch, info, other)
        before = last_row(logdir)["rejected_messages"]
        for forged_batch, forged_info in forgeries.values():
            assert peer.send_batch(forged_batch, weights_version=0, info=forged_info, timeout_s=20)
        assert peer.send_batch(batch, weights_version=0, info=info, timeout_s=20)  # an honest one after them

        def counted() -> bool:
            peer.tick()
            return last_row(logdir)["rejected_messages"] >= before + len(forgeries)

        wait_for(counted, 30, f"{len(forgeries)} refusals")
        updates = last_row(logdir)["learner_updates"]
        wait_for(lambda: last_row(logdir)["learner_updates"] > updates + 20, 60, "training going on")
        row = last_row(logdir)
        assert row["rejected_messages"] == before + len(forgeries), row["rejected_by_reason"]  # the honest one went in
        for figures in [row, *row["policies"].values()]:
            for key in ("return_mean_100", "train_return_mean_100"):
                assert figures.get(key) is None or abs(figures[key]) <= 10, (key, figures)
        assert learner.poll() is None and actor.poll() is None
        core.close()
    finally:
        if peer is not None:
            peer.close()
        for p in (learner, actor):
            p.terminate()
        for p in (learner, actor):
            p.wait(timeout=30)
        kill_leftovers([learner, actor])


# -- the self-play pool, as checkpoints carry it


def copy_checkpoint(honest: Path, number: int) -> Path:
    """A copy of the checkpoint ``honest`` (its state and manifest) as ckpt-``number``."""
    name = f"ckpt-{number:09d}"
    pt = honest.with_name(f"{name}.pt")
    shutil.copyfile(honest, pt)
    manifest = json.loads(honest.with_suffix(".json").read_text())
    pt.with_suffix(".json").write_text(json.dumps({**manifest, "name": name}))
    return pt


def forge_pool(pt: Path, change) -> None:
    saved = torch.load(pt, weights_only=True)
    change(saved["self_play_pool"])
    rewrite_state(pt, saved)


POOL_FORGERIES = {
    # a snapshot id of -1 would read as LATEST in every match against it
    "a snapshot id below 0": lambda pool: pool["snapshots"][0].update(id=-1),
    "two snapshots of one id": lambda pool: pool["snapshots"][1].update(id=pool["snapshots"][0]["id"]),
    "a snapshot id at next_id": lambda pool: pool["snapshots"][-1].update(id=pool["next_id"]),
    "a rating of 1e300": lambda pool: pool["snapshots"][0].update(rating=1e300),
    "a NaN rating of the newest policy": lambda pool: pool.update(rating=float("nan")),
    "NaN weights in a snapshot": lambda pool: next(iter(pool["snapshots"][0]["weights"].values())).fill_(float("nan")),
    "more snapshots than pool_size": lambda pool: pool["snapshots"].extend(pool["snapshots"]),
}


def plant_file(pt: Path, kind: str, elsewhere: Path) -> None:
    data = pt.read_bytes()
    pt.unlink()
    if kind == "a link out of the run":
        elsewhere.write_bytes(data)
        pt.symlink_to(elsewhere)
    elif kind == "a FIFO":
        os.mkfifo(pt)
    elif kind == "a truncated file":
        pt.write_bytes(data[: len(data) // 2])
    else:  # a sparse 2 GB file
        with pt.open("wb") as f:
            f.truncate(2 << 30)


def test_a_resumed_self_play_run_skips_every_forged_or_planted_pool_and_loads_the_honest_one(tmp_path):
    """A tictactoe self-play run's newest checkpoint, copied above itself eleven times, each
    copy forged in its pool (ids that read as LATEST or collide, absurd ratings, NaN weights, too
    many snapshots) or replaced by a link out of the run, a FIFO, a truncated or a 2 GB sparse
    file: `apex learner --resume` sets each aside in one line within seconds and resumes from
    the honest one, with its pool. (Before: the id of -1 and the colliding ids were loaded.)"""
    logdir = tmp_path / "run"
    args = ["--config", "tictactoe_apex", "--actors", "1", "--port", str(free_base_port()), "--logdir", str(logdir)]
    args += ["--set", "multi_agent.self_play.snapshot_every_updates=20", "--set", "multi_agent.self_play.pool_size=3"]
    trained = subprocess.run(
        [sys.executable, "-m", "apex", "run", *args, "--stop-seconds", "15"], cwd=ROOT, capture_output=True, text=True
    )
    assert trained.returncode == 0, trained.stderr
    honest = sorted((logdir / "checkpoints").glob("ckpt-*.pt"))[-1]
    pool = torch.load(honest, weights_only=True)["self_play_pool"]
    assert len(pool["snapshots"]) == 3
    number = int(honest.stem.split("-")[1])
    kinds = [*POOL_FORGERIES, "a link out of the run", "a FIFO", "a truncated file", "a sparse 2 GB file"]
    for k, kind in enumerate(kinds, start=1):
        pt = copy_checkpoint(honest, number + k)
        if kind in POOL_FORGERIES:
            forge_pool(pt, POOL_FORGERIES[kind])
        else:
            plant_file(pt, kind, tmp_path / f"elsewhere-{k}.pt")
    started = time.monotonic()
    resumed = Resumed(logdir, tmp_path / "resumed.log")
    try:
        assert resumed.wait_resumed(timeout=90) == honest.stem, resumed.text()[-3000:]
        seconds = time.monotonic() - started
        refused = [line for line in resumed.text().splitlines() if "refused" in line and "ckpt-" in line]
        assert len(refused) == len(kinds), "\n".join(refused)
        assert "Traceback" not in resumed.text()
        assert seconds < 60, seconds
    finally:
        assert resumed.stop() == 0
    assert (tmp_path / "elsewhere-8.pt").exists()  # what the link named was left alone


def test_a_second_learner_on_a_run_directory_in_use_is_refused_in_one_line(tmp_path):
    """Two learners writing one run directory would mix their checkpoints, self-play pools and
    metrics: the second is refused, naming the first's pid, and the first trains on. (Before:
    both ran, one metrics.jsonl of two runs' rows.)"""
    first = Run(tmp_path, "apex_dqn")
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "apex",
                "learner",
                "--logdir",
                str(first.logdir),
                "--port",
                str(free_base_port()),
                "--stop-seconds",
                "20",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode != 0
        error = second.stderr.strip().splitlines()[-1]
        assert f"in use by another learner (pid {first.learner.pid})" in error and "--logdir" in error, second.stderr
        assert "Traceback" not in second.stderr
        first.wait_updating()
    finally:
        assert first.stop() == 0


# -- APPO and Ape-X DDPG: every field poisoned

POISONS = {"NaN": np.nan, "+inf": np.inf, "-inf": -np.inf, "1e30": 1e30, "-0.0": -0.0, "-3e38": -3e38}
CONTINUOUS = {
    "appo": ["--set", "env.id=Pendulum-v1"],
    "apex_ddpg": [
        "--set",
        "env.id=Pendulum-v1",
        "--set",
        "apex_ddpg.replay.min_size=500",
        "--set",
        "apex_ddpg.batch_size=64",
        "--set",
        "apex_ddpg.replay_ratio=0.5",
    ],
}


def poisoned(batch: dict) -> tuple[list[dict], int]:
    """Every field of ``batch`` with each poison in its first element (the integer fields with
    their dtype's extremes), actions outside the Box and behaviour log-probabilities of ±3e38:
    (the forgeries, how many of them a learner must refuse at least: the non-finite ones and
    the actions and densities out of range)."""
    forgeries, must_refuse = [], 0
    for name, array in batch.items():
        if np.issubdtype(array.dtype, np.floating):
            for value in POISONS.values():
                forgeries.append(forged(batch, name, value))
                must_refuse += not np.isfinite(value)
        else:
            for value in (np.iinfo(array.dtype).min, np.iinfo(array.dtype).max):
                forgeries.append(forged(batch, name, value))
    for value in (2.5, -7.0, 3e38):  # Pendulum's torque is in [-2, 2]
        forgeries.append(forged(batch, "action", value))
        must_refuse += 1
    if "behaviour_logp" in batch:
        for value in (3e38, -3e38):
            forgeries.append(forged(batch, "behaviour_logp", value))
            must_refuse += 1
    return forgeries, must_refuse


@pytest.mark.parametrize("algo", ["appo", "apex_ddpg"])
def test_every_field_of_a_continuous_batch_poisoned_is_refused_or_trained_on_never_a_nonfinite_weight(tmp_path, algo):
    """A peer with a live session sends each of ``poisoned``'s forgeries of an honest Pendulum
    batch: the non-finite values, the actions outside the Box and the ±3e38 densities are
    refused and counted; what passes (-0.0, 1e30 where a field allows it, integer extremes
    where they are in range) is trained on. The learner trains on, publishes finite weights and
    exits 0 with a finite checkpoint."""
    run = Run(tmp_path, algo, *CONTINUOUS[algo])
    try:
        peer = run.session()
        batch = honest_batch(peer)
        forgeries, must_refuse = poisoned(batch)
        before = run.row()["rejected_messages"]
        for forgery in forgeries:
            send(peer, forgery)
        wait_for(lambda: run.row()["rejected_messages"] >= before + must_refuse, 60, f"{must_refuse} refusals")
        assert run.row()["nonfinite_weights"] == 0
        trains_on_with_finite_weights(run, peer)
    finally:
        run.stop()
