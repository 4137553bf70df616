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
ALGOS = ("apex_dqn", "impala", "appo", "apex_ddpg")
# The config sections each algorithm reads: APPO is IMPALA's architecture (its unrolls, queue,
# optimizer and V-trace in `impala`) with PPO's surrogate (`appo`).
ALGO_SECTIONS = {
    "apex_dqn": ("apex_dqn",),
    "impala": ("impala",),
    "appo": ("impala", "appo"),
    "apex_ddpg": ("apex_ddpg",),
}

__all__ = [
    "ALGOS",
    "ALGO_SECTIONS",
    "ActorCore",
    "ActorSide",
    "EpisodeActorCore",
    "EpisodeRecord",
    "LearnerCore",
    "LearnerSide",
    "Policy",
    "TrainingCore",
]
