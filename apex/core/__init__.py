"""The seam: the protocols every algorithm's learner and actor cores satisfy, and the names of
the algorithms. Imports nothing else of apex at run time (annotations only)."""

from apex.core.protocols import (
    ActorCore,
    ActorSide,
    EpisodeActorCore,
    EpisodeRecord,
    LearnerCore,
    LearnerSide,
    Policy,
    TrainingCore,
)

# The names `algo` takes; apex.algos.REGISTRY maps each to its implementation.
ALGOS = ("apex_dqn", "impala")

__all__ = [
    "ALGOS",
    "ActorCore",
    "ActorSide",
    "EpisodeActorCore",
    "EpisodeRecord",
    "LearnerCore",
    "LearnerSide",
    "Policy",
    "TrainingCore",
]
