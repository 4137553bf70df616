"""Algorithms behind one declared seam: each has a learner core (``ApexDqnLearner``, which imports
torch), an actor core (``ApexDqnActor``, NumPy only for vector observations), an episode actor for
`apex serve` (``ApexDqnEpisodeActor``) and the policy that `apex eval` and ``apex.load_policy`` act
with. The process shells (``apex.learner.process``, ``apex.actor.process``,
``apex.serve.server``, ``apex.run.evaluation``) call only what the protocols of ``apex.core``
declare, and find each part through ``REGISTRY``, which imports a side only when it is asked
for (an actor never imports its learner's torch).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from apex.core import ActorSide, LearnerSide


@dataclass(frozen=True)
class Algorithm:
    name: str
    learner: Callable[[], LearnerSide]  # imports torch
    actor: Callable[[], ActorSide]  # NumPy only (torch for image observations, when they come)
    state_keys: tuple[str, ...]  # the state dicts its learner's checkpoints hold (checked before loading)


@functools.cache  # once a process: evaluation asks for a policy every batch
def _apex_dqn_learner() -> LearnerSide:
    from apex.algos.apex_dqn import learner as apex_dqn

    return LearnerSide(apex_dqn.ApexDqnLearner, apex_dqn.POLICY)


@functools.cache
def _apex_dqn_actor() -> ActorSide:
    from apex.algos.apex_dqn import actor as apex_dqn_actor

    return ActorSide(apex_dqn_actor.ApexDqnActor, apex_dqn_actor.ApexDqnEpisodeActor, apex_dqn_actor.setup_problem)


@functools.cache
def _impala_learner() -> LearnerSide:
    from apex.algos.impala import learner as impala

    return LearnerSide(impala.ImpalaLearner, impala.POLICY)


@functools.cache
def _impala_actor() -> ActorSide:
    from apex.algos.impala import actor as impala_actor
    from apex.algos.impala.episode_actor import ImpalaEpisodeActor

    return ActorSide(impala_actor.ImpalaActor, ImpalaEpisodeActor, impala_actor.setup_problem)


@functools.cache
def _appo_learner() -> LearnerSide:
    from apex.algos.appo import learner as appo

    return LearnerSide(appo.AppoLearner, appo.POLICY)


@functools.cache
def _apex_ddpg_learner() -> LearnerSide:
    from apex.algos.apex_ddpg import learner as apex_ddpg

    return LearnerSide(apex_ddpg.ApexDdpgLearner, apex_ddpg.POLICY)


@functools.cache
def _apex_ddpg_actor() -> ActorSide:
    from apex.algos.apex_ddpg import actor as apex_ddpg_actor

    return ActorSide(apex_ddpg_actor.ApexDdpgActor, apex_ddpg_actor.ApexDdpgEpisodeActor, apex_ddpg_actor.setup_problem)


REGISTRY: dict[str, Algorithm] = {
    "apex_dqn": Algorithm("apex_dqn", _apex_dqn_learner, _apex_dqn_actor, ("online", "target", "optimizer")),
    "impala": Algorithm("impala", _impala_learner, _impala_actor, ("net", "optimizer")),
    # APPO's actors are IMPALA's: the same unrolls, behaviour log-probabilities and policies.
    "appo": Algorithm("appo", _appo_learner, _impala_actor, ("net", "target", "optimizer")),
    "apex_ddpg": Algorithm(
        "apex_ddpg", _apex_ddpg_learner, _apex_ddpg_actor, ("online", "target", "policy", "optimizer")
    ),
}


def get(algo: str) -> Algorithm:
    """The registered algorithm ``algo`` (config validation has named the choices)."""
    try:
        return REGISTRY[algo]
    except KeyError:
        raise ValueError(f"unknown algorithm {algo!r}: one of {', '.join(REGISTRY)}") from None
