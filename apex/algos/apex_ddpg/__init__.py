"""Ape-X DDPG (Horgan et al. 2018's Ape-X DPG with TD3's fixes, Fujimoto et al. 2018): the
noise ladder (``exploration``), the actor core (``actor``), the loss (``loss``) and the
learner core (``learner``).

``learner_side()`` (imports torch) and ``actor_side()`` (NumPy only for vector observations)
are what ``apex.algos.REGISTRY`` finds here (``apex.core.facts``).
"""

from __future__ import annotations

from apex.core import ActorSide, LearnerSide


def learner_side() -> LearnerSide:
    from apex.algos.apex_ddpg import learner

    return LearnerSide(learner.ApexDdpgLearner, learner.POLICY)


def actor_side() -> ActorSide:
    from apex.algos.apex_ddpg import actor

    return ActorSide(actor.ApexDdpgActor, actor.ApexDdpgEpisodeActor, actor.setup_problem)
