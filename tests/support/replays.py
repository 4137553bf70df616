"""Made-up chunks of transitions, and replays filled with them and checked."""

from __future__ import annotations

import numpy as np

from apex.replay import StackedReplay


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


def id_chunk(first_frame: int, first_item: int, transitions: int, stack: int = 2, n: int = 1, width: int = 1) -> dict:
    """A chunk whose frames hold their own frame id and whose rewards hold their item id."""
    count = transitions + stack - 1 + n
    obs = np.arange(transitions)
    return {
        "frames": np.repeat((first_frame + np.arange(count, dtype=np.int64))[:, None], width, axis=1),
        "obs_frame": obs.astype(np.int32),
        "next_obs_frame": (obs + n).astype(np.int32),
        "action": np.zeros(transitions, np.int64),
        "reward": (first_item + obs).astype(np.float32),
        "discount": np.ones(transitions, np.float32),
        "priority": 1.0 + (first_item + obs) % 7,
    }


def fill(replay: StackedReplay, chunks: int, transitions: int = 9) -> None:
    for _ in range(chunks):
        replay.add(id_chunk(replay.frames.added, replay.total_added, transitions, width=replay.frame_shape[0]))


def assert_stacks_are_their_own(replay: StackedReplay, n: int = 400) -> np.ndarray:
    """Every sampled stack holds the frames its item was stored with (none overwritten)."""
    batch, indices, _ = replay.sample(n, beta=0.4)
    obs = batch["obs"][:, :, 0]
    first_frames = replay.ring.storage["obs_frame"][indices % replay.capacity]
    np.testing.assert_array_equal(obs[:, 0], first_frames)
    np.testing.assert_array_equal(np.diff(obs, axis=1), 1)
    np.testing.assert_array_equal(batch["next_obs"][:, :, 0], obs + 1)
    np.testing.assert_array_equal(batch["reward"], indices.astype(np.float32))  # the item it claims to be
    return indices


def new_like(replay: StackedReplay) -> StackedReplay:
    return StackedReplay(
        replay.frame_shape, replay.frame_dtype, replay.stack, replay.capacity, replay.frames.capacity, seed=1
    )
