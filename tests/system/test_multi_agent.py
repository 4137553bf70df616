"""Multi-agent training on PettingZoo environments with real processes (`apex run`, `apex
learner` and `apex actor`), on the small tasks of tests/multiagent_envs.py: each fails a
learner that lacks what it tests (a shared policy, policies of their own spaces, masks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from apex import load_policy
from apex.bench.transport import free_base_port
from tests.support.learning import assert_reached
from tests.support.paths import ROOT
from tests.support.peers import multi_agent_batch
from tests.support.processes import apex, kill_leftovers, wait_for
from tests.support.runs import metrics

pytestmark = pytest.mark.timeout(240)


def run(tmp_path: Path, *args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "apex", "run", "--actors", "1", "--port", str(free_base_port()), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def summary(logdir: Path) -> dict:
    return json.loads((logdir / "summary.json").read_text())


def learned(tmp_path: Path, algo: str, env: str, stop_return: float, *extra: str, seconds: int = 150) -> dict:
    """`apex run` of ``env`` with ``algo`` until ``stop_return``: its summary, once it has
    reached it (over a full window of evaluation episodes)."""
    logdir = tmp_path / "run"
    args = ["--algo", algo, "--env", env, *extra, "--stop-return", str(stop_return), "--stop-seconds", str(seconds)]
    out = run(tmp_path, *args, "--logdir", str(logdir))
    assert out.returncode == 0, out.stderr
    result = summary(logdir)
    assert_reached(result, stop_return)
    return result


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_a_shared_policy_learns_a_cooperative_task_that_needs_the_partners_position(tmp_path, algo):
    """meet: going towards the partner gets 0.9, acting at random -0.4, and a policy blind to
    where its partner is cannot get near 0.75."""
    result = learned(tmp_path, algo, "tests.multiagent_envs:meet", 0.75)
    assert list(result["policies"]) == ["shared"]
    assert result["policies"]["shared"]["learner_updates"] == result["learner_updates"] > 0
    row = metrics(tmp_path / "run")[-1]
    assert row["policies"]["shared"]["return_mean_100"] >= 0.6  # each agent's own return
    assert row["rejected_messages"] == 0
    assert not {"pool_size", "elo", "win_rate_vs_pool"} & row["policies"]["shared"].keys()  # no self-play


# speaker_listener is a referential game (chance 0.25): a speaker that gives two of the four
# targets one word holds the pair at 0.75, a local optimum IMPALA stays in for minutes in about
# half the runs here (at entropy costs 0.01 and 0.05 alike), while others reach 0.95 in 20 s.
# Above 0.7 takes three distinct words understood: two policies of their own spaces learned
# to talk. Ape-X's exploration gets it out: 0.95.
SPOKEN = {"apex_dqn": 0.95, "impala": 0.7}


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_agents_with_different_spaces_learn_with_a_policy_each_and_a_shared_one_is_refused(tmp_path, algo):
    # chance is 0.25: the two learn one code between them
    result = learned(
        tmp_path, algo, "tests.multiagent_envs:speaker_listener", SPOKEN[algo], "--set", "multi_agent.mapping=per_agent"
    )
    policies = result["policies"]
    assert sorted(policies) == ["listener", "speaker"]
    assert all(p["learner_updates"] > 0 and p["trained"] for p in policies.values())

    refused = run(tmp_path, "--algo", algo, "--env", "tests.multiagent_envs:speaker_listener", "--stop-seconds", "5")
    assert refused.returncode == 2
    error = refused.stderr.strip().splitlines()[-1]
    assert "'speaker' and 'listener'" in error and "observation spaces differ" in error and "per_agent" in error
    assert "Traceback" not in refused.stderr


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_a_masked_action_is_never_taken_though_it_would_pay_the_most(tmp_path, algo):
    """masked_choice: action 0 would pay 10 and is always illegal; taking it writes a marker."""
    marker = tmp_path / "illegal"
    kwargs, publish = f"env.kwargs={{marker: {marker}}}", f"{algo}.publish_interval=1"
    env = "tests.multiagent_envs:masked_choice"
    learned(tmp_path, algo, env, 0.98, "--set", kwargs, "--set", publish, seconds=90)  # the legal optimum, 1 then 1
    assert not marker.exists()


def test_batches_for_an_unknown_policy_or_with_a_mask_that_allows_nothing_are_refused_and_training_goes_on(tmp_path):
    port = free_base_port()
    logdir = tmp_path / "run"
    env = ["--env", "tests.multiagent_envs:masked_choice", "--set", "learner.metrics_interval_s=0.5"]
    learner = apex("learner", "--port", str(port), "--logdir", str(logdir), "--stop-seconds", "60", *env, cwd=ROOT)
    actor = apex("actor", "--learner", f"127.0.0.1:{port}", "--allow-import", "tests", cwd=ROOT)
    peer = None
    try:
        wait_for(lambda: any(r.get("learner_updates", 0) > 50 for r in metrics(logdir)), 60, "updates")
        peer, core, forged, info = multi_agent_batch(port)
        assert peer.send_batch(forged, weights_version=0, info={**info, "policy": "nobody"}, timeout_s=20)
        empty = {**forged, "next_mask": np.zeros_like(forged["next_mask"])}
        assert peer.send_batch(empty, weights_version=0, info=info, timeout_s=20)
        assert peer.send_batch(forged, weights_version=0, info=info, timeout_s=20)  # an honest one goes in
        before = metrics(logdir)[-1]["learner_updates"]

        def refused_both() -> bool:
            peer.tick()
            row = metrics(logdir)[-1]
            reasons = row["rejected_by_reason"]
            return reasons.get("unknown_policy") == 1 and reasons.get("empty_mask") == 1

        wait_for(refused_both, 30, "both refusals counted")
        wait_for(lambda: metrics(logdir)[-1]["learner_updates"] > before + 50, 30, "training going on")
        core.close()
    finally:
        if peer is not None:
            peer.close()
        learner.terminate()
        actor.terminate()
        for p in (learner, actor):
            p.communicate(timeout=30)
        kill_leftovers([learner, actor])


def test_tictactoe_by_self_play_beats_a_random_player_and_resumes_with_every_policy_and_its_pool(tmp_path):
    logdir = tmp_path / "run"
    self_play = ["--env", "pettingzoo.classic:tictactoe_v3", "--set", "multi_agent.self_play.enabled=true"]
    pool = ["--set", "multi_agent.self_play.snapshot_every_updates=400", "--set", "multi_agent.self_play.pool_size=4"]
    out = run(tmp_path, *self_play, *pool, "--stop-seconds", "75", "--logdir", str(logdir))
    assert out.returncode == 0, out.stderr
    written = metrics(logdir)
    before = written[-1]
    shared = before["policies"]["shared"]
    assert shared["pool_size"] == 4 and shared["elo"] > 1000  # it beats its own past
    assert {"win_rate_vs_pool", "win_rate_vs_random"} <= shared.keys()
    saved = torch.load(sorted((logdir / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    snapshots = [s["id"] for s in saved["self_play_pool"]["snapshots"]]

    resumed = run(tmp_path, "--resume", str(logdir), "--stop-seconds", "8", timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    at_resume = metrics(logdir)[len(written)]  # the row the resumed learner writes first
    assert at_resume["learner_updates"] == before["learner_updates"]  # the policy's updates, restored
    assert at_resume["policies"]["shared"]["pool_size"] == 4
    assert at_resume["policies"]["shared"]["elo"] == shared["elo"]
    after = torch.load(sorted((logdir / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    kept = [s["id"] for s in after["self_play_pool"]["snapshots"]]
    # the same pool, gone on (a pool started afresh would number its snapshots from 0 again)
    assert len(set(snapshots) & set(kept)) >= 3 and max(kept) >= max(snapshots)

    wins, losses, illegal = play_random(load_policy(logdir, which="newest", policy="shared"), games=200)
    assert illegal == 0
    assert losses <= 20, (wins, losses)  # at most 10% lost, 100 games in each seat


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_a_pool_that_rotates_every_few_updates_under_two_actors_loses_no_actor(tmp_path, algo):
    """Snapshots leave a pool of 4 every 40 updates while 2 actors x 8 envs play episodes
    against them: each such episode finishes with the newest weights, no actor exits."""
    logdir = tmp_path / "run"
    rotating = ["--set", "multi_agent.self_play.pool_size=4"]
    rotating += ["--set", "multi_agent.self_play.snapshot_every_updates=40"]
    rotating += ["--set", "multi_agent.self_play.latest_prob=0.2", "--set", "actor.num_envs=8"]
    config = f"tictactoe_{algo.split('_')[0]}"
    out = run(tmp_path, "--config", config, "--actors", "2", "--logdir", str(logdir), "--stop-seconds", "45", *rotating)
    assert out.returncode == 0, out.stderr
    assert "exited" not in out.stderr, out.stderr
    rows = metrics(logdir)
    shared = rows[-1]["policies"]["shared"]
    assert rows[-1]["learner_updates"] >= 40 * 8  # 8 snapshots taken: the first 4 left the pool
    assert shared["pool_size"] == 4 and np.isfinite(shared["elo"])
    assert rows[-1]["rejected_messages"] == 0  # no honest batch refused (a match vs a gone snapshot)
    saved = torch.load(sorted((logdir / "checkpoints").glob("ckpt-*.pt"))[-1], weights_only=True)
    assert min(s["id"] for s in saved["self_play_pool"]["snapshots"]) >= 4
    assert all(np.isfinite(s["rating"]) for s in saved["self_play_pool"]["snapshots"])


def play_random(policy, games: int) -> tuple[int, int, int]:
    """(wins, losses, illegal moves) of ``policy`` against a uniformly random legal player,
    half the games in each seat."""
    from pettingzoo.classic import tictactoe_v3

    rng = np.random.default_rng(0)
    wins = losses = illegal = 0
    for game in range(games):
        env = tictactoe_v3.env()
        env.reset(seed=game)
        me = "player_1" if game < games // 2 else "player_2"
        for agent in env.agent_iter():
            obs, reward, terminated, truncated, _ = env.last()
            if terminated or truncated:
                if agent == me:
                    wins, losses = wins + (reward > 0), losses + (reward < 0)
                env.step(None)
                continue
            legal = np.flatnonzero(obs["action_mask"])
            action = int(policy.act(obs)) if agent == me else int(rng.choice(legal))
            illegal += agent == me and action not in legal
            env.step(action)
    return wins, losses, illegal


@pytest.mark.parametrize("algo", ["apex_dqn", "impala"])
def test_a_learner_group_trains_every_policy_on_each_ranks_batches_and_resumes(tmp_path, algo):
    """`apex run --ranks 2` of a run with two policies: the ranks agree on each policy's steps
    (a rank without a batch of that policy steps without one), rank 1 trains on its actor's
    batches, and its agents' returns reach rank 0's figures of each policy."""
    logdir = tmp_path / "run"
    per_agent = ["--set", "multi_agent.mapping=per_agent", "--actors", "2", "--ranks", "2"]
    result = learned(tmp_path, algo, "tests.multiagent_envs:speaker_listener", SPOKEN[algo], *per_agent)
    assert result["stop_reason"].startswith("return_mean_100")
    rows = metrics(logdir)
    assert all(row["ranks"] == 2 for row in rows)
    policies = result["policies"]
    assert all(p["learner_updates"] > 0 for p in policies.values())
    # One agent a policy: each policy has an episode for every team episode, rank 1's
    # included (without them, about half; each policy's batches come in on their own).
    assert rows[-1]["episodes"] > 1000
    assert all(row["policies"][name]["episodes"] >= 0.9 * row["episodes"] for row in rows for name in policies)
    if algo == "apex_dqn":  # rank 1's replays hold its actor's transitions
        own = [sum(p["replay_size"] for p in row["policies"].values()) for row in rows]
        assert max(row["group_replay_size"] - mine for row, mine in zip(rows, own)) > 0
    assert rows[-1]["rejected_messages"] == 0

    trusted = ["--allow-import", "tests.multiagent_envs", "--actors", "2", "--ranks", "2"]
    resumed = run(tmp_path, "--resume", str(logdir), *trusted, "--stop-seconds", "3", timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    at_resume = metrics(logdir)[len(rows)]
    assert at_resume["ranks"] == 2
    assert {n: p["updates"] for n, p in at_resume["policies"].items()} == {
        n: p["learner_updates"] for n, p in policies.items()
    }
