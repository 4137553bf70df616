"""apex: distributed reinforcement learning (Ape-X DQN, IMPALA) over ZeroMQ.

The Python API (docs/environments.md, "Python API"): ``apex.train``, ``apex.load_config``,
``apex.load_policy``, ``apex.evaluate``, ``RunResult``, ``Policy``, ``Config``. They are
imported on first use, so that ``import apex`` (and ``apex --help``) stays light.
"""

from typing import Any

__version__ = "0.1.0"

_API = {
    "train": "apex.api",
    "load_config": "apex.api",
    "load_policy": "apex.api",
    "evaluate": "apex.api",
    "RunResult": "apex.api",
    "Policy": "apex.api",
    "Config": "apex.config",
}
__all__ = [
    "Config",
    "Policy",
    "RunResult",
    "__version__",
    "evaluate",
    "load_config",
    "load_policy",
    "train",
]  # _API's names


def __getattr__(name: str) -> Any:
    if name in _API:
        import importlib

        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'apex' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
