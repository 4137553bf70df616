"""Environments: ``make_env`` for any Gymnasium id (Atari preprocessed), and ``VectorEnv``.

An environment here yields *frames* (``apex.envs.spaces``): a float32 vector (CartPole's
observation; Discrete, MultiBinary, MultiDiscrete, Dict and Tuple observations flattened),
or an image (H x W or C x H x W, uint8 or float32: Atari's 84x84 grayscale frames, any
other Box image). Stacking image frames into observations is the actor's job
(``FrameStacker``) and the replay's, so that each frame is sent and stored once.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np

from apex.config import ATARI_PREFIX, EnvConfig
from apex.config.trust import split_path
from apex.envs import spaces
from apex.errors import ConfigError
from apex.wire.schema import observation_bound


@dataclass(frozen=True)
class EnvSpec:
    """What the learner and the model need to know about an environment: its frames (a
    vector: rank 1, never stacked; an image: rank 2 or 3, ``stack`` of them make one
    observation) and its actions."""

    frame_shape: tuple[int, ...]
    frame_dtype: np.dtype
    stack: int
    num_actions: int  # Discrete: n; MultiDiscrete: the policy's logits, sum(action_nvec); Box: D values
    max_episode_steps: int | None = None  # the environment's time limit, where it has one
    action_nvec: tuple[int, ...] | None = None  # MultiDiscrete: choices per component; None: Discrete
    continuous: bool = False  # Box actions: D float32 values (a Gaussian's sample; the adapter bounds it)
    # The observation space's bound on the magnitude of each value of a vector frame (one for
    # all of an image's; inf where it sets none; (): not known): what batches are held to.
    frame_bound: tuple[float, ...] = ()
    # Each step's legal actions travel with the batches (a multi-agent policy whose agents'
    # observations carry an action_mask): Discrete actions only.
    action_masked: bool = False
    # A Box's bounds, raveled (inf where it sets none); () for the other kinds.
    action_low: tuple[float, ...] = ()
    action_high: tuple[float, ...] = ()

    def obs_bound(self, max_abs_obs: float | None) -> np.ndarray:
        """The largest magnitude a batch's frames may hold, per value (transport.max_abs_obs,
        or the space's finite bounds and 1e6 elsewhere: ``apex.wire.schema.observation_bound``)."""
        return observation_bound(self.frame_bound, max_abs_obs)

    def resolve_auto(self, setting: bool | str) -> bool:
        """A setting whose default is ``auto`` (env.normalize_reward,
        impala.normalize_advantages) for this task: on for continuous (Box) actions, where
        issue 47 measured that it matters, off for discrete ones (their presets were tuned
        without it); true or false as given otherwise."""
        return self.continuous if setting == "auto" else bool(setting)

    @property
    def is_image(self) -> bool:
        return len(self.frame_shape) > 1

    @property
    def action_shape(self) -> tuple[int, ...]:
        """One action as the actors send it: () for Discrete, (components,) for
        MultiDiscrete, (D,) for Box."""
        if self.continuous:
            return (self.num_actions,)
        return () if self.action_nvec is None else (len(self.action_nvec),)

    @property
    def action_dtype(self) -> np.dtype:
        return np.dtype(np.float32) if self.continuous else np.dtype(np.int64)

    def random_actions(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """``count`` random actions: uniform indices, [count] or [count, components] int64;
        continuous: standard normal values [count, D] (before the adapter bounds them)."""
        if self.continuous:
            return rng.standard_normal((count, self.num_actions)).astype(np.float32)
        if self.action_nvec is None:
            return rng.integers(0, self.num_actions, count)
        return rng.integers(0, np.asarray(self.action_nvec), (count, len(self.action_nvec)))

    def env_action(self, action: np.ndarray) -> int | np.ndarray:
        """One network action as ``VectorEnv`` passes it to the (adapted) environment."""
        if self.continuous:
            return np.asarray(action, np.float32)
        return int(action) if self.action_nvec is None else np.asarray(action, np.int64)


def _register_atari() -> None:
    try:
        import ale_py
    except ImportError:
        raise ConfigError("Atari environments need ale-py and OpenCV: pip install 'apex-rl[atari]'") from None
    gym.register_envs(ale_py)


# The extra that installs a package of environments apex knows by name.
EXTRA_OF = {"mpe2": "mpe", "pettingzoo": "multiagent", "ale_py": "atari", "minatar": "minatar", "Box2D": "box2d"}


def not_installed(error: ModuleNotFoundError, extras: dict[str, str] = EXTRA_OF) -> str:
    """What a missing module means, and the extra that installs it where apex knows one."""
    extra = extras.get((error.name or "").partition(".")[0])
    fix = f"pip install 'apex-rl[{extra}]'" if extra else f"install {error.name}"
    return f"{error.name!r} is not installed: {fix}"


def import_env_modules(config: EnvConfig) -> None:
    """Imports env.imports and the module of a ``module:EnvId`` id; ConfigError naming the
    module that cannot be imported."""
    modules = list(config.imports)
    if ":" in config.id:
        modules.append(config.id.partition(":")[0])
    if modules and "" not in sys.path and os.getcwd() not in sys.path:
        # Where `python -m apex` (apex run's children) looks first: the `apex` script does not.
        sys.path.insert(0, os.getcwd())
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or e.name.partition(".")[0] not in EXTRA_OF:
                raise ConfigError(
                    f"cannot import {name!r} (from env.imports or env.id): {type(e).__name__}: {e}; "
                    "install it, or make it importable here (PYTHONPATH, the working directory)"
                ) from None
            raise ConfigError(f"env {config.id!r}: {not_installed(e)}") from None
        except Exception as e:  # its own import errors too: any of them means the env cannot be made
            raise ConfigError(
                f"cannot import {name!r} (from env.imports or env.id): {type(e).__name__}: {e}; "
                "install it, or make it importable here (PYTHONPATH, the working directory)"
            ) from None


def resolve(path: str, what: str) -> Any:
    """The object at a dotted path (``pkg.mod.Name`` or ``pkg.mod:Name``); ConfigError if none."""
    module_name, attr = split_path(path)
    if not module_name or not attr:
        raise ConfigError(f"{what} {path!r} is not a dotted path such as gymnasium.wrappers.TimeAwareObservation")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:
        raise ConfigError(f"{what} {path!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        # What the allowance (apex.config.trust) names is the module: a path may not walk out
        # of it through a module it imports (gymnasium.wrappers:atari_preprocessing.np.f2py.
        # subprocess...), nor through private or dunder attributes.
        if part.startswith("_"):
            raise ConfigError(f"{what} {path!r}: {part!r} is private; name a public class or function")
        if not hasattr(obj, part):
            raise ConfigError(f"{what} {path!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
        if isinstance(obj, types.ModuleType):
            raise ConfigError(
                f"{what} {path!r}: {part!r} is a module; name it before the colon ({module_name}.{part}:...)"
            )
    return obj


def _apply_wrappers(env: gym.Env, config: EnvConfig) -> gym.Env:
    for i, item in enumerate(config.wrappers):
        path, kwargs = (item, {}) if isinstance(item, str) else (item["type"], item.get("kwargs", {}))
        wrapper = resolve(path, f"env.wrappers[{i}]")
        if not callable(wrapper):
            raise ConfigError(f"env.wrappers[{i}] {path!r} is not a wrapper class or a callable taking an env")
        try:
            env = wrapper(env, **kwargs)
        except Exception as e:
            raise ConfigError(f"env.wrappers[{i}] {path!r} failed on {config.id}: {type(e).__name__}: {e}") from None
        if not isinstance(env, gym.Env):
            raise ConfigError(f"env.wrappers[{i}] {path!r} returned {type(env).__name__}, not a gymnasium.Env")
    return env


def make_env(config: EnvConfig, seed: int | None = None, render_mode: str | None = None) -> gym.Env:
    """Creates one environment: env.imports imported, gym.make(env.id, **env.kwargs), the
    Atari preprocessing for ALE ids, env.wrappers in order, then apex.envs.spaces' adapters
    (observations to frames, actions from 0-based indices); raises ConfigError for an
    unknown id or an unusable one. ``render_mode`` (e.g. ``rgb_array`` for recording videos)
    is passed to gymnasium."""
    return _make(config, seed, render_mode)[0]


def _register_plugin(env_id: str) -> bool:
    """Registers the ids of the installed package that declares a ``gymnasium.envs`` entry
    point named after ``env_id``'s namespace (``MinAtar`` for ``MinAtar/Breakout-v1``), as
    gym did for its plugins and gymnasium 1.x no longer does; True if it did."""
    namespace = env_id.partition("/")[0] if "/" in env_id else None
    if namespace is None or any(name.startswith(f"{namespace}/") for name in gym.registry):
        return False  # no namespace, or its plugin is registered already: the id is wrong
    from importlib.metadata import entry_points

    for entry in entry_points(group="gymnasium.envs"):
        if entry.name == namespace:
            try:
                entry.load()()
            except Exception as e:  # its own import errors too: then the id stays unknown
                raise ConfigError(
                    f"env.id {env_id!r}: the {namespace} plugin ({entry.value}) failed to register: "
                    f"{type(e).__name__}: {e}"
                ) from None
            try:
                gym.spec(env_id)
                return True
            except gym.error.Error:
                return False
    return False


def _make(
    config: EnvConfig, seed: int | None = None, render_mode: str | None = None
) -> tuple[gym.Env, spaces.ObservationPlan, spaces.ActionPlan]:
    is_atari = config.is_atari
    if is_atari:
        _register_atari()
    import_env_modules(config)
    registered_id = config.id.partition(":")[2] or config.id
    try:
        gym.spec(registered_id)
    except gym.error.Error:
        if _register_plugin(registered_id):
            return _make(config, seed, render_mode)
        known = [name for name in gym.registry if not name.startswith(ATARI_PREFIX) or is_atari]
        import difflib

        close = difflib.get_close_matches(registered_id, known, n=1)
        hint = f"; did you mean {close[0]}?" if close else "; see gymnasium.registry for the ids installed"
        if ":" not in config.id and not config.imports:
            hint += " (your own environment: env.imports: [your_module] or env.id: your_module:Id)"
        raise ConfigError(f"env.id {config.id!r} is not a registered Gymnasium environment{hint}") from None
    kwargs = {**config.kwargs, **({} if render_mode is None else {"render_mode": render_mode})}
    if config.max_episode_steps is not None:
        kwargs["max_episode_steps"] = config.max_episode_steps
    try:
        if is_atari:
            env = gym.make(config.id, frameskip=1, **kwargs)
            env = gym.wrappers.AtariPreprocessing(
                env,
                noop_max=config.noop_max,
                frame_skip=config.frame_skip,
                screen_size=84,
                terminal_on_life_loss=config.terminal_on_life_loss,
                grayscale_obs=True,
            )
        else:
            env = gym.make(config.id, **kwargs)
    except ConfigError:
        raise
    except Exception as e:  # e.g. a keyword the environment does not take
        raise ConfigError(
            f"gym.make({config.id!r}) with env.kwargs {config.kwargs!r} failed: {type(e).__name__}: {e}"
        ) from None
    env = _apply_wrappers(env, config)
    # Last, after the user's wrappers: observations become frames, actions 0-based indices
    # (apex.envs.spaces), the same in every actor, the learner's EnvSpec and apex eval.
    try:
        env, obs, act = spaces.adapt(env, config.id, config.action_bounds)
    except ConfigError:
        env.close()
        raise
    if seed is not None:
        env.action_space.seed(seed)
    return env, obs, act


def observation_plan_of(config: EnvConfig) -> spaces.ObservationPlan:
    """How ``config``'s environment's own observations become frames (one is made and closed)."""
    env, obs, _ = _make(config)
    env.close()
    return obs


def env_spec(config: EnvConfig, algo: str | None = None) -> EnvSpec:
    """The spec of ``config``'s environments (one is made and closed); with ``algo``, also a
    ConfigError naming a fix when that algorithm cannot act in its action space."""
    return env_spaces(config, algo)[0]


def env_spaces(config: EnvConfig, algo: str | None = None) -> tuple[EnvSpec, np.ndarray, np.ndarray]:
    """``env_spec``, and the bounds (low, high) of one frame: what `apex serve` checks the
    observations of external environments against."""
    env, obs, act = _make(config)
    try:
        if algo is not None:
            spaces.check_algo_actions(act.kind, act.nvec, algo, config.id, act.finite)
        limit = env.spec.max_episode_steps if env.spec is not None else None
        return spec_of(obs, act, config, config.max_episode_steps or limit)
    finally:
        env.close()


def spec_of(
    obs: spaces.ObservationPlan, act: spaces.ActionPlan, config: EnvConfig, max_episode_steps: int | None
) -> tuple[EnvSpec, np.ndarray, np.ndarray]:
    """The EnvSpec of frames and actions made by these plans, and the bounds (low, high) of one frame."""
    low, high = np.asarray(obs.space.low, np.float64), np.asarray(obs.space.high, np.float64)
    magnitude = np.maximum(np.abs(low), np.abs(high))
    frame_bound = tuple(magnitude.tolist()) if obs.kind != "image" else (float(magnitude.max()),)
    spec = EnvSpec(
        obs.frame_shape,
        obs.frame_dtype,
        config.frame_stack if obs.kind == "image" else 1,
        sum(act.nvec),
        max_episode_steps,
        act.nvec if act.kind == "MultiDiscrete" else None,
        act.kind == "Box",
        frame_bound,
        action_low=act.low,
        action_high=act.high,
    )
    return spec, np.asarray(obs.space.low), np.asarray(obs.space.high)


class VectorEnv:
    """K environments stepped in turn, each reset in the same step it ends.

    ``step`` returns the frames to act on next (a reset frame where an episode ended),
    and, for the environments that ended, the episode's final frame.
    """

    def __init__(self, config: EnvConfig, num_envs: int, seed: int, tick: Callable[[], None] = lambda: None) -> None:
        """``tick`` is called between environments while they are made and reset: Atari's take
        a third of a second each, and the actor must heartbeat meanwhile."""
        self.spec = env_spec(config)
        self._tick = tick
        self.envs = []
        for i in range(num_envs):
            self.envs.append(make_env(config, seed + i))
            tick()
        self._seed = seed
        self._frames = np.zeros((num_envs, *self.spec.frame_shape), self.spec.frame_dtype)

    @property
    def num_envs(self) -> int:
        return len(self.envs)

    def reset(self) -> np.ndarray:
        for i, env in enumerate(self.envs):
            frame, _ = env.reset(seed=self._seed + i)
            self._frames[i] = frame
            self._tick()
        frames: np.ndarray = self._frames.copy()
        return frames

    def step(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        """(frames, rewards, terminated, truncated, final_frames by env index)."""
        n = len(self.envs)
        rewards = np.zeros(n, np.float64)
        terminated = np.zeros(n, bool)
        truncated = np.zeros(n, bool)
        final = {}
        for i, env in enumerate(self.envs):
            frame, reward, term, trunc, _ = env.step(self.spec.env_action(actions[i]))
            rewards[i], terminated[i], truncated[i] = reward, term, trunc
            if term or trunc:
                final[i] = np.asarray(frame, self.spec.frame_dtype)
                frame, _ = env.reset()
            self._frames[i] = frame
        return self._frames.copy(), rewards, terminated, truncated, final

    def close(self) -> None:
        for env in self.envs:
            env.close()


class FrameStacker:
    """The last ``stack`` frames of each environment, as network input."""

    def __init__(self, num_envs: int, stack: int, frame_shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.obs = np.zeros((num_envs, stack, *frame_shape), dtype)

    def reset(self, i: int, frame: np.ndarray) -> None:
        self.obs[i] = frame  # broadcast: the first frame repeated, as the chunker stores it

    def push(self, i: int, frame: np.ndarray) -> None:
        self.obs[i, :-1] = self.obs[i, 1:]
        self.obs[i, -1] = frame

    def peek(self, i: int, frame: np.ndarray) -> np.ndarray:
        """Env i's observation if ``frame`` came next (for a final frame)."""
        return np.concatenate([self.obs[i, 1:], frame[None]])
