"""Checkpoint files: atomic writes, manifests, verification, fallback past bad ones, pruning."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import pathlib
import re
import time
import zlib

import numpy as np
import pytest
import torch

from apex.checkpoint import (
    CheckpointWriter,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    best_and_newest,
    candidates,
    find,
    find_latest,
    first_loadable,
    mark_corrupt,
    verify,
)
from apex.errors import ApexError
from apex.replay import StackedReplay
from tests.support.checkpoints import RunsCode, rewrite_state, state, within
from tests.support.replays import assert_stacks_are_their_own, bandit_chunk, fill, new_like


def small_replay() -> StackedReplay:
    replay = StackedReplay((1,), np.int64, stack=2, capacity=50, frame_capacity=80, seed=0)
    fill(replay, 8)
    return replay


def write(directory, updates: int, replay=None, keep: int = 5, background: bool = False) -> CheckpointWriter:
    writer = CheckpointWriter(directory, keep)
    assert writer.save(f"ckpt-{updates:09d}", state(updates), replay, background=background)
    writer.wait()
    return writer


def test_written_checkpoint_verifies_and_restores_state_and_replay(tmp_path):
    replay = small_replay()
    write(tmp_path, 100, replay, background=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000100.json",
        "ckpt-000000100.pt",
        "ckpt-000000100.replay",
    ]
    checkpoint = find_latest(tmp_path)
    assert checkpoint.name == "ckpt-000000100" and checkpoint.config == {"algo": "apex_dqn"}
    loaded = checkpoint.load_state()
    assert loaded["updates"] == 100 and torch.equal(loaded["weights"], torch.full((4,), 100.0))
    restored = new_like(replay)
    checkpoint.load_replay(restored)
    assert len(restored) == len(replay) and restored.total_added == replay.total_added
    assert_stacks_are_their_own(restored)


def test_a_run_directory_resolves_to_its_checkpoints(tmp_path):
    write(tmp_path / "checkpoints", 7)
    assert find_latest(tmp_path).name == "ckpt-000000007"
    assert find_latest(tmp_path).logdir == tmp_path
    with pytest.raises(ApexError, match="no checkpoints in"):
        find_latest(tmp_path / "nothing")


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d / "ckpt-000000200.pt", "truncated"),
        (lambda d: d / "ckpt-000000200.replay", "truncated"),
    ],
)
def test_truncated_newest_checkpoint_is_refused_and_the_previous_used(tmp_path, caplog, damage, message):
    write(tmp_path, 100, small_replay())
    write(tmp_path, 200, small_replay())
    path = damage(tmp_path)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CorruptCheckpoint, match=message):
        verify(tmp_path / "ckpt-000000200.json")
    with caplog.at_level(logging.WARNING):
        checkpoint = find_latest(tmp_path)
    assert checkpoint.name == "ckpt-000000100"
    assert "ckpt-000000200 refused" in caplog.text and message in caplog.text
    # Set aside, never tried again; the good one is untouched.
    assert (tmp_path / "ckpt-000000200.json.corrupt").exists() and not (tmp_path / "ckpt-000000200.json").exists()
    assert find_latest(tmp_path).name == "ckpt-000000100"


def test_a_flipped_byte_that_torch_load_would_accept_is_caught(tmp_path):
    write(tmp_path, 100)
    write(tmp_path, 200)
    path = tmp_path / "ckpt-000000200.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # tensor bytes: torch.load itself would not notice
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="CRC-32"):
        verify(tmp_path / "ckpt-000000200.json")
    assert find_latest(tmp_path).name == "ckpt-000000100"


def test_no_valid_checkpoint_is_a_clear_error(tmp_path):
    write(tmp_path, 100)
    (tmp_path / "ckpt-000000100.json").write_text("{not json")
    with pytest.raises(ApexError, match="no valid checkpoint .* start without --resume"):
        find_latest(tmp_path)


def test_manifest_is_written_last_so_a_killed_write_leaves_no_checkpoint(tmp_path):
    write(tmp_path, 100)
    # What a learner killed half way through ckpt 200 leaves: files without a manifest.
    (tmp_path / "ckpt-000000200.replay").write_bytes(b"partial")
    (tmp_path / "ckpt-000000200.pt.tmp").write_bytes(b"partial")
    assert find_latest(tmp_path).name == "ckpt-000000100"
    write(tmp_path, 300)  # a new writer clears the leftovers
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-000000100.json",
        "ckpt-000000100.pt",
        "ckpt-000000300.json",
        "ckpt-000000300.pt",
    ]


def test_only_the_newest_k_are_kept(tmp_path):
    writer = CheckpointWriter(tmp_path, keep=2)
    for updates in (1, 2, 3, 4):
        writer.save(f"ckpt-{updates:09d}", state(updates), small_replay())
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["ckpt-000000003.json", "ckpt-000000004.json"]
    assert len(list(tmp_path.glob("*.replay"))) == 2 and len(list(tmp_path.glob("*.pt"))) == 2
    assert writer.written == 4


def scored(directory, scores: dict[int, float | None], keep: int = 5) -> CheckpointWriter:
    """Checkpoints ckpt-<updates> saved in order, each with its run's return_mean_100."""
    writer = CheckpointWriter(directory, keep)
    for updates, score in scores.items():
        assert writer.save(f"ckpt-{updates:09d}", state(updates), score=score)
    return writer


def names(directory) -> list[str]:
    return sorted(p.stem for p in pathlib.Path(directory).glob("*.json"))


def test_pruning_keeps_the_best_beyond_the_newest_k(tmp_path):
    writer = scored(tmp_path, {1: 10.0, 2: 500.0, 3: 377.0, 4: None, 5: 377.0}, keep=2)
    assert names(tmp_path) == ["ckpt-000000002", "ckpt-000000004", "ckpt-000000005"]
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == [f"{n}.pt" for n in names(tmp_path)]
    assert writer.best_score == 500.0
    # A better one takes its place; the old best goes once it is not among the newest either.
    scored(tmp_path, {6: 600.0}, keep=2)
    assert names(tmp_path) == ["ckpt-000000005", "ckpt-000000006"]
    # Ties: the newest of the equals is the best kept.
    scored(tmp_path, {7: 600.0, 8: 1.0, 9: 2.0}, keep=2)
    assert names(tmp_path) == ["ckpt-000000007", "ckpt-000000008", "ckpt-000000009"]
    # A new writer (a resumed learner) knows the best saved before it.
    assert CheckpointWriter(tmp_path, keep=2).best_score == 600.0


def test_the_score_is_recorded_in_the_manifest(tmp_path):
    scored(tmp_path, {1: None, 2: 12.5, 3: float("nan")})
    manifests = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in names(tmp_path)}
    assert [m["return_mean_100"] for m in manifests.values()] == [None, 12.5, None]
    assert manifests["ckpt-000000002"]["eval_episodes"] == 0  # state()'s episode_stats has no eval returns
    assert [c.score for c in candidates(tmp_path)] == [None, 12.5, None]


def test_find_best_picks_the_highest_score_and_newest_the_newest(tmp_path):
    scored(tmp_path / "checkpoints", {1: 10.0, 2: 500.0, 3: 377.0, 4: None})
    assert find(tmp_path, "best").name == "ckpt-000000002"
    assert find(tmp_path, "newest").name == "ckpt-000000004" == find_latest(tmp_path).name
    assert [c.name for c in candidates(tmp_path, "best")] == [
        "ckpt-000000002",
        "ckpt-000000003",
        "ckpt-000000001",
        "ckpt-000000004",
    ]
    best, best_score, newest = best_and_newest(tmp_path)
    assert (best.name, best_score, newest.name) == ("ckpt-000000002.pt", 500.0, "ckpt-000000004.pt") and best.is_file()
    with pytest.raises(ApexError, match="'latest' is neither 'best'"):
        find(tmp_path, "latest")


def test_best_without_any_score_is_the_newest(tmp_path):
    scored(tmp_path, {1: None, 2: None, 3: None})
    assert find(tmp_path, "best").name == "ckpt-000000003"
    best, best_score, newest = best_and_newest(tmp_path)
    assert (best, best_score, newest.name) == (None, None, "ckpt-000000003.pt")  # nothing to call best yet
    assert best_and_newest(tmp_path / "nothing") == (None, None, None)


def test_a_corrupt_best_is_set_aside_and_the_next_best_used(tmp_path, caplog):
    scored(tmp_path, {1: 300.0, 2: 500.0, 3: 100.0})
    path = tmp_path / "ckpt-000000002.pt"
    path.write_bytes(path.read_bytes()[:-7])
    with caplog.at_level(logging.WARNING):
        assert find(tmp_path, "best").name == "ckpt-000000001"
    assert "ckpt-000000002 refused" in caplog.text and (tmp_path / "ckpt-000000002.json.corrupt").exists()
    # One that verifies but does not load: first_loadable walks on, best first.
    forge(tmp_path, 4, tmp_path / "marker")
    edit_manifest(tmp_path, 4, lambda m: m.update(return_mean_100=900.0))
    assert first_loadable(tmp_path, lambda c: c.load_state()["updates"], which="best") == 1
    assert (tmp_path / "ckpt-000000004.pt.corrupt").exists() and not (tmp_path / "marker").exists()
    assert first_loadable(tmp_path, lambda c: c.load_state()["updates"], which="newest") == 3


def test_an_old_manifest_without_a_score_still_loads(tmp_path):
    write(tmp_path, 100)
    scored(tmp_path, {200: 5.0})
    edit_manifest(tmp_path, 100, lambda m: [m.pop("return_mean_100"), m.pop("eval_episodes")])
    old = verify(tmp_path / "ckpt-000000100.json")
    assert old.score is None and "return_mean_100" not in old.manifest
    assert old.load_state()["updates"] == 100
    assert [c.name for c in candidates(tmp_path, "best")] == ["ckpt-000000200", "ckpt-000000100"]
    assert find(tmp_path, "newest").name == "ckpt-000000200"


def test_a_second_background_save_while_one_runs_is_skipped(tmp_path):
    class SlowReplay:
        def save(self, f):
            import time

            time.sleep(0.3)
            return {}

    writer = CheckpointWriter(tmp_path, keep=3)
    assert writer.save("ckpt-000000001", state(1), SlowReplay(), background=True)
    assert not writer.save("ckpt-000000002", state(2), background=True)
    writer.wait()
    assert [p.name for p in tmp_path.glob("*.json")] == ["ckpt-000000001.json"]
    assert json.loads((tmp_path / "ckpt-000000001.json").read_text())["files"]["replay"]["bytes"] == 0


def test_eval_refuses_a_corrupt_checkpoint_with_one_line(tmp_path):
    from apex.run.evaluation import load_checkpoint

    write(tmp_path, 100)
    path = tmp_path / "ckpt-000000100.pt"
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ApexError, match="truncated"):
        load_checkpoint(path)


def test_checkpoint_benchmark_reports_a_full_restore_while_inserting():
    from apex.bench import checkpoint as bench

    result = bench.run(seconds=0.2, capacity=20_000)
    assert result["replay_transitions"] == 20_000
    assert result["restored_transitions"] >= 0.9 * 20_000
    assert result["checkpoint_bytes"] > result["replay_nbytes"] * 0.8  # frames and items, not a stub
    assert result["inserts_before"]["inserts_per_s"] > 0 and result["inserts_during"]["median_ms"] is not None


# -- hostile and malformed checkpoints


def forge(directory, updates: int, marker, how: str = "os.system") -> None:
    """A checkpoint whose manifest matches its files (size, CRC-32) and whose .pt runs code
    when unpickled: size and CRC only detect accidents."""
    write(directory, updates)
    path = directory / f"ckpt-{updates:09d}.pt"
    torch.save({**state(updates), "online": RunsCode(marker, how)}, path)
    manifest_path = directory / f"ckpt-{updates:09d}.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["state"] = {"bytes": path.stat().st_size, "crc32": zlib.crc32(path.read_bytes())}
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.parametrize("how", ["os.system", "pathlib"])
def test_a_forged_checkpoint_runs_no_code_and_the_one_before_is_used(tmp_path, caplog, how):
    marker = tmp_path / "marker"
    write(tmp_path, 100)
    forge(tmp_path, 200, marker, how)
    found = list(candidates(tmp_path))  # size and CRC-32 match: it verifies
    assert [c.name for c in found] == ["ckpt-000000200", "ckpt-000000100"]
    with pytest.raises(CorruptCheckpoint, match="loaded without running code") as caught:
        found[0].load_state()
    assert "\n" not in str(caught.value)
    assert not marker.exists()
    with caplog.at_level(logging.WARNING):
        mark_corrupt(found[0], caught.value)
    assert "ckpt-000000200 refused" in caplog.text
    assert [c.name for c in candidates(tmp_path)] == ["ckpt-000000100"]
    assert find_latest(tmp_path).load_state()["updates"] == 100
    assert (tmp_path / "ckpt-000000200.pt.corrupt").exists() and not marker.exists()
    # The forgery is real: the old way of loading would have run it.
    torch.load(tmp_path / "ckpt-000000200.pt.corrupt", weights_only=False)
    assert marker.exists()


def test_a_learners_real_state_loads_without_running_code(tmp_path):
    """What LearnerProcess.save_checkpoint writes: state_dicts of networks and Adam (with
    its moments after some updates), counters, -inf, the full config."""
    from apex import config as config_module
    from apex.algos.apex_dqn.learner import ApexDqnLearner
    from apex.algos.impala import learner as impala
    from apex.envs.make import EnvSpec
    from apex.learner.metrics import EpisodeStats

    spec = EnvSpec((3,), np.dtype(np.float32), 1, 2)
    for algo in ("apex_dqn", "impala"):
        config = config_module.load(
            None, [f"algo={algo}", "apex_dqn.replay.capacity=1000", "apex_dqn.replay.min_size=100"]
        )
        learner = (ApexDqnLearner if algo == "apex_dqn" else impala.ImpalaLearner)(config, spec, torch.device("cpu"))
        if algo == "apex_dqn":
            learner.insert(bandit_chunk(500))
            for _ in range(3):
                learner.step()
        saved = {
            **learner.state_dict(),
            "env_steps": 5000,
            "env_steps_by_host": {"127.0.0.1": 5000},
            "episode_stats": EpisodeStats().state_dict(),
            "time": 12.5,
            "config": config.to_dict(),
        }
        directory = tmp_path / algo
        assert CheckpointWriter(directory, keep=3).save("ckpt-000000003", saved)
        loaded = find_latest(directory).load_state()
        assert loaded["episode_stats"]["best"] == -math.inf and loaded["config"] == config.to_dict()
        fresh = (ApexDqnLearner if algo == "apex_dqn" else impala.ImpalaLearner)(config, spec, torch.device("cpu"))
        fresh.load_state_dict(loaded)
        assert fresh.updates == learner.updates


@pytest.mark.parametrize(
    "change, missing",
    [
        (lambda s: s.pop("online"), "'online'"),
        (lambda s: s.pop("optimizer"), "'optimizer'"),
        (lambda s: s.pop("env_steps"), "'env_steps'"),
        (lambda s: s.update(updates="100"), "'updates' is a str"),
        (lambda s: s.update(updates=True), "'updates' is a bool"),
        (lambda s: s.update(time=float("nan")), "finite"),
        (lambda s: s.update(episode_stats={"eval": []}), "episode_stats"),
        (lambda s: s.update(config={"algo": "impala"}), "'net'"),
        (lambda s: s.update(config={"algo": "sarsa"}), "config.algo"),
        (lambda s: s.update(config={"algo": ["apex_dqn"]}), "config.algo"),
        (lambda s: s.update(env_steps_by_host="ab"), "env_steps_by_host"),
        (lambda s: s.update(limiter={"inserts": 1}), "limiter"),
        (lambda s: s.update(limiter={"inserts": 10, "samples": 2**60}), "limiter"),
        (lambda s: s.update(updates=2**70), "at most 2**53"),
        (lambda s: s["online"]["weight"].view(-1).__setitem__(0, float("nan")), "online.weight holds NaN"),
        (lambda s: s["optimizer"]["state"][1]["exp_avg_sq"].fill_(float("inf")), "optimizer.state.1.exp_avg_sq"),
    ],
)
def test_a_state_without_what_every_checkpoint_holds_is_refused(tmp_path, change, missing):
    bad = state(100)
    change(bad)
    assert CheckpointWriter(tmp_path, keep=3).save("ckpt-000000100", bad)
    with pytest.raises(CorruptCheckpoint, match=re.escape(missing)):
        find_latest(tmp_path).load_state()


@pytest.mark.parametrize("content", [[1, 2], "a string", None])
def test_a_state_of_the_wrong_type_is_refused(tmp_path, content):
    writer = CheckpointWriter(tmp_path, keep=3)
    writer.save("ckpt-000000100", state(100))
    (tmp_path / "ckpt-000000100.pt").unlink()
    writer._write("ckpt-000000100", _saved(content), None, {"algo": "apex_dqn"})
    with pytest.raises(CorruptCheckpoint, match="not an apex learner state"):
        find_latest(tmp_path).load_state()


def _saved(content) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(content, buffer)
    return buffer


def edit_manifest(directory, updates: int, edit) -> None:
    path = directory / f"ckpt-{updates:09d}.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def header(key, value):
    return lambda m: m["replay_header"].__setitem__(key, value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (header("chunk_items", 0), "chunk_items must be an int >= 1"),
        (header("frames", [-1, 0, 8]), "frames must be [start, valid, end], ints >= 0"),
        (header("items", [0, 5, 3]), "start <= valid <= end"),
        (header("items", [0, 0, 51]), "more than capacity 50"),
        (header("frames", [0, 0, 81]), "more than frame_capacity 80"),
        (header("frame_shape", [0]), "frame_shape must be a list of positive ints"),
        (header("frame_shape", "1"), "frame_shape"),
        (header("frame_dtype", 8), "frame_dtype must be a string"),
        (header("stack", True), "stack must be an int >= 1"),
        (header("capacity", 1.5), "capacity must be an int >= 1"),
        (header("chunks", [[1]]), "chunks must be a list"),
        (header("chunks", {"a": 1}), "chunks must be a list"),
        (header("chunks", [[9, 0], [5, 9]]), "in insertion order"),
        (header("chunks", [[10**6, 0]]), "within items and frames"),
        (lambda m: m.__setitem__("replay_header", None), "replay_header must be an object"),
        (lambda m: m["replay_header"].pop("items"), "items must be [start, valid, end]"),
        (lambda m: m["files"]["state"].__setitem__("crc32", -1), "files.state must be"),
        (lambda m: m["files"]["state"].__setitem__("crc32", 2**32), "files.state must be"),
        (lambda m: m["files"]["replay"].__setitem__("bytes", "12"), "files.replay must be"),
        (lambda m: m["files"].__setitem__("extra", {"bytes": 0, "crc32": 0}), "files lists 'extra'"),
        (lambda m: m.__setitem__("files", []), "files must be an object listing 'state'"),
        (lambda m: m.__setitem__("format", 2), "format is 2"),
        (lambda m: m.__setitem__("name", "ckpt-000000999"), "name is 'ckpt-000000999'"),
        (lambda m: m.__setitem__("config", ["algo"]), "config must be an object"),
        (lambda m: m.__setitem__("return_mean_100", "500"), "return_mean_100 must be a finite number or null"),
        (lambda m: m.__setitem__("return_mean_100", float("nan")), "return_mean_100 must be a finite number"),
        (lambda m: m.__setitem__("return_mean_100", True), "return_mean_100 must be a finite number"),
        (lambda m: m.__setitem__("eval_episodes", -1), "eval_episodes must be an int >= 0 or null"),
    ],
)
def test_an_edited_manifest_is_refused_and_the_one_before_is_used(tmp_path, caplog, edit, message):
    write(tmp_path, 100, small_replay())
    write(tmp_path, 200, small_replay())
    edit_manifest(tmp_path, 200, edit)
    with pytest.raises(CorruptCheckpoint, match=re.escape(message)) as caught:
        verify(tmp_path / "ckpt-000000200.json")
    assert "\n" not in str(caught.value)
    with caplog.at_level(logging.WARNING):
        found = [c.name for c in candidates(tmp_path)]
    assert found == ["ckpt-000000100"] and "ckpt-000000200 refused" in caplog.text
    assert (tmp_path / "ckpt-000000200.json.corrupt").exists()
    restored = new_like(small_replay())
    find_latest(tmp_path).load_replay(restored)
    assert len(restored) == len(small_replay())


def test_a_replay_that_does_not_match_its_header_is_corrupt_and_leaves_the_replay_empty(tmp_path):
    write(tmp_path, 100, small_replay())
    write(tmp_path, 200, small_replay())
    # A file shorter than its header says, with a manifest made to match it.
    path = tmp_path / "ckpt-000000200.replay"
    path.write_bytes(path.read_bytes()[:-100])
    edit_manifest(
        tmp_path,
        200,
        lambda m: m["files"].__setitem__(
            "replay", {"bytes": path.stat().st_size, "crc32": zlib.crc32(path.read_bytes())}
        ),
    )
    newest = find_latest(tmp_path)
    restored = new_like(small_replay())
    with pytest.raises(CorruptCheckpoint, match="ckpt-000000200.replay does not hold the replay"):
        newest.load_replay(restored)
    assert len(restored) == 0 and restored.total_added == 0
    mark_corrupt(newest, "replay unreadable")
    find_latest(tmp_path).load_replay(restored)  # the one before, into the same replay
    assert len(restored) == len(small_replay())
    assert_stacks_are_their_own(restored)


def test_a_replay_of_another_shape_is_incompatible_not_corrupt(tmp_path):
    write(tmp_path, 100, small_replay())
    other = StackedReplay((1,), np.int64, stack=2, capacity=60, frame_capacity=80, seed=0)
    with pytest.raises(IncompatibleCheckpoint, match="capacity 50, this run's has 60"):
        find_latest(tmp_path).load_replay(other)
    assert (tmp_path / "ckpt-000000100.json").exists()


def test_a_stale_temporary_link_is_removed_not_followed(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("precious\n")
    directory = tmp_path / "checkpoints"
    directory.mkdir()
    (directory / "ckpt-000000100.pt.tmp").symlink_to(target)
    CheckpointWriter(directory, keep=3)
    assert os.listdir(directory) == [] and target.read_text() == "precious\n"


def _trained_apex_learner(config_overrides: tuple[str, ...] = ()):
    from apex import config as config_module
    from apex.algos.apex_dqn.learner import ApexDqnLearner
    from apex.envs.make import EnvSpec

    config = config_module.load(
        None, ["apex_dqn.replay.capacity=1000", "apex_dqn.replay.min_size=100", *config_overrides]
    )
    learner = ApexDqnLearner(config, EnvSpec((3,), np.dtype(np.float32), 1, 2), torch.device("cpu"))
    learner.insert(bandit_chunk(500))
    for _ in range(3):
        learner.step()
    return learner, lambda: ApexDqnLearner(config, learner.spec, torch.device("cpu"))


def test_an_optimizer_state_that_does_not_fit_its_networks_is_refused_before_anything_changes():
    # torch loads an Adam moment of the wrong shape, and fused Adam then writes past it: a
    # segfault at the first update of a resumed run, not an error.
    learner, fresh = _trained_apex_learner()
    saved = learner.state_dict()
    saved["optimizer"]["state"][0]["exp_avg"] = torch.zeros(7)
    target = fresh()
    before = [p.clone() for p in target.online.parameters()]
    with pytest.raises(CorruptCheckpoint, match=r"optimizer state 'exp_avg' of parameter 0 is \(7,\)"):
        target.load_state_dict(saved)
    assert all(torch.equal(a, b) for a, b in zip(before, target.online.parameters()))
    assert target.optimizer.state_dict()["state"] == {}
    saved["optimizer"]["state"][0] = {"step": saved["optimizer"]["state"][0]["step"], "square_avg": torch.zeros(7)}
    with pytest.raises(ValueError, match="this run's optimizer keeps"):  # another learner.optimizer
        target.check_state(saved)


def test_a_checkpoint_of_another_model_does_not_fit_rather_than_being_corrupt():
    # ValueError: the learner stops the resume with "does not fit this run's model" instead of
    # renaming every checkpoint of the run *.corrupt (its optimizer's moments are of the old
    # model's shapes too, which alone would look like a damaged file).
    learner, _ = _trained_apex_learner()
    _, wider = _trained_apex_learner(("model.hidden=[32]",))
    target = wider()
    with pytest.raises(ValueError, match=r"^online") as refused:
        target.check_state(learner.state_dict())
    assert not isinstance(refused.value, CorruptCheckpoint)


def test_a_resumed_learner_keeps_its_configs_hyper_parameters_and_the_checkpoints_moments():
    learner, _ = _trained_apex_learner()
    saved = learner.state_dict()
    saved["optimizer"]["param_groups"][0]["lr"] = "fast"  # a forged or older run's: never used
    _, fresh = _trained_apex_learner(("apex_dqn.lr=0.0005",))
    resumed = fresh()
    resumed.insert(bandit_chunk(500))
    resumed.load_state_dict(saved)
    assert resumed.optimizer.param_groups[0]["lr"] == 0.0005
    moments = resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(moments[i]["exp_avg"], saved["optimizer"]["state"][i]["exp_avg"]) for i in moments)
    resumed.step()  # trains on from there (a string lr would raise in Adam)


def test_a_restored_limiter_stays_within_its_slack_of_what_the_inserts_allow():
    # Counters from a forged checkpoint (or one of other replay settings) would otherwise stop
    # sampling for good (samples far ahead) or let it run unbounded (inserts far ahead).
    learner, fresh = _trained_apex_learner()
    for inserts, samples in ((500, 10**15), (10**12, 0), (500, learner.limiter.samples)):
        saved = {**learner.state_dict(), "limiter": {"inserts": inserts, "samples": samples}}
        resumed = fresh()
        resumed.insert(bandit_chunk(200))
        resumed.load_state_dict(saved)
        limiter = resumed.limiter
        allowed = (inserts - limiter.min_size) * limiter.samples_per_insert
        assert limiter.inserts == inserts and abs(limiter.samples - allowed) <= limiter.slack
        assert limiter.can_sample(1) or limiter.can_insert()
    assert resumed.limiter.samples == learner.limiter.samples  # an honest one as it was


def test_a_saved_replay_with_values_no_batch_could_bring_is_corrupt_and_leaves_the_replay_empty(tmp_path):
    learner, fresh = _trained_apex_learner()
    replay = learner.replay
    for updates, poison in ((100, None), (200, ("action", 10**6)), (300, ("reward", np.nan))):
        if poison is not None:  # one field of one transition each, the rest as it was
            name, value = poison
            honest = replay.ring.storage[name][3].copy()
            replay.ring.storage[name][3] = value
        assert CheckpointWriter(tmp_path, keep=5).save(f"ckpt-{updates:09d}", state(updates), replay)
        if poison is not None:
            replay.ring.storage[name][3] = honest
    for name, words in (("ckpt-000000300", "reward holds NaN"), ("ckpt-000000200", "action holds values outside")):
        restored = fresh()
        newest = find_latest(tmp_path)
        assert newest.name == name
        with pytest.raises(CorruptCheckpoint, match=f"does not hold the replay.*saved replay's {words}"):
            newest.load_replay(restored.replay, restored.schema)
        assert len(restored.replay) == 0 and restored.replay.total_added == 0
        mark_corrupt(newest, "poisoned")
    restored = fresh()
    find_latest(tmp_path).load_replay(restored.replay, restored.schema)
    assert len(restored.replay) == len(learner.replay)


# -- hostile files, round two (issue 30, items 7-9): what a checkpoint's files may be and
# hold (a real `apex eval RUN` and `apex learner --resume` given a run directory with
# something planted in it: tests/system/test_checkpoint.py)


def test_a_state_of_more_values_than_any_learners_is_refused_in_one_line(tmp_path):
    write(tmp_path, 100)
    path = tmp_path / "ckpt-000000100.pt"
    saved = torch.load(path, weights_only=True)
    saved["optimizer"]["param_groups"][0]["many"] = [[] for _ in range(1_000_000)]  # each its own
    rewrite_state(path, saved)
    started = time.monotonic()
    with pytest.raises(CorruptCheckpoint, match="hold more than 1000000 values") as refused:
        find_latest(tmp_path).load_state()
    assert "\n" not in str(refused.value) and time.monotonic() - started < 30


@pytest.mark.parametrize("suffix", [".json", ".pt", ".replay"])
@pytest.mark.parametrize("kind, said", [("link", "is a symbolic link"), ("fifo", "is a FIFO")])
def test_a_checkpoint_file_that_is_not_a_regular_file_is_set_aside(tmp_path, caplog, suffix, kind, said):
    write(tmp_path, 100, small_replay())
    write(tmp_path, 200, small_replay())
    planted = tmp_path / f"ckpt-000000200{suffix}"
    if kind == "fifo":
        planted.unlink()
        os.mkfifo(planted)
    else:  # to the very file it was, elsewhere: refused as a link all the same
        (tmp_path / "elsewhere").mkdir()
        planted.rename(tmp_path / "elsewhere" / planted.name)
        planted.symlink_to(tmp_path / "elsewhere" / planted.name)
    with caplog.at_level(logging.WARNING):
        found = within(10, lambda: [c.name for c in candidates(tmp_path)])  # reading a FIFO would block
    assert found == ["ckpt-000000100"]
    assert f"checkpoint ckpt-000000200 refused: {planted} {said}, not a regular file; renamed" in caplog.text


def test_resumed_episode_statistics_are_held_to_what_episode_records_may_be():
    from apex.learner.metrics import EpisodeStats

    honest = {"eval": [500.0] * 100, "train": [-3, 9.5], "episodes": 102, "best": 500.0}
    assert EpisodeStats.problem(honest, 500, 1.0) is None
    assert EpisodeStats.problem({**honest, "best": -math.inf}, 500, 1.0) is None  # no full window yet
    for key, value in (
        ("eval", 500.5),
        ("train", math.nan),
        ("train", -math.inf),
        ("best", 10**400),
        ("best", math.nan),
    ):
        forged = {**honest, key: value if key == "best" else [*honest[key], value]}
        problem = EpisodeStats.problem(forged, 500, 1.0)
        assert problem is not None and problem.startswith(f"episode_stats.{key} holds a return of "), problem
