"""The seam: the protocols every algorithm's learner and actor cores satisfy, and the table of
the algorithms (``apex.core.facts``). Imports nothing else of apex at run time (annotations only)."""

from apex.core.facts import ALGO_ACTIONS, ALGO_SECTIONS, ALGOS, FACTS, AlgorithmFacts
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

__all__ = [
    "ALGOS",
    "ALGO_ACTIONS",
    "ALGO_SECTIONS",
    "FACTS",
    "ActorCore",
    "ActorSide",
    "AlgorithmFacts",
    "EpisodeActorCore",
    "EpisodeRecord",
    "LearnerCore",
    "LearnerSide",
    "Policy",
    "TrainingCore",
]
