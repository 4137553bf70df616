"""Ape-X DQN (Horgan et al. 2018): the learner core, the actor core and its exploration ladder.

``learner_side()`` (imports torch) and ``actor_side()`` (NumPy only for vector observations)
are what ``apex.algos.REGISTRY`` finds here (``apex.core.facts``).
"""

from __future__ import annotations

from apex.core import ActorSide, LearnerSide


def learner_side() -> LearnerSide:
    from apex.algos.apex_dqn import learner

    return LearnerSide(learner.ApexDqnLearner, learner.POLICY)


def actor_side() -> ActorSide:
    from apex.algos.apex_dqn import actor

    return ActorSide(actor.ApexDqnActor, actor.ApexDqnEpisodeActor, actor.setup_problem)
