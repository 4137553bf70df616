"""What ``apex.load_policy(...).act`` takes: an observation as the environment gives it (a Dict,
Tuple or Discrete one, a single image frame, a multi-agent agent's dict with its
``action_mask``) or as ``Policy.make_env()`` adapts it (frames, stacked), one or a batch.
``ObservationReader`` turns either into what the network takes, keeping the frame stack of
images between calls (as a recurrent state is kept) until ``reset()``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from apex.envs.make import EnvSpec
from apex.envs.spaces import ObservationPlan
from apex.errors import ApexError


class ObservationReader:
    """Observations (raw or adapted, one or a batch) -> (network input [B, stack, ...], legal
    actions [B, A] or None, whether one observation was given)."""

    def __init__(
        self,
        spec: EnvSpec,
        plan: ObservationPlan | None,
        agent_frame: Callable[[Any, str | None], tuple[np.ndarray, np.ndarray | None]] | None = None,
        expected: str = "",
    ) -> None:
        """``plan``: a Gymnasium environment's observations as frames; ``agent_frame(obs,
        agent)``: a multi-agent agent's observation as (the policy's frame, its mask);
        ``expected``: what an observation is, for errors."""
        self.spec = spec
        self.plan = plan
        self.agent_frame = agent_frame
        self.expected = expected
        self._stack: np.ndarray | None = None  # raw image frames stacked so far, a row per observation

    @property
    def observation_shape(self) -> tuple[int, ...]:
        frame = tuple(self.spec.frame_shape)
        return (self.spec.stack, *frame) if self.spec.stack > 1 else frame

    def reset(self) -> None:
        self._stack = None

    def read(self, obs: Any, agent: str | None = None) -> tuple[np.ndarray, np.ndarray | None, bool]:
        adapted = self._adapted(obs)
        if adapted is not None:
            single = adapted.shape == self.observation_shape
            batch = adapted[None] if single else adapted
            return (batch[:, None] if self.spec.stack == 1 else batch), None, single
        single = not isinstance(obs, list | tuple) or self._is_one(obs)
        items = [obs] if single else list(obs)
        try:
            converted = [self._frame(item, agent) for item in items]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise ApexError(
                f"act takes {self.expected or 'an observation'} or one adapted by make_env() "
                f"(shape {self.observation_shape}), or a batch of either; got {_shown(obs)} ({e})"
            ) from None
        frames = np.stack([frame for frame, _ in converted])
        masks = [mask for _, mask in converted]
        mask = None if all(m is None for m in masks) else np.stack([_all_legal(m, self.spec) for m in masks])
        return self._stacked(frames), mask, single

    def _adapted(self, obs: Any) -> np.ndarray | None:
        """``obs`` as an array of adapted observations (one or a batch), or None if it is not."""
        if isinstance(obs, dict) or (isinstance(obs, list | tuple) and obs and isinstance(obs[0], dict)):
            return None
        try:
            array = np.asarray(obs, dtype=self.spec.frame_dtype)
        except (TypeError, ValueError):
            return None
        shape = self.observation_shape
        if array.shape == shape or (array.ndim == len(shape) + 1 and array.shape[1:] == shape):
            return array
        return None

    def _is_one(self, obs: list[Any] | tuple[Any, ...]) -> bool:
        """Whether a list or tuple is one observation (a Tuple space's) rather than a batch."""
        if self.plan is None:
            return False
        try:
            self._frame(obs, None)
            return True
        except (KeyError, TypeError, ValueError, IndexError, AssertionError):
            return False

    def _frame(self, obs: Any, agent: str | None) -> tuple[np.ndarray, np.ndarray | None]:
        if self.agent_frame is not None:
            return self.agent_frame(obs, agent)
        if self.plan is None:
            raise ValueError("no plan")
        convert = self.plan.convert
        frame = np.asarray(obs if convert is None else convert(obs), self.spec.frame_dtype)
        if frame.shape != tuple(self.spec.frame_shape):
            raise ValueError(f"its frame has shape {frame.shape}, not {tuple(self.spec.frame_shape)}")
        return frame, None

    def _stacked(self, frames: np.ndarray) -> np.ndarray:
        """Frames pushed onto each row's stack (a new stack for a new batch size)."""
        stack = self.spec.stack
        if stack == 1:
            return frames[:, None]
        if self._stack is None or len(self._stack) != len(frames):
            self._stack = np.repeat(frames[:, None], stack, axis=1)
        else:
            self._stack[:, :-1] = self._stack[:, 1:]
            self._stack[:, -1] = frames
        stacked: np.ndarray = self._stack.copy()
        return stacked


def _all_legal(mask: np.ndarray | None, spec: EnvSpec) -> np.ndarray:
    return np.ones(spec.num_actions, bool) if mask is None else mask


def _shown(obs: Any) -> str:
    if isinstance(obs, np.ndarray):
        return f"an array of shape {obs.shape} and dtype {obs.dtype}"
    text = repr(obs)
    return f"{type(obs).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"
