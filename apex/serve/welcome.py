"""What `apex serve` makes of its learner's welcome: the open episodes its clients play, on
the algorithm's episode core (``ExternalEpisodes``), or for a multi-agent run each policy's
core behind ``ExternalTeams``, as an actor makes its environments."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from apex.config import Config
from apex.errors import ApexError, ProtocolError
from apex.serve.episodes import ExternalEpisodes
from apex.serve.teams import ExternalTeams

if TYPE_CHECKING:
    from apex.core import ActorSide

__all__ = ["external_episodes", "external_teams"]


def external_episodes(
    config: Config,
    setup: dict[str, Any],
    side: ActorSide,
    max_episodes: int,
    episode_timeout_s: float,
    max_per_client: int,
) -> ExternalEpisodes:
    """A single-agent run's episodes, on the algorithm's episode core."""
    from apex.envs.make import env_spaces  # gymnasium and the env's modules

    spec, low, high = env_spaces(config.env, config.algo)
    return ExternalEpisodes(
        config,
        spec,
        low,
        high,
        side.episode_core(config, setup, spec, setup["seed"]),
        max_episodes=max_episodes,
        episode_timeout_s=episode_timeout_s,
        max_per_client=max_per_client,
    )


def external_teams(
    config: Config,
    setup: dict[str, Any],
    side: ActorSide,
    max_episodes: int,
    episode_timeout_s: float,
    max_per_client: int,
) -> ExternalTeams:
    """A multi-agent run's episodes: each policy's episode core, for its agents of
    setup.num_envs teams (the Ape-X ladder's rungs by team, as MultiAgentActor has them)."""
    from apex.envs.policy_map import multi_agent_spec
    from apex.multiagent.actor import POLICY_SEED_FACTOR, per_agent_setup, setup_problem

    if config.multi_agent.self_play.enabled:
        raise ApexError(
            "apex serve does not play self-play runs (multi_agent.self_play): its opponents are drawn "
            "by the actors of apex run; serve a run without self-play"
        )
    spec = multi_agent_spec(config)
    if (problem := setup_problem(setup, spec, side.setup_problem)) is not None:
        raise ProtocolError(f"the welcome's setup is malformed: {problem}")
    k = setup["num_envs"]
    cores = {
        name: side.episode_core(
            config,
            {
                **setup,
                **per_agent_setup(setup["policies"][name], k, len(policy.agents)),
                "num_envs": k * len(policy.agents),
            },
            policy.spec,
            setup["seed"] + POLICY_SEED_FACTOR * (1 + sum(map(ord, name))),
        )
        for name, policy in spec.policies.items()
    }
    first = setup["policies"][next(iter(spec.policies))]
    return ExternalTeams(
        config,
        spec,
        cores,
        max_episodes=max_episodes,
        episode_timeout_s=episode_timeout_s,
        max_per_client=max_per_client,
        eval_slots=[bool(e) for e in first["eval_envs"]] if "eval_envs" in first else None,
    )
