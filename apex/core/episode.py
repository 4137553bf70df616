"""An episode that is stepped from outside an actor core (`apex serve`'s clients, the agents
of a multi-agent environment): the bookkeeping its algorithm's ``EpisodeActorCore`` reads and
writes, and the stacking of its frames into observations."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Episode:
    """One episode as its stepper sees it; ``state`` is the algorithm's."""

    id: str
    slot: int | None  # taken at its first action: a rung of the Ape-X ladder, a row of IMPALA unrolls
    last_seen: float
    reward: float = 0.0  # reported for the step under way (since the last action)
    episode_return: float = 0.0
    length: int = 0  # steps with an outcome
    acted: bool = False  # an action is out whose outcome (reward, next observation) is pending
    logged: bool = False  # the client chose an action of this episode (not the policy)
    state: Any = None
    frames: deque[np.ndarray] = field(default_factory=deque)  # the last ``stack`` frames: the observation
    mask: np.ndarray | None = None  # the legal actions of its next step (None: all)
    owner: str = ""  # who started it (`apex serve`: the client's address)


def stack_frames(
    episodes: list[Episode], frames: np.ndarray, stack: int, frame_shape: tuple[int, ...], dtype: np.dtype
) -> np.ndarray:
    """Each episode's observation once ``frames`` arrive: its last ``stack`` frames."""
    if stack == 1:  # vector observations: the frame is the observation
        return frames[:, None]
    out = np.empty((len(episodes), stack, *frame_shape), dtype)
    for i, (episode, frame) in enumerate(zip(episodes, frames)):
        if not episode.frames:
            episode.frames.extend([frame] * stack)
        else:
            episode.frames.append(frame)
            if len(episode.frames) > stack:
                episode.frames.popleft()
        out[i] = np.stack(episode.frames)
    return out
