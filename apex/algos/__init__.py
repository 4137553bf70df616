"""Algorithms: each has a learner core (``apex.algos.<algo>``: ``Learner``, which imports
torch) and an actor core (``apex.algos.<algo>_actor``: ``Actor``, NumPy only for vector
observations) behind the same small interface, so one actor process and one learner process
serve them all."""

from __future__ import annotations

import importlib
from types import ModuleType


def get(algo: str) -> ModuleType:
    """The learner side of ``algo`` (``apex_dqn`` or ``impala``)."""
    return importlib.import_module(f"apex.algos.{algo}")


def actor_module(algo: str) -> ModuleType:
    """The actor side of ``algo``: its module's ``Actor`` steps the environments."""
    return importlib.import_module(f"apex.algos.{algo}_actor")
