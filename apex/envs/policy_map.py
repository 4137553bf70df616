"""Which policy each agent of a PettingZoo environment acts with (``multi_agent.mapping``), and
what each policy's network sees: ``MultiAgentSpec``, made once from one environment, as
``env_spec`` is for a Gymnasium one."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from apex.config import Config
from apex.config.multi_agent import MAX_POLICIES, policy_name_problem
from apex.envs.make import EnvSpec, resolve
from apex.envs.multi_agent import AgentView, MultiAgentEnv, agent_view, make_pettingzoo
from apex.errors import ConfigError


def policy_mapper(config: Config) -> Callable[[str], str]:
    """agent id -> policy name, as multi_agent.mapping says (ConfigError for an agent that no
    pattern matches, or a name that cannot be a policy's)."""
    mapping = config.multi_agent.mapping
    if mapping == "shared":
        return lambda agent: "shared"
    if mapping == "per_agent":
        return _checked(lambda agent: agent, "multi_agent.mapping per_agent")
    if isinstance(mapping, dict):
        patterns = list(mapping.items())

        def by_pattern(agent: str) -> str:
            for pattern, policy in patterns:
                if fnmatch.fnmatchcase(agent, pattern):
                    return policy
            raise ConfigError(
                f"multi_agent.mapping: no pattern matches agent {agent!r} (patterns: "
                f"{', '.join(p for p, _ in patterns)}); add one, e.g. {{'*': shared}} last"
            )

        return by_pattern
    function = resolve(mapping, "multi_agent.mapping")
    if not callable(function):
        raise ConfigError(f"multi_agent.mapping {mapping!r} is not a function (agent id -> policy name)")
    return _checked(function, f"multi_agent.mapping {mapping!r}")


def _checked(mapper: Callable[[str], Any], what: str) -> Callable[[str], str]:
    def checked(agent: str) -> str:
        try:
            name = mapper(agent)
        except Exception as e:
            raise ConfigError(f"{what} failed for agent {agent!r}: {type(e).__name__}: {e}") from None
        if (problem := policy_name_problem(name)) is not None:
            raise ConfigError(f"{what} for agent {agent!r}: {problem}; map agents to names with a pattern mapping")
        return str(name)

    return checked


@dataclass(frozen=True)
class PolicySpec:
    """One policy: the agents that act with it (in the environment's order) and what its
    network sees (their spaces, which agree; with agent_id_input, the agent's index one-hot
    after the frame)."""

    name: str
    agents: tuple[str, ...]
    spec: EnvSpec
    low: np.ndarray
    high: np.ndarray
    agent_id_input: bool
    masked: bool  # its agents' observations carry an action_mask

    def frame(self, agent: str, frame: np.ndarray) -> np.ndarray:
        if not self.agent_id_input:
            return frame
        one_hot = np.zeros(len(self.agents), frame.dtype)
        one_hot[self.agents.index(agent)] = 1
        return np.concatenate([frame, one_hot])


@dataclass(frozen=True)
class MultiAgentSpec:
    api: str  # "parallel" or "aec"
    agents: tuple[str, ...]  # possible_agents
    policy_of: dict[str, str]  # agent -> policy name
    policies: dict[str, PolicySpec]
    views: dict[str, AgentView]
    trained: tuple[str, ...]  # the policies that learn (multi_agent.train)

    def make(self, config: Config) -> MultiAgentEnv:
        """A new environment of this spec, its frames as the policies see them."""
        return MultiAgentEnv(config.env, self.views, self._policy_frame)

    def _policy_frame(self, agent: str, frame: np.ndarray) -> np.ndarray:
        return self.policies[self.policy_of[agent]].frame(agent, frame)


def multi_agent_spec(config: Config) -> MultiAgentSpec:
    """The spec of config's PettingZoo environment and its policies (one environment is made
    and closed); ConfigError naming the agents whose spaces differ under one policy."""
    env, api = make_pettingzoo(config.env)
    try:
        agents = tuple(env.possible_agents)
        if not agents:
            raise ConfigError(f"env.id {config.env.id!r} has no agents (possible_agents is empty)")
        mapper = policy_mapper(config)
        policy_of = {agent: mapper(agent) for agent in agents}
        views = {agent: agent_view(env, agent, config.env, config.algo) for agent in agents}
    finally:
        env.close()
    groups: dict[str, list[str]] = {}
    for agent, policy in policy_of.items():
        groups.setdefault(policy, []).append(agent)
    if len(groups) > MAX_POLICIES:
        raise ConfigError(f"{len(groups)} policies; at most {MAX_POLICIES}: map agents to fewer with patterns")
    policies = {name: _policy_spec(name, members, views, config) for name, members in groups.items()}
    for name in config.multi_agent.train or []:
        if name not in policies:
            raise ConfigError(f"multi_agent.train names policy {name!r}, and the policies are {', '.join(policies)}")
    trained = tuple(name for name in policies if name in (config.multi_agent.train or policies))
    return MultiAgentSpec(api, agents, policy_of, policies, views, trained)


def _policy_spec(name: str, agents: list[str], views: dict[str, AgentView], config: Config) -> PolicySpec:
    first = views[agents[0]]
    for agent in agents[1:]:
        view = views[agent]
        if view.observation_space != first.observation_space or view.action_space != first.action_space:
            differ = "observation" if view.observation_space != first.observation_space else "action"
            raise ConfigError(
                f"policy {name!r} acts for agents {agents[0]!r} and {agent!r}, whose {differ} spaces differ "
                f"({getattr(first, differ + '_space')} vs {getattr(view, differ + '_space')}): use "
                "multi_agent.mapping: per_agent, or a mapping of agent patterns to policies"
            )
    add_id = config.multi_agent.agent_id_input and len(agents) > 1
    spec, low, high = first.spec, first.low, first.high
    if add_id:
        if spec.is_image:
            raise ConfigError("multi_agent.agent_id_input needs vector observations; this policy's are images")
        count = len(agents)
        spec = dataclasses.replace(
            spec, frame_shape=(spec.frame_shape[0] + count,), frame_bound=(*spec.frame_bound, *([1.0] * count))
        )
        low, high = np.concatenate([low, np.zeros(count)]), np.concatenate([high, np.ones(count)])
    if first.masked:
        spec = dataclasses.replace(spec, action_masked=True)
    return PolicySpec(name, tuple(agents), spec, low, high, add_id, first.masked)


def check_env(config: Config) -> EnvSpec | MultiAgentSpec:
    """The spec of config's environment, a Gymnasium or a PettingZoo one: what every command
    makes first, so that a wrong id or space is one line before any process starts."""
    from apex.envs.make import env_spec
    from apex.envs.multi_agent import is_multi_agent

    if not is_multi_agent(config.env):
        return env_spec(config.env, config.algo)
    return multi_agent_spec(config)
