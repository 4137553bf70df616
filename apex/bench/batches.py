"""Benchmark batches: what an actor sends for CartPole and for Atari, and naive equivalents.

apex sends columns of arrays, each Atari frame once, with the index of each transition's
first stacked frame. Two naive forms of the same transitions are pickled for comparison:
  transitions  what a straightforward actor builds: a list of (obs, action, reward,
               next_obs, discount, priority) tuples, Atari observations as full 4-frame
               stacks for obs and again for next_obs (8 frames a transition)
  columns      the same as a dict of stacked arrays: the strongest naive form
"""

from __future__ import annotations

import numpy as np

CARTPOLE_TRANSITIONS = 256
ATARI_TRANSITIONS = 64
STACK = 4
N_STEP = 3

BATCH_FIELDS = {"actor_index": 0, "weights_version": 0, "info": {"episodes": []}, "session": bytes(16), "seq": 0}


def naive_transitions(columns: dict[str, np.ndarray]) -> list[tuple[np.ndarray, int, float, np.ndarray, float, float]]:
    """Columns turned into the per-transition tuples a straightforward actor collects."""
    return [
        (
            columns["obs"][i].copy(),
            int(columns["action"][i]),
            float(columns["reward"][i]),
            columns["next_obs"][i].copy(),
            float(columns["discount"][i]),
            float(columns["priority"][i]),
        )
        for i in range(len(columns["action"]))
    ]


def _cartpole_states(rng: np.random.Generator, count: int) -> np.ndarray:
    """CartPole-like observations within the space's bounds (the learner refuses others):
    position and angle inside the episode's limits, velocities around zero."""
    states = rng.standard_normal((count, 4)).astype(np.float32)
    states[:, 0] = rng.uniform(-2.4, 2.4, count)
    states[:, 2] = rng.uniform(-0.2, 0.2, count)
    return states


def cartpole(n: int = CARTPOLE_TRANSITIONS, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(apex arrays, naive columns) for n CartPole transitions."""
    rng = np.random.default_rng(seed)
    arrays = {
        "obs": _cartpole_states(rng, n),
        "action": rng.integers(0, 2, n).astype(np.int64),
        "reward": np.ones(n, np.float32),
        "discount": np.full(n, 0.99**N_STEP, np.float32),
        "next_obs": _cartpole_states(rng, n),
        "priority": rng.random(n).astype(np.float32),
    }
    return arrays, dict(arrays)


def cartpole_chunk(n: int = CARTPOLE_TRANSITIONS, seed: int = 0) -> dict[str, np.ndarray]:
    """n consecutive CartPole transitions as an Ape-X actor sends them: each observation once."""
    rng = np.random.default_rng(seed)
    first = np.arange(n, dtype=np.int32)
    return {
        "frames": _cartpole_states(rng, n + N_STEP),
        "obs_frame": first,
        "next_obs_frame": first + N_STEP,
        "action": rng.integers(0, 2, n).astype(np.int64),
        "reward": np.full(n, 2.97, np.float32),
        "discount": np.full(n, 0.99**N_STEP, np.float32),
        "priority": rng.random(n).astype(np.float32),
    }


def atari_frames(count: int, seed: int = 0) -> tuple[np.ndarray, str]:
    """``count`` 84x84 grayscale frames: real Pong frames where ale-py is installed."""
    try:
        import ale_py
        import gymnasium as gym

        gym.register_envs(ale_py)
        env = gym.make("ALE/Pong-v5", obs_type="grayscale", frameskip=4, repeat_action_probability=0.0)
        rows, cols = np.linspace(0, 209, 84).astype(int), np.linspace(0, 159, 84).astype(int)
        obs, _ = env.reset(seed=seed)
        frames = []
        for _ in range(count + 100):  # skip the first 100: the serve
            obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
            frames.append(obs[rows][:, cols])
            if terminated or truncated:
                obs, _ = env.reset()
        env.close()
        return np.stack(frames[100:]), "ALE/Pong-v5 (ale-py)"
    except ImportError:
        return _synthetic_frames(count, seed), "synthetic Pong-like frames (ale-py not installed)"


def _synthetic_frames(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    frames = np.full((count, 84, 84), 87, np.uint8)
    frames[:, :10] = 236  # score bar
    for t in range(count):
        left, right = 20 + (t * 3) % 50, 20 + (t * 5) % 50
        frames[t, left : left + 8, 8:10] = 147
        frames[t, right : right + 8, 74:76] = 92
        bx, by = 12 + (t * 2) % 60, 12 + (t * 3) % 60
        frames[t, by : by + 2, bx : bx + 2] = 236
    noise = rng.random(frames.shape) < 0.002
    frames[noise] = 200
    return frames


def atari(n: int = ATARI_TRANSITIONS, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], str]:
    """(apex arrays, naive columns, frame source) for n consecutive Atari transitions."""
    frames, source = atari_frames(n + STACK - 1 + N_STEP, seed)
    rng = np.random.default_rng(seed)
    first = np.arange(n, dtype=np.int32)  # transition t stacks frames t .. t+3
    scalars = {
        "action": rng.integers(0, 6, n).astype(np.int64),
        "reward": rng.choice(np.array([-1.0, 0.0, 1.0], np.float32), n),
        "discount": np.full(n, 0.99**N_STEP, np.float32),
        "priority": rng.random(n).astype(np.float32),
    }
    arrays = {"frames": frames, "obs_frame": first, "next_obs_frame": first + N_STEP, **scalars}
    stacks = np.stack([frames[t : t + STACK] for t in range(n + N_STEP)])
    naive = {"obs": stacks[:n].copy(), "next_obs": stacks[N_STEP:].copy(), **scalars}
    return arrays, naive, source
