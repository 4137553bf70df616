"""Algorithms: each module provides ``Learner`` (the learner core) and ``Actor`` (the actor
core) behind the same small interface, so one actor process and one learner process
serve them all."""

from __future__ import annotations

import importlib
from types import ModuleType


def get(algo: str) -> ModuleType:
    """The module implementing ``algo`` (``apex_dqn`` or ``impala``)."""
    return importlib.import_module(f"apex.algos.{algo}")
