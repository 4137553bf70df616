"""Environments and wrappers for the API and env-config tests, registered only when this
module is imported (env.imports: [tests.probe_envs]): what reaches the actors is written to
files, so a test can see it from their side."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv


def _mark(marker_dir: str | None, what: str, **fields) -> None:
    if marker_dir:
        record = {"what": what, "pid": os.getpid(), "argv": " ".join(sys.argv), **fields}
        (Path(marker_dir) / f"{what}-{os.getpid()}.json").write_text(json.dumps(record))


class ProbeCartPole(CartPoleEnv):
    """CartPole that records the keyword arguments it was made with."""

    def __init__(self, marker_dir: str | None = None, tag: str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        _mark(marker_dir, "env", tag=tag)


class Mark(gym.Wrapper):
    """A wrapper that records that (and with what) it was applied."""

    def __init__(self, env: gym.Env, marker_dir: str | None = None, label: str = "") -> None:
        super().__init__(env)
        _mark(marker_dir, f"wrapper-{label}", label=label)


gym.register("apex-test/ProbeCartPole-v0", entry_point="tests.probe_envs:ProbeCartPole", max_episode_steps=500)
