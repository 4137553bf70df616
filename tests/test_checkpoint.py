"""Checkpoint files: atomic writes, manifests, verification, fallback past bad ones, pruning."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch

from apex.checkpoint import CheckpointWriter, CorruptCheckpoint, find_latest, verify
from apex.errors import ApexError
from apex.replay import StackedReplay
from tests.test_replay import assert_stacks_are_their_own, fill, new_like


def small_replay() -> StackedReplay:
    replay = StackedReplay((1,), np.int64, stack=2, capacity=50, frame_capacity=80, seed=0)
    fill(replay, 8)
    return replay


def state(updates: int) -> dict:
    return {"updates": updates, "weights": torch.full((4,), float(updates)), "config": {"algo": "apex_dqn"}}


def write(directory, updates: int, replay=None, keep: int = 5, background: bool = False) -> CheckpointWriter:
    writer = CheckpointWriter(directory, keep)
    assert writer.save(f"ckpt-{updates:09d}", state(updates), replay, background=background)
    writer.wait()
    return writer


def test_written_checkpoint_verifies_and_restores_state_and_replay(tmp_path):
    replay = small_replay()
    write(tmp_path, 100, replay, background=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000100.json", "ckpt-000000100.pt",
                                                          "ckpt-000000100.replay"]
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
        "ckpt-000000100.json", "ckpt-000000100.pt", "ckpt-000000300.json", "ckpt-000000300.pt"]


def test_only_the_newest_k_are_kept(tmp_path):
    writer = CheckpointWriter(tmp_path, keep=2)
    for updates in (1, 2, 3, 4):
        writer.save(f"ckpt-{updates:09d}", state(updates), small_replay())
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["ckpt-000000003.json", "ckpt-000000004.json"]
    assert len(list(tmp_path.glob("*.replay"))) == 2 and len(list(tmp_path.glob("*.pt"))) == 2
    assert writer.written == 4


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
    from apex.evaluate import load_checkpoint

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
