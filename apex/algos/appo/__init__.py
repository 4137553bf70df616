"""APPO: asynchronous PPO on IMPALA's architecture (``learner``, ``loss``).

``learner_side()`` (imports torch) and ``actor_side()`` (NumPy only for vector observations)
are what ``apex.algos.REGISTRY`` finds here (``apex.core.facts``).
"""

from __future__ import annotations

from apex.core import ActorSide, LearnerSide


def learner_side() -> LearnerSide:
    from apex.algos.appo import learner

    return LearnerSide(learner.AppoLearner, learner.POLICY)


def actor_side() -> ActorSide:
    # APPO's actors are IMPALA's: the same unrolls, behaviour log-probabilities and policies.
    from apex.algos import impala

    return impala.actor_side()
