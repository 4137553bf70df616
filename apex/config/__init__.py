"""One typed configuration tree: YAML in, dataclasses out, ``--set a.b=c`` overrides.

The defaults are the embedded CartPole Ape-X run (``apex run`` with no ``--config``), and
``configs/cartpole_apex.yaml`` spells the same values out. Loading collects every problem
(unknown keys with the nearest valid one, wrong types, values out of range) and raises one
ConfigError that lists them all.
"""

from apex.config.loading import RETIRED_KEYS, from_dict, load, load_dict, read_yaml
from apex.config.presets import annotated_yaml, describe_preset, presets, setting_docs
from apex.config.sections import (
    ATARI_PREFIX,
    DEFAULT_PORT,
    MAX_ENVS_PER_ACTOR,
    ActorConfig,
    Config,
    EnvConfig,
    ImpalaConfig,
    LearnerConfig,
    ModelConfig,
    ReplayConfig,
    StopConditions,
    TransportConfig,
    port_problem,
    wrapper_problem,
)
from apex.core import ALGOS
from apex.errors import ConfigError

__all__ = [
    "ALGOS",
    "ATARI_PREFIX",
    "DEFAULT_PORT",
    "MAX_ENVS_PER_ACTOR",
    "RETIRED_KEYS",
    "ActorConfig",
    "Config",
    "ConfigError",
    "EnvConfig",
    "ImpalaConfig",
    "LearnerConfig",
    "ModelConfig",
    "ReplayConfig",
    "StopConditions",
    "TransportConfig",
    "annotated_yaml",
    "describe_preset",
    "from_dict",
    "load",
    "load_dict",
    "port_problem",
    "presets",
    "read_yaml",
    "setting_docs",
    "wrapper_problem",
]
