"""Frames stored once, with indices: how both algorithms' actors send observations.

A stream of steps (one environment's, or the external episodes of one slot) keeps each frame
once; the observation of a step is the stack ``frames[s : s + stack]`` from its start ``s``.
An episode begins with ``stack`` copies of its first frame, each later step adds one frame. A
chunk (Ape-X's n-step transitions, IMPALA's unroll) carries the frames its steps' stacks use
and, per step, where its stack starts; the learner gathers the stacks from them.
"""

from __future__ import annotations

from collections.abc import Sequence, Sized

import numpy as np


class FrameTrack:
    """One stream's frames and the stack start of each of its steps since the last ``drop``."""

    def __init__(self, stack: int) -> None:
        self.stack = stack
        self.frames: list[np.ndarray] = []
        self.starts: list[int] = []

    def begin(self, frame: np.ndarray) -> None:
        """A new episode's first step: a full stack of its first frame."""
        self.frames += [frame] * self.stack
        self.starts.append(len(self.frames) - self.stack)

    def push(self, frame: np.ndarray) -> None:
        """The episode's next step: its stack is the last one moved on by ``frame``."""
        self.frames.append(frame)
        self.starts.append(self.starts[-1] + 1)

    def pop(self) -> None:
        """Forgets the last step and the frames only its stack used."""
        self.starts.pop()
        del self.frames[(self.starts[-1] + self.stack) if self.starts else 0 :]

    def take(self, last: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The frames the stacks of steps 0..``last`` use (a list: the caller stacks them once,
        with other tracks' where it sends several), and where each of those stacks starts."""
        return self.frames[: self.starts[last] + self.stack], np.asarray(self.starts[: last + 1], np.int32)

    def drop(self, steps: int) -> None:
        """Forgets steps 0..``steps - 1``: step ``steps`` becomes step 0."""
        shift = self.starts[steps]
        del self.frames[:shift]
        self.starts = [start - shift for start in self.starts[steps:]]


def frame_offsets(frame_lists: Sequence[Sized]) -> np.ndarray:
    """Where each chunk's frames begin once the chunks' frames are concatenated (what to add
    to its frame indices), from each chunk's frames."""
    return np.cumsum([0] + [len(frames) for frames in frame_lists[:-1]]).astype(np.int32)
