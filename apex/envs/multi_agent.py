"""PettingZoo environments: making them from a config, each agent's frames, actions and
action mask, and ``MultiAgentEnv``, which steps one ParallelEnv or AECEnv behind one interface.

``env.id`` names a PettingZoo environment as ``module:attr``: ``attr`` is a callable that
returns a ``pettingzoo.ParallelEnv`` or ``pettingzoo.AECEnv`` (called with ``env.kwargs``), or
a module with ``parallel_env()`` / ``env()`` as PettingZoo's own are
(``pettingzoo.classic:tictactoe_v3``; ``parallel_env`` is taken where both exist). apex tells
the API by what it gets. Each agent's observations become frames exactly as a Gymnasium
environment's do (``apex.envs.spaces``), but for an ``action_mask`` in an observation dict
(PettingZoo classic's convention), which is taken out and restricts the actions, as one in
the agent's ``info`` does.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces as gym_spaces

from apex.config import EnvConfig
from apex.config.trust import is_pettingzoo_env_id
from apex.envs import make, spaces
from apex.envs.make import EnvSpec, import_env_modules, resolve, spec_of
from apex.errors import ConfigError

MASK_KEY = "action_mask"


def is_multi_agent(env: EnvConfig) -> bool:
    """Whether ``env.id`` names a PettingZoo environment (``module:attr`` where attr is not a
    registered Gymnasium id); imports the module (ConfigError if it cannot be)."""
    if ":" not in env.id:
        return False
    if is_pettingzoo_env_id(env.id):
        return True
    attr = env.id.partition(":")[2]
    if not attr.isidentifier():  # module:Some-Id-v0 is a Gymnasium id
        return False
    import_env_modules(env)
    return attr not in gym.registry


# PettingZoo's classic and butterfly games import pygame.
EXTRA_OF = {**make.EXTRA_OF, "pygame": "multiagent"}


def _not_installed(env_id: str, error: ModuleNotFoundError) -> ConfigError:
    return ConfigError(f"env {env_id!r}: {make.not_installed(error, EXTRA_OF)}")


def _factory(env_id: str) -> Callable[..., Any]:
    """What ``env.id`` names: a callable returning a ParallelEnv or AECEnv (ConfigError if none)."""
    module_name, _, attr = env_id.partition(":")
    if attr.startswith("_"):
        raise ConfigError(f"env.id {env_id!r}: {attr!r} is private; name a public function or module")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise _not_installed(env_id, e) from None
    except Exception as e:
        raise ConfigError(f"env.id {env_id!r}: cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    try:  # a PettingZoo family's environments are its submodules (the family's own getattr warns)
        target: Any = importlib.import_module(f"{module_name}.{attr}")
    except ModuleNotFoundError as e:
        if e.name != f"{module_name}.{attr}":
            raise _not_installed(env_id, e) from None
        target = getattr(module, attr, None)
    except Exception as e:
        raise ConfigError(f"env.id {env_id!r}: importing it failed: {type(e).__name__}: {e}") from None
    if isinstance(target, types.ModuleType):
        made: Callable[..., Any] | None = getattr(target, "parallel_env", None) or getattr(target, "env", None)
        if not callable(made):
            raise ConfigError(f"env.id {env_id!r}: module {target.__name__} has no parallel_env() or env()")
        return made
    if not callable(target):
        raise ConfigError(
            f"env.id {env_id!r}: {module_name} has no {attr!r}, and it is not a registered Gymnasium id: "
            "name a function returning a PettingZoo ParallelEnv or AECEnv, or a PettingZoo module"
        )
    factory: Callable[..., Any] = target
    return factory


def api_of(env: Any) -> str | None:
    """``parallel`` or ``aec`` for a PettingZoo environment (wrappers included), else None."""
    from pettingzoo import AECEnv, ParallelEnv

    if isinstance(env, ParallelEnv):
        return "parallel"
    if isinstance(env, AECEnv):
        return "aec"
    return None


def make_pettingzoo(config: EnvConfig) -> tuple[Any, str]:
    """(the environment, ``parallel`` or ``aec``): env.imports imported, the factory called
    with env.kwargs, env.wrappers applied in order; ConfigError naming what went wrong."""
    try:
        import pettingzoo  # noqa: F401  (the extra's own message if it is missing)
    except ImportError:
        raise ConfigError("PettingZoo environments need pettingzoo: pip install 'apex-rl[multiagent]'") from None
    import_env_modules(config)
    factory = _factory(config.id)
    try:
        env = factory(**config.kwargs)
    except Exception as e:
        raise ConfigError(f"{config.id} with env.kwargs {config.kwargs!r} failed: {type(e).__name__}: {e}") from None
    for i, item in enumerate(config.wrappers):
        path, kwargs = (item, {}) if isinstance(item, str) else (item["type"], item.get("kwargs", {}))
        wrapper = resolve(path, f"env.wrappers[{i}]")
        try:
            env = wrapper(env, **kwargs)
        except Exception as e:
            raise ConfigError(f"env.wrappers[{i}] {path!r} failed on {config.id}: {type(e).__name__}: {e}") from None
    api = api_of(env)
    if api is None:
        raise ConfigError(
            f"env.id {config.id!r} made a {type(env).__name__}, not a PettingZoo ParallelEnv or AECEnv "
            "(a Gymnasium environment is named by its registered id)"
        )
    return env, api


@dataclass(frozen=True)
class AgentView:
    """One agent's observations as frames, its action mask, and its actions as the environment
    takes them."""

    observation_space: gym.Space[Any]  # as the environment declares it, action_mask included
    action_space: gym.Space[Any]
    obs: spaces.ObservationPlan
    act: spaces.ActionPlan
    spec: EnvSpec
    low: np.ndarray
    high: np.ndarray
    obs_key: str | None  # what of the observation dict is the observation, beside its action_mask
    rest_keys: tuple[str, ...]  # ... when that is several keys

    def frame(self, observation: Any) -> np.ndarray:
        if self.obs_key is not None:
            observation = observation[self.obs_key]
        elif self.rest_keys:
            observation = {key: observation[key] for key in self.rest_keys}
        convert = self.obs.convert
        return np.asarray(observation if convert is None else convert(observation), self.spec.frame_dtype)

    @property
    def masked(self) -> bool:
        return self.obs_key is not None or bool(self.rest_keys)

    def mask(self, observation: Any, info: Any) -> np.ndarray | None:
        """The legal actions (bool, one a Discrete action), or None where all are."""
        raw = None
        if self.masked:
            raw = observation[MASK_KEY]
        elif isinstance(info, dict) and MASK_KEY in info:
            raw = info[MASK_KEY]
        if raw is None or self.act.kind != "Discrete":
            return None
        mask = np.asarray(raw).astype(bool).reshape(-1)
        if mask.shape != (self.spec.num_actions,):
            raise ConfigError(f"an action_mask of shape {mask.shape}; the agent has {self.spec.num_actions} actions")
        return mask

    def env_action(self, action: Any) -> Any:
        action = self.spec.env_action(action)
        convert = self.act.convert
        return action if convert is None else convert(action)


def agent_view(env: Any, agent: str, config: EnvConfig, algo: str | None = None) -> AgentView:
    """How ``agent``'s observations and actions are read and made (ConfigError for spaces
    apex cannot handle, naming the agent)."""
    observation_space, action_space = env.observation_space(agent), env.action_space(agent)
    space, obs_key = observation_space, None
    rest_keys: tuple[str, ...] = ()
    if isinstance(space, gym_spaces.Dict) and MASK_KEY in space.spaces:
        rest = {key: sub for key, sub in space.spaces.items() if key != MASK_KEY}
        if list(rest) == ["observation"]:
            space, obs_key = rest["observation"], "observation"
        else:
            space, rest_keys = gym_spaces.Dict(rest), tuple(rest)
    try:
        obs = spaces.observation_plan(space)
        act = spaces.action_plan(action_space, config.id, config.action_bounds)
        if algo is not None:
            spaces.check_algo_actions(act.kind, act.nvec, algo, config.id, act.finite)
        if act.kind == "Box":
            # The episode cores bound continuous actions themselves (env.action_bounds), as
            # `apex serve` replies them: here they are only cast and shaped (clip: a no-op on
            # them), not squashed a second time.
            act = spaces.action_plan(action_space, config.id, "clip")
    except ConfigError as e:
        raise ConfigError(f"agent {agent!r}: {e}") from None
    spec, low, high = spec_of(obs, act, config, config.max_episode_steps)
    return AgentView(observation_space, action_space, obs, act, spec, low, high, obs_key, rest_keys)


@dataclass
class Turn:
    """An agent that acts now, on this frame (and mask)."""

    agent: str
    frame: np.ndarray
    mask: np.ndarray | None


@dataclass
class Ended:
    """An agent whose episode ended at this final frame."""

    agent: str
    frame: np.ndarray
    terminated: bool
    truncated: bool


@dataclass
class Outcome:
    """What one step (or a reset) of a ``MultiAgentEnv`` brought: the rewards each agent got
    since it last acted, the agents that ended, those that act next, and whether the episode
    is over (every agent ended)."""

    rewards: dict[str, float]
    ended: list[Ended]
    turns: list[Turn]
    done: bool


class MultiAgentEnv:
    """One PettingZoo environment behind one interface: ``reset()`` and ``step(actions)``
    give an ``Outcome``. A ParallelEnv's live agents all act each step; an AECEnv's agents act
    one at a time (the agent whose turn it is), agents that ended are stepped out with None.
    ``max_episode_steps`` (env.max_episode_steps) truncates every agent still playing."""

    def __init__(
        self, config: EnvConfig, views: dict[str, AgentView], frame: Callable[[str, np.ndarray], np.ndarray]
    ) -> None:
        """``frame(agent, frame)``: the frame as its policy sees it (the agent's index added)."""
        self.env, self.api = make_pettingzoo(config)
        self.views = views
        self._policy_frame = frame
        self.max_steps = config.max_episode_steps
        self.steps = 0  # of this episode: env.step calls (an AEC env's: one agent's move each)

    def _frame(self, agent: str, observation: Any) -> np.ndarray:
        return self._policy_frame(agent, self.views[agent].frame(observation))

    def _turn(self, agent: str, observation: Any, info: Any) -> Turn:
        return Turn(agent, self._frame(agent, observation), self.views[agent].mask(observation, info))

    def reset(self, seed: int | None = None) -> Outcome:
        self.steps = 0
        if self.api == "parallel":
            observations, infos = self.env.reset(seed=seed)
            turns = [self._turn(a, observations[a], infos.get(a, {})) for a in self.env.agents]
            return Outcome({}, [], turns, not turns)
        self.env.reset(seed=seed)
        return self._advance_aec()

    def step(self, actions: dict[str, Any]) -> Outcome:
        self.steps += 1
        cut = self.max_steps is not None and self.steps >= self.max_steps
        if self.api == "aec":
            ((agent, action),) = actions.items()
            self.env.step(self.views[agent].env_action(action))
            return self._advance_aec(cut)
        env_actions = {agent: self.views[agent].env_action(action) for agent, action in actions.items()}
        observations, rewards, terminations, truncations, infos = self.env.step(env_actions)
        ended, turns = [], []
        for agent, observation in observations.items():
            term, trunc = bool(terminations.get(agent, False)), bool(truncations.get(agent, False)) or cut
            if term or trunc:
                ended.append(Ended(agent, self._frame(agent, observation), term, trunc and not term))
            else:
                turns.append(self._turn(agent, observation, infos.get(agent, {})))
        return Outcome({a: float(r) for a, r in rewards.items()}, ended, turns, not turns)

    def _advance_aec(self, cut: bool = False) -> Outcome:
        """Steps out the agents that ended until one must act, or none is left; ``cut``: the
        time limit is reached, and every agent still playing ends truncated."""
        env = self.env
        rewards: dict[str, float] = {}
        ended: list[Ended] = []
        while env.agents:
            agent = env.agent_selection
            observation, reward, term, trunc, info = env.last()
            rewards[agent] = rewards.get(agent, 0.0) + float(reward)
            if term or trunc:
                ended.append(Ended(agent, self._frame(agent, observation), bool(term), not term))
                env.step(None)
                continue
            if cut:
                # The limit is ours, not the environment's, which would go on: each agent's
                # reward since its last move is in the AEC API's cumulative rewards.
                cumulative = getattr(env, "_cumulative_rewards", {})
                for other in env.agents:
                    if other != agent:
                        rewards[other] = rewards.get(other, 0.0) + float(cumulative.get(other, 0.0))
                    ended.append(Ended(other, self._frame(other, env.observe(other)), False, True))
                return Outcome(rewards, ended, [], True)
            return Outcome(rewards, ended, [self._turn(agent, observation, info)], False)
        return Outcome(rewards, ended, [], True)

    def close(self) -> None:
        self.env.close()
