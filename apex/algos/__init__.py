"""Algorithms behind one declared seam: each has a learner core (``ApexDqnLearner``, which imports
torch), an actor core (``ApexDqnActor``, NumPy only for vector observations), an episode actor for
`apex serve` (``ApexDqnEpisodeActor``) and the policy that `apex eval` and ``apex.load_policy`` act
with. The process shells (``apex.learner.process``, ``apex.actor.process``,
``apex.serve.server``, ``apex.run.evaluation``) call only what the protocols of ``apex.core``
declare, and find each part through ``REGISTRY``, which imports a side only when it is asked
for (an actor never imports its learner's torch). ``REGISTRY`` is built from the table of
``apex.core.facts``: each row's package gives ``learner_side()`` and ``actor_side()``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

from apex.core import FACTS, ActorSide, AlgorithmFacts, LearnerSide


@dataclass(frozen=True)
class Algorithm:
    facts: AlgorithmFacts
    learner: Callable[[], LearnerSide]  # imports torch
    actor: Callable[[], ActorSide]  # NumPy only (torch for image observations)


def _registered(row: AlgorithmFacts) -> Algorithm:
    # The package is named by apex's own table, never by a config: importing it imports no
    # torch (its sides import their modules when asked for), and each side is made once a
    # process (evaluation asks for a policy every batch).
    package = importlib.import_module(row.package_name)
    return Algorithm(row, functools.cache(package.learner_side), functools.cache(package.actor_side))


REGISTRY: dict[str, Algorithm] = {name: _registered(row) for name, row in FACTS.items()}


def get(algo: str) -> Algorithm:
    """The registered algorithm ``algo`` (config validation has named the choices)."""
    try:
        return REGISTRY[algo]
    except KeyError:
        raise ValueError(f"unknown algorithm {algo!r}: one of {', '.join(REGISTRY)}") from None
