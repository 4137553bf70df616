"""Observation and action spaces: what apex accepts, and what the network sees of it.

``make_env`` ends every environment with the adapters below, so that actors, the learner
(its ``EnvSpec``) and ``apex eval`` all see the same thing: *frames* of one of two kinds.

Observations (``observation_plan``):

- **image**: a top-level ``Box`` of rank 2 (H x W) or rank 3 whose two spatial sides are
  each at least ``IMAGE_MIN_SIDE``. Rank 3 is read as channels-last (H x W x C) unless its
  first dim is smaller than its last (then C x H x W): (84, 84, 3), (10, 10, 4) and
  (10, 10, 10) are channels-last, (3, 84, 84) channels-first. ``ImageLayout`` overrides
  the rule. Frames are C x H x W, or H x W for a single channel (as ALE's 84 x 84
  grayscale frames), stored once and stacked ``env.frame_stack`` times by the actors'
  ``FrameStacker`` and the learner's replay. uint8 stays uint8, bool becomes uint8 0/255
  (the CNN divides uint8 by 255, so both reach it as 0..1), any other dtype float32 as
  it is (scale float images to about [0, 1] yourself).
- **vector**: everything else, one float32 vector, never stacked: a ``Box`` raveled,
  ``Discrete`` one-hot (index ``x - start``), ``MultiBinary`` as 0/1 floats,
  ``MultiDiscrete`` one-hot per component (in ravel order), ``Tuple`` in order and
  ``Dict`` in its key order (a plain dict's keys sorted, as gymnasium's ``Dict`` does),
  each part flattened the same way: exactly ``gymnasium.spaces.flatten``, as float32.
  A Box inside a Dict or Tuple is flattened even if it is an image.

Actions (``action_plan``): the network picks component indices from 0; the adapter adds
``start`` and restores a MultiDiscrete's shape before the environment sees them.

- ``Discrete(n)``: both algorithms.
- ``MultiDiscrete(nvec)`` (and ``MultiBinary(n)``, as n two-way components): IMPALA, as a
  factorised categorical policy (one softmax per component, log-probabilities and
  entropies summed). Ape-X DQN refuses it (a Q-value per joint action would not scale).
- Continuous ``Box(low, high, (D,))`` (any shape, raveled): IMPALA, as a diagonal Gaussian
  policy (``apex.nets.torch_nets``). The network's action is its sample u, a float32 vector; the
  adapter maps it into the bounds, ``env.action_bounds``: ``clip`` or ``squash`` (tanh,
  then scaled to [low, high]; finite bounds only). Ape-X DQN refuses it.
- ``Tuple``/``Dict`` actions and the rest: refused, naming a wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from apex.core import ALGO_ACTIONS
from apex.errors import ConfigError

IMAGE_MIN_SIDE = 8
"""Smaller rank-2/3 Boxes (a 3 x 3 board) go to the MLP: a conv torso gains nothing there."""

LAYOUTS = ("hwc", "chw", "hw", "vector")

_FLATTENABLE = (spaces.Box, spaces.Discrete, spaces.MultiBinary, spaces.MultiDiscrete, spaces.Tuple, spaces.Dict)


class ImageLayout(gym.Wrapper):
    """Says how to read a Box observation where the rule in this module's docstring would
    guess wrong: ``hwc``, ``chw``, ``hw`` (images) or ``vector`` (flatten it for the MLP).
    Use it last in env.wrappers: ``{type: apex.envs.spaces.ImageLayout, kwargs: {layout: chw}}``."""

    def __init__(self, env: gym.Env, layout: str) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        super().__init__(env)
        self.layout = layout


def layout_hint(env: gym.Env) -> str | None:
    """The layout named by the outermost ImageLayout among env's wrappers, if any."""
    while isinstance(env, gym.Wrapper):
        if isinstance(env, ImageLayout):
            return env.layout
        env = env.env
    return None


# -- observations


@dataclass(frozen=True)
class ObservationPlan:
    kind: str  # "image" or "vector"
    space: spaces.Box  # one frame as the network sees it
    convert: Callable[[Any], np.ndarray] | None  # None: observations are frames already

    @property
    def frame_shape(self) -> tuple[int, ...]:
        return tuple(self.space.shape)

    @property
    def frame_dtype(self) -> np.dtype:
        return np.dtype(self.space.dtype)


def image_layout(shape: tuple[int, ...]) -> str | None:
    """``hw``, ``hwc`` or ``chw`` for a Box shape that is an image, None for one that is not."""
    if len(shape) == 2:
        layout, sides = "hw", shape
    elif len(shape) == 3:
        layout = "chw" if shape[0] < shape[2] else "hwc"
        sides = shape[1:] if layout == "chw" else shape[:2]
    else:
        return None
    return layout if min(sides) >= IMAGE_MIN_SIDE else None


def observation_plan(space: gym.Space[Any], layout: str | None = None) -> ObservationPlan:
    """How observations of ``space`` become frames (see the module docstring); ``layout``
    overrides the image rule. ConfigError for a space that cannot be flattened."""
    if isinstance(space, spaces.Box):
        if layout is None:
            layout = image_layout(tuple(space.shape))
        elif layout != "vector" and len(space.shape) != len(layout):
            raise ConfigError(
                f"ImageLayout {layout!r} does not fit observations of shape {space.shape}: "
                f"use a layout of rank {len(space.shape)} ({', '.join(LAYOUTS)})"
            )
        if layout is not None and layout != "vector":
            return _image_plan(space, layout)
        if len(space.shape) == 1 and space.dtype == np.float32:
            return ObservationPlan("vector", space, None)
        return ObservationPlan(
            "vector", _float_box(space.low.ravel(), space.high.ravel()), lambda x: np.asarray(x, np.float32).reshape(-1)
        )
    problem = _unflattenable(space)
    if problem is not None:
        raise ConfigError(
            f"observations of {problem} cannot be flattened into a vector: map them to a Box, "
            "Discrete, MultiBinary, MultiDiscrete, Tuple or Dict with a wrapper (env.wrappers)"
        )
    flat = spaces.flatten_space(space)
    if not isinstance(flat, spaces.Box):  # what the fixed-size kinds flatten to
        raise ConfigError(f"observations of {space} do not flatten into a vector")
    if isinstance(space, spaces.Discrete):  # the common case, without gymnasium's int64 detour
        n, start = int(space.n), int(space.start)

        def one_hot(x: Any) -> np.ndarray:
            out = np.zeros(n, np.float32)
            out[int(x) - start] = 1.0
            return out

        return ObservationPlan("vector", _float_box(flat.low, flat.high), one_hot)
    return ObservationPlan(
        "vector", _float_box(flat.low, flat.high), lambda x: np.asarray(spaces.flatten(space, x), np.float32)
    )


def _float_box(low: np.ndarray, high: np.ndarray) -> spaces.Box:
    with np.errstate(over="ignore"):  # float64 bounds beyond float32's range become infinite
        return spaces.Box(np.asarray(low, np.float32), np.asarray(high, np.float32), dtype=np.float32)


def _unflattenable(space: gym.Space[Any]) -> gym.Space[Any] | None:
    """The first (sub)space that is not of a fixed-size kind, or None."""
    if not isinstance(space, _FLATTENABLE):
        return space
    if isinstance(space, (spaces.Tuple, spaces.Dict)):
        for sub in space.spaces.values() if isinstance(space, spaces.Dict) else space.spaces:
            problem = _unflattenable(sub)
            if problem is not None:
                return problem
    return None


def _image_plan(space: spaces.Box, layout: str) -> ObservationPlan:
    """Frames C x H x W (H x W for one channel) of uint8 (from uint8 or bool) or float32."""
    low, high = np.asarray(space.low), np.asarray(space.high)
    if layout == "hwc":
        low, high = low.transpose(2, 0, 1), high.transpose(2, 0, 1)
    if low.ndim == 3 and low.shape[0] == 1:
        low, high = low[0], high[0]
    shape = low.shape
    source = np.dtype(space.dtype)
    transpose = layout == "hwc"

    def frames(x: Any, dtype: np.dtype, scale: int = 1) -> np.ndarray:
        x = np.asarray(x)
        if transpose:
            x = x.transpose(2, 0, 1)
        x = x.reshape(shape)
        if scale != 1:
            scaled: np.ndarray = np.multiply(x, scale, dtype=dtype)
            return scaled
        return np.ascontiguousarray(x, dtype)

    if source == np.uint8:
        box = spaces.Box(low.astype(np.uint8), high.astype(np.uint8), dtype=np.uint8)
        convert = (
            None if layout in ("hw", "chw") and shape == space.shape else (lambda x: frames(x, np.dtype(np.uint8)))
        )
        return ObservationPlan("image", box, convert)
    if source == np.bool_:
        box = spaces.Box(0, 255, shape, np.uint8)
        return ObservationPlan("image", box, lambda x: frames(x, np.dtype(np.uint8), 255))
    return ObservationPlan("image", _float_box(low, high), lambda x: frames(x, np.dtype(np.float32)))


class ObservationAdapter(gym.ObservationWrapper):
    """Turns the environment's observations into frames (``observation_plan``)."""

    def __init__(self, env: gym.Env, plan: ObservationPlan) -> None:
        super().__init__(env)
        self.plan = plan
        self.observation_space = plan.space

    def observation(self, observation: Any) -> np.ndarray:
        convert = self.plan.convert
        return observation if convert is None else convert(observation)


# -- actions


@dataclass(frozen=True)
class ActionPlan:
    kind: str  # "Discrete", "MultiDiscrete" or "Box"
    nvec: tuple[int, ...]  # choices per component: (n,) for Discrete; (D,) for a Box of D values
    convert: Callable[[Any], Any] | None  # network action -> environment action; None: the same
    low: tuple[float, ...] = ()  # a Box's bounds, raveled (inf where it sets none)
    high: tuple[float, ...] = ()

    @property
    def finite(self) -> bool:
        """Whether every bound of a Box is finite (True for the other kinds)."""
        return bounds_finite(self.low, self.high)


def bounds_finite(low: tuple[float, ...], high: tuple[float, ...]) -> bool:
    """Whether every one of a Box's raveled bounds is finite (an empty pair: no Box, True)."""
    return bool(np.isfinite(low).all() and np.isfinite(high).all())


def bounded(space: spaces.Box, how: str) -> Callable[[Any], np.ndarray]:
    """A Gaussian sample u (raveled) -> an action of ``space``: ``clip`` or ``squash``."""
    shape, dtype = space.shape, space.dtype
    bound = box_actions(np.asarray(space.low).ravel(), np.asarray(space.high).ravel(), how)
    return lambda u: bound(np.asarray(u, np.float64)).astype(dtype).reshape(shape)


def box_actions(low: Any, high: Any, how: str) -> Callable[[np.ndarray], np.ndarray]:
    """Gaussian samples u [..., D] -> actions within a Box's raveled bounds, float64:
    ``clip``, or ``squash`` (mid + half * tanh(u))."""
    low, high = np.asarray(low, np.float64), np.asarray(high, np.float64)
    if how == "squash":
        mid, half = (high + low) / 2, (high - low) / 2
        # tanh(u) may round to +-1
        return lambda u: np.clip(mid + half * np.tanh(np.asarray(u, np.float64)), low, high)
    return lambda u: np.clip(np.asarray(u, np.float64), low, high)


# squash's preimage of an action on a bound is infinite: it is taken this close to the bound
SQUASH_EDGE = 1e-6


def box_samples(low: Any, high: Any, how: str) -> Callable[[np.ndarray], np.ndarray]:
    """``box_actions``'s inverse for actions within the bounds: the sample u [..., D] that
    gives each (``clip``: the action itself)."""
    low, high = np.asarray(low, np.float64), np.asarray(high, np.float64)
    if how == "squash":
        mid, half = (high + low) / 2, (high - low) / 2
        edge = 1 - SQUASH_EDGE
        return lambda a: np.arctanh(np.clip((np.asarray(a, np.float64) - mid) / half, -edge, edge))
    return lambda a: np.asarray(a, np.float64)


def action_plan(space: gym.Space[Any], env_id: str, bounds: str = "clip") -> ActionPlan:
    """What the network picks for ``space``; ConfigError naming a fix for what apex cannot
    act in. ``bounds``: how a continuous action gets into a Box (``env.action_bounds``)."""
    if isinstance(space, spaces.Discrete):
        start = int(space.start)
        return ActionPlan("Discrete", (int(space.n),), None if start == 0 else (lambda a: int(a) + start))
    if isinstance(space, spaces.MultiDiscrete):
        nvec, starts = np.asarray(space.nvec), np.asarray(space.start)
        shape, dtype = nvec.shape, space.dtype
        same = nvec.ndim == 1 and not starts.any()
        return ActionPlan(
            "MultiDiscrete",
            tuple(int(n) for n in nvec.ravel()),
            None if same else (lambda a: (np.asarray(a).reshape(shape) + starts).astype(dtype)),
        )
    if isinstance(space, spaces.MultiBinary):
        shape = space.shape
        return ActionPlan("MultiDiscrete", (2,) * int(np.prod(shape)), lambda a: np.asarray(a, np.int8).reshape(shape))
    if isinstance(space, spaces.Box):
        if not np.issubdtype(space.dtype, np.floating):
            raise ConfigError(
                f"env.id {env_id!r} has integer Box actions {space}: map them to MultiDiscrete with "
                "a gymnasium.ActionWrapper in env.wrappers (algo impala)"
            )
        if bounds == "squash" and not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
            raise ConfigError(
                f"env.action_bounds squash needs finite bounds, and env.id {env_id!r} has actions "
                f"{space}: use env.action_bounds: clip"
            )
        low = tuple(np.asarray(space.low, np.float64).ravel().tolist())
        high = tuple(np.asarray(space.high, np.float64).ravel().tolist())
        return ActionPlan("Box", (int(np.prod(space.shape)),), bounded(space, bounds), low, high)
    raise ConfigError(
        f"env.id {env_id!r} has {space} actions: apex needs Discrete (or MultiDiscrete for algo impala); "
        "map them with a gymnasium.ActionWrapper in env.wrappers"
    )


def check_algo_actions(
    plan_kind: str, nvec: tuple[int, ...], algo: str, env_id: str, finite_bounds: bool = True
) -> None:
    """ConfigError when ``algo`` cannot act in the environment's (adapted) action space
    (``finite_bounds``: whether a Box's bounds are all finite)."""
    if algo == "apex_ddpg":
        if plan_kind != "Box":
            raise ConfigError(
                f"algo apex_ddpg needs continuous (Box) actions, and env.id {env_id!r} has {plan_kind} "
                f"{list(nvec)}: use --algo apex_dqn (Discrete), impala or appo (Discrete or MultiDiscrete)"
            )
        if not finite_bounds:
            raise ConfigError(
                f"algo apex_ddpg acts within the action bounds, and env.id {env_id!r} has unbounded actions: "
                "bound them with env.wrappers: [{type: gymnasium.wrappers.ClipAction}] on a Box with "
                "finite bounds, or use --algo impala (a Gaussian policy)"
            )
        return
    if plan_kind in ALGO_ACTIONS.get(algo, (plan_kind,)):
        return
    if plan_kind == "Box":
        raise ConfigError(
            f"algo {algo} needs Discrete actions, and env.id {env_id!r} has continuous ones: use "
            "--algo impala or appo (a Gaussian policy) or apex_ddpg, or discretize them with env.wrappers: "
            "[{type: gymnasium.wrappers.DiscretizeAction, kwargs: {bins: 5}}]"
        )
    raise ConfigError(
        f"algo {algo} needs Discrete actions, and env.id {env_id!r} has {plan_kind} {list(nvec)}: "
        "use --algo impala (a factorised policy), or a gymnasium.ActionWrapper in env.wrappers that "
        "maps one Discrete action to each combination"
    )


def network_action_space(plan: ActionPlan) -> gym.Space[Any]:
    """The actions the network gives: indices from 0, or a Gaussian's unbounded sample."""
    if plan.kind == "Box":
        return spaces.Box(-np.inf, np.inf, plan.nvec, np.float32)
    if plan.kind == "Discrete":
        return spaces.Discrete(plan.nvec[0])
    return spaces.MultiDiscrete(np.asarray(plan.nvec, np.int64))


class ActionAdapter(gym.ActionWrapper):
    """Maps the network's actions (component indices from 0, flat; a Gaussian's sample) to
    the environment's."""

    def __init__(self, env: gym.Env, plan: ActionPlan) -> None:
        super().__init__(env)
        self.plan = plan
        self.action_space = network_action_space(plan)

    def action(self, action: Any) -> Any:
        convert = self.plan.convert
        return action if convert is None else convert(action)


def adapt(env: gym.Env, env_id: str, action_bounds: str = "clip") -> tuple[gym.Env, ObservationPlan, ActionPlan]:
    """``env`` with the adapters it needs (none for frames and 0-based Discrete actions
    already, e.g. CartPole and ALE), and the plans."""
    obs = observation_plan(env.observation_space, layout_hint(env))
    act = action_plan(env.action_space, env_id, action_bounds)
    if obs.convert is not None:
        env = ObservationAdapter(env, obs)
    if act.convert is not None:
        env = ActionAdapter(env, act)
    return env, obs, act
