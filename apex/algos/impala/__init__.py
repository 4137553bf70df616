"""IMPALA (Espeholt et al. 2018): the learner core (V-trace) and the actor core (unrolls).

``learner_side()`` (imports torch) and ``actor_side()`` (NumPy only for vector observations)
are what ``apex.algos.REGISTRY`` finds here (``apex.core.facts``).
"""

from __future__ import annotations

from apex.core import ActorSide, LearnerSide


def learner_side() -> LearnerSide:
    from apex.algos.impala import learner

    return LearnerSide(learner.ImpalaLearner, learner.POLICY)


def actor_side() -> ActorSide:
    from apex.algos.impala import actor
    from apex.algos.impala.episode_actor import ImpalaEpisodeActor

    return ActorSide(actor.ImpalaActor, ImpalaEpisodeActor, actor.setup_problem)
