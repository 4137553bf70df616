"""PrioritizedReplay: ring buffer, priorities, importance weights, stale updates, validation."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from apex.replay import Field, PrioritizedReplay, StackedReplay
from tests.support.replays import assert_stacks_are_their_own, fill, new_like

SPEC = {
    "id": ((), np.int64),  # the item's insertion index, so tests can tell items apart
    "obs": ((4,), np.float32),
    "frame": ((3, 3), np.uint8),
}


def make_batch(start: int, n: int) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + n)
    return {
        "id": ids,
        "obs": np.repeat(ids[:, None], 4, axis=1).astype(np.float32),
        "frame": (ids[:, None, None] % 256 * np.ones((1, 3, 3))).astype(np.uint8),
    }


def test_add_returns_insertion_indices_and_sample_returns_the_rows_added():
    replay = PrioritizedReplay(SPEC, capacity=100, seed=0)
    assert replay.add(make_batch(0, 30), np.ones(30)).tolist() == list(range(30))
    assert replay.add(make_batch(30, 20), np.ones(20)).tolist() == list(range(30, 50))
    assert len(replay) == 50 and replay.total_added == 50
    batch, indices, weights = replay.sample(64, beta=0.4)
    np.testing.assert_array_equal(batch["id"], indices)
    np.testing.assert_array_equal(batch["obs"], np.repeat(indices[:, None], 4, 1))
    np.testing.assert_array_equal(batch["frame"][:, 1, 2], indices % 256)
    assert batch["obs"].dtype == np.float32 and weights.dtype == np.float32
    assert weights.shape == (64,)


@given(st.lists(st.integers(1, 7), min_size=1, max_size=20))
def test_ring_buffer_keeps_the_newest_capacity_items(batch_sizes):
    capacity = 8
    replay = PrioritizedReplay(SPEC, capacity=capacity, seed=0)
    added = 0
    for n in batch_sizes:
        replay.add(make_batch(added, n), np.ones(n))
        added += n
    assert len(replay) == min(added, capacity)
    live = set(range(max(0, added - capacity), added))
    batch, indices, _ = replay.sample(200, beta=1.0)
    assert set(indices.tolist()) == live  # uniform priorities: every live item turns up
    np.testing.assert_array_equal(batch["id"], indices)


def test_wraparound_write_in_the_middle_of_a_batch():
    replay = PrioritizedReplay(SPEC, capacity=5, seed=0)
    replay.add(make_batch(0, 3), np.ones(3))
    replay.add(make_batch(3, 4), np.ones(4))  # slots 3, 4, then 0, 1
    batch, indices, _ = replay.sample(50, beta=0.0)
    assert set(indices.tolist()) == {2, 3, 4, 5, 6}
    np.testing.assert_array_equal(batch["id"], indices)


def test_priorities_are_transformed_with_alpha_and_eps():
    replay = PrioritizedReplay(SPEC, capacity=10, alpha=0.5, eps=0.01)
    idx = replay.add(make_batch(0, 3), np.array([0.0, 1.0, 3.0]))
    np.testing.assert_allclose(replay.priorities(idx), np.array([0.01, 1.01, 3.01]) ** 0.5)
    replay.update_priorities(idx[1:], np.array([8.0, 0.0]))
    np.testing.assert_allclose(replay.priorities(idx), np.array([0.01, 8.01, 0.01]) ** 0.5)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
def test_importance_weights_follow_the_paper(beta):
    alpha, eps = 0.7, 1e-6
    replay = PrioritizedReplay(SPEC, capacity=16, alpha=alpha, eps=eps, seed=1)
    raw = np.array([0.1, 2.0, 0.5, 4.0, 1.0, 0.3])
    replay.add(make_batch(0, 6), raw)
    _, indices, weights = replay.sample(32, beta=beta)
    p = (raw + eps) ** alpha
    prob = p / p.sum()
    n = len(raw)
    w_all = (n * prob) ** -beta
    expected = w_all[indices] / w_all.max()  # max over the whole buffer
    np.testing.assert_allclose(weights, expected, rtol=1e-6)
    assert weights.max() <= 1.0


def test_sampling_follows_priorities():
    replay = PrioritizedReplay(SPEC, capacity=8, alpha=1.0, eps=1e-9, seed=5)
    raw = np.array([1.0, 2.0, 4.0, 8.0, 1.0, 0.0, 0.0, 16.0])
    replay.add(make_batch(0, 8), raw)
    counts = np.zeros(8)
    for _ in range(3000):
        _, indices, _ = replay.sample(4, beta=0.4)
        counts += np.bincount(indices, minlength=8)
    expected = counts.sum() * (raw + 1e-9) / (raw + 1e-9).sum()
    positive = raw > 0
    chi2 = (((counts - expected) ** 2)[positive] / expected[positive]).sum()
    assert chi2 < 16.75  # critical value, 5 degrees of freedom, p = 0.005
    assert counts[~positive].sum() < 5  # eps-sized priorities: next to never


def test_stale_priority_update_is_ignored():
    replay = PrioritizedReplay(SPEC, capacity=4, alpha=1.0, eps=1e-9, seed=0)
    replay.add(make_batch(0, 4), np.ones(4))
    _, indices, _ = replay.sample(4, beta=0.4)
    replay.add(make_batch(4, 2), np.full(2, 5.0))  # overwrites items 0 and 1 (slots 0, 1)
    applied = replay.update_priorities(indices, np.full(len(indices), 100.0))
    assert applied == int(np.count_nonzero(indices >= 2))
    assert replay.stale_priority_updates == len(indices) - applied
    # The newcomers in slots 0 and 1 keep their own priorities.
    np.testing.assert_allclose(replay.priorities(np.array([4, 5])), [5.0, 5.0])
    live_sampled = np.unique(indices[indices >= 2])
    np.testing.assert_allclose(replay.priorities(live_sampled), 100.0)


def test_nbytes_is_fixed_and_covers_storage_and_tree():
    replay = PrioritizedReplay(SPEC, capacity=1000)
    storage = 1000 * (8 + 4 * 4 + 9)
    assert replay.nbytes > storage
    before = replay.nbytes
    replay.add(make_batch(0, 500), np.ones(500))
    assert replay.nbytes == before


def test_field_spec_forms():
    replay = PrioritizedReplay({"x": Field((2,), np.dtype("float32")), "y": ([], "int16")}, 4)
    assert replay.fields["y"] == Field((), np.dtype(np.int16))


def test_concurrent_add_and_sample():
    replay = PrioritizedReplay(SPEC, capacity=256, seed=0)
    replay.add(make_batch(0, 64), np.ones(64))
    errors = []

    def writer():
        start = 64
        for _ in range(300):
            replay.add(make_batch(start, 32), np.ones(32))
            start += 32

    def reader():
        try:
            for _ in range(300):
                batch, indices, _ = replay.sample(32, beta=0.4)
                np.testing.assert_array_equal(batch["id"], indices)
                replay.update_priorities(indices, np.ones(len(indices)))
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda r: r.add({"id": np.arange(2)}, np.ones(2)), ValueError, "missing"),
        (lambda r: r.add({**make_batch(0, 2), "extra": np.ones(2)}, np.ones(2)), ValueError, "unexpected"),
        (lambda r: r.add(make_batch(0, 2), np.ones(3)), ValueError, "shape"),
        (lambda r: r.add({**make_batch(0, 2), "obs": np.ones((2, 5))}, np.ones(2)), ValueError, "shape"),
        (lambda r: r.add({**make_batch(0, 2), "frame": np.ones((2, 3, 3))}, np.ones(2)), ValueError, "uint8"),
        (lambda r: r.add(make_batch(0, 2), np.array([1.0, -1.0])), ValueError, "finite and >= 0"),
        (lambda r: r.add(make_batch(0, 2), np.array([1.0, np.nan])), ValueError, "finite and >= 0"),
        (lambda r: r.add(make_batch(0, 20), np.ones(20)), ValueError, "capacity"),
        (lambda r: r.sample(0, beta=0.4), ValueError, "batch_size"),
        (lambda r: r.sample(4, beta=-1), ValueError, "beta"),
        (lambda r: r.update_priorities(np.array([99]), np.ones(1)), IndexError, "insertion indices"),
        (lambda r: r.update_priorities(np.array([0.5]), np.ones(1)), ValueError, "integer"),
        (lambda r: r.update_priorities(np.array([0, 1]), np.ones(1)), ValueError, "same length"),
        (lambda r: r.update_priorities(np.array([0]), np.array([np.inf])), ValueError, "finite"),
    ],
)
def test_invalid_input_raises_and_changes_nothing(call, error, message):
    replay = PrioritizedReplay(SPEC, capacity=10, seed=0)
    replay.add(make_batch(0, 4), np.arange(4.0))
    before = replay.priorities(np.arange(4)).tolist(), len(replay), replay.total_added
    with pytest.raises(error, match=message):
        call(replay)
    assert (replay.priorities(np.arange(4)).tolist(), len(replay), replay.total_added) == before


def test_empty_replay_cannot_be_sampled():
    with pytest.raises(ValueError, match="empty"):
        PrioritizedReplay(SPEC, capacity=4).sample(2, beta=0.4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": 2.5}, "capacity"),
        ({"capacity": 4, "alpha": -1}, "alpha"),
        ({"capacity": 4, "eps": 0}, "eps"),
    ],
)
def test_constructor_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrioritizedReplay(SPEC, **kwargs)


# --- StackedReplay: frames stored once, stacks rebuilt at sample time


def frame_chunk(first_value: int, transitions: int, stack: int, n: int = 1) -> dict:
    """A chunk whose frame i holds the value first_value + i everywhere."""
    count = transitions + stack - 1 + n
    frames = (first_value + np.arange(count))[:, None, None] * np.ones((1, 2, 2))
    obs = np.arange(transitions)
    return {
        "frames": frames.astype(np.uint8),
        "obs_frame": obs.astype(np.int32),
        "next_obs_frame": (obs + n).astype(np.int32),
        "action": np.zeros(transitions, np.int64),
        "reward": obs.astype(np.float32),  # lets the test find each transition's frame
        "discount": np.ones(transitions, np.float32),
        "priority": np.ones(transitions, np.float32),
    }


def test_stacked_replay_rebuilds_stacks_from_frames_stored_once():
    replay = StackedReplay((2, 2), np.uint8, stack=4, capacity=100, frame_capacity=1000, seed=0)
    replay.add(frame_chunk(0, transitions=10, stack=4, n=3))
    replay.add(frame_chunk(100, transitions=5, stack=4, n=3))
    assert replay.frames.added == (10 + 3 + 3) + (5 + 3 + 3)  # each frame once
    batch, _, _ = replay.sample(64, beta=0.4)
    assert batch["obs"].shape == (64, 4, 2, 2) and batch["obs"].dtype == np.uint8
    first = batch["obs"][:, :, 0, 0]
    t = batch["reward"].astype(int)
    base = np.where(first[:, 0] >= 100, 100, 0)
    np.testing.assert_array_equal(first, (base + t)[:, None] + np.arange(4))
    np.testing.assert_array_equal(batch["next_obs"][:, :, 0, 0], (base + t + 3)[:, None] + np.arange(4))


def test_stacked_replay_evicts_transitions_whose_frames_were_overwritten():
    replay = StackedReplay((2, 2), np.uint8, stack=4, capacity=1000, frame_capacity=30, seed=0)
    for k in range(6):  # 6 chunks of 16 frames into a ring of 30: only the newest fit whole
        replay.add(frame_chunk(40 * k, transitions=10, stack=4, n=3))
    assert len(replay) <= 20
    batch, indices, _ = replay.sample(200, beta=0.4)
    # Every sampled stack is intact: consecutive frame values from one chunk.
    first = batch["obs"][:, :, 0, 0].astype(int)
    np.testing.assert_array_equal(np.diff(first, axis=1), np.ones((200, 3)))
    assert set(first[:, 0] // 40) <= {4, 5}
    assert replay.priorities(indices).min() > 0


def test_atari_sized_replay_uses_a_seventh_of_naive_stacks():
    replay = StackedReplay((84, 84), np.uint8, stack=4, capacity=10_000, frame_capacity=10_000 + 10_000 // 8 + 4096)
    assert replay.bytes_per_transition < 56_448 / 5


def test_stacked_replay_takes_compressed_frames_straight_into_its_ring():
    from apex.wire.protocol import decode, encode

    def lazily(chunk):
        from apex.bench.batches import BATCH_FIELDS as fields

        big = {**chunk, "frames": np.repeat(np.repeat(chunk["frames"], 32, 1), 32, 2)}  # 64x64: lz4-sized
        return decode(encode("batch", fields, big), lazy=True).arrays

    replay = StackedReplay((64, 64), np.uint8, stack=4, capacity=1000, frame_capacity=40, seed=0)
    for k in range(5):  # 16 frames a chunk into a ring of 40: wraps, and evicts
        arrays = lazily(frame_chunk(40 * k, transitions=10, stack=4, n=3))
        assert type(arrays["frames"]).__name__ == "Compressed"
        replay.add(arrays)
    batch, _, _ = replay.sample(100, beta=0.4)
    first = batch["obs"][:, :, 0, 0].astype(int)
    np.testing.assert_array_equal(np.diff(first, axis=1), np.ones((100, 3)))
    assert set(first[:, 0] // 40) <= {3, 4}

    # A payload that fails to decompress: refused, its slots consumed, the ring still sound.
    arrays = lazily(frame_chunk(200, transitions=10, stack=4, n=3))
    good = arrays["frames"]
    arrays["frames"] = type(good)(good.name, good.dtype, good.shape, bytes(good.payload)[:-4])
    with pytest.raises(ValueError, match="corrupt lz4"):
        replay.add(arrays)
    batch, _, _ = replay.sample(100, beta=0.4)
    first = batch["obs"][:, :, 0, 0].astype(int)
    np.testing.assert_array_equal(np.diff(first, axis=1), np.ones((100, 3)))


# -- snapshots (checkpoints)


def test_snapshot_round_trip_restores_items_priorities_and_eviction_state():
    import io

    replay = StackedReplay((1,), np.int64, stack=2, capacity=50, frame_capacity=80, seed=0)
    fill(replay, 23)  # both rings wrap several times; frame eviction has dropped items
    _, indices, _ = replay.sample(32, beta=0.4)
    replay.update_priorities(indices, np.linspace(0.1, 9.0, 32))
    buffer = io.BytesIO()
    header = replay.save(buffer, lock_bytes=100)  # many small pieces
    buffer.seek(0)
    restored = new_like(replay)
    restored.load(buffer, header)

    live = np.arange(replay.ring.oldest_live, replay.total_added)
    assert len(restored) == len(replay) > 0 and restored.total_added == replay.total_added
    assert restored.frames.added == replay.frames.added
    np.testing.assert_array_equal(restored.priorities(live), replay.priorities(live))
    assert restored.ring.tree.total == pytest.approx(replay.ring.tree.total)
    assert_stacks_are_their_own(restored)
    # Both go on the same way: the same evictions on the next inserts.
    fill(replay, 3)
    fill(restored, 3)
    assert len(restored) == len(replay)
    assert_stacks_are_their_own(restored)


def restore_and_check(replay: StackedReplay, buffer, header: dict) -> StackedReplay:
    """Loads a snapshot taken while ``replay`` was overwritten; checks that some items were
    given up and that every item kept is the one stored when saving began, frames and all."""
    items_start, _, items_end = header["items"]  # live when saving began
    assert replay.total_added > items_end, "the test should have overwritten items while saving"
    buffer.seek(0)
    restored = new_like(replay)
    restored.load(buffer, header)
    assert 0 < len(restored) < items_end - items_start
    indices = assert_stacks_are_their_own(restored)
    assert items_start <= indices.min() and indices.max() < items_end
    return restored


def test_snapshot_while_a_thread_inserts_keeps_only_intact_items():
    """A slow disk while the items are copied: the inserting thread overwrites the oldest
    items before they are copied."""
    import io
    import threading

    replay = StackedReplay((1,), np.int64, stack=2, capacity=300, frame_capacity=400, seed=0)
    fill(replay, 60)
    stop = threading.Event()

    class SlowFile(io.BytesIO):
        writes = 0

        def write(self, data):
            self.writes += 1
            if self.writes <= 40:
                time.sleep(0.002)
            return super().write(data)

    def insert():
        while not stop.is_set():
            fill(replay, 1)
            time.sleep(0.01)

    thread = threading.Thread(target=insert)
    thread.start()
    buffer = SlowFile()
    try:
        header = replay.save(buffer, lock_bytes=64)
    finally:
        stop.set()
        thread.join()
    restore_and_check(replay, buffer, header)


def test_snapshot_overtaken_during_a_disk_stall_drops_items_whose_frames_were_overwritten():
    """Frames are copied in pieces after the items; while one piece is written out (outside
    the lock) the actors fill more of the ring than is left ahead of the copy."""
    import io

    replay = StackedReplay((16,), np.int64, stack=2, capacity=300, frame_capacity=400, seed=0)
    fill(replay, 60)

    class StallingFile(io.BytesIO):
        frame_writes = 0

        def write(self, data):
            if memoryview(data).nbytes > 4000:  # a piece of frames (items are smaller)
                self.frame_writes += 1
                if self.frame_writes == 3:
                    assert not replay.lock.locked(), "this piece should be written outside the lock"
                    fill(replay, 30)  # 330 frames: past the next uncopied piece
            return super().write(data)

    buffer = StallingFile()
    header = replay.save(buffer, lock_bytes=12000)  # 93 frames of 128 bytes a piece
    frames_start, frames_valid, frames_end = header["frames"]
    assert frames_start < frames_valid < frames_end
    restore_and_check(replay, buffer, header)


def test_snapshot_load_refuses_another_shape_and_a_truncated_file():
    import io

    replay = StackedReplay((1,), np.int64, stack=2, capacity=50, frame_capacity=80, seed=0)
    fill(replay, 5)
    buffer = io.BytesIO()
    header = replay.save(buffer)
    other = StackedReplay((1,), np.int64, stack=2, capacity=60, frame_capacity=80)
    with pytest.raises(ValueError, match="capacity 50, this run's has 60"):
        other.load(io.BytesIO(buffer.getvalue()), header)
    with pytest.raises(ValueError, match="truncated"):
        new_like(replay).load(io.BytesIO(buffer.getvalue()[:-10]), header)
