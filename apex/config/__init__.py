"""One typed configuration tree: YAML in, dataclasses out, ``--set a.b=c`` overrides.

The defaults are the embedded CartPole Ape-X run (``apex run`` with no ``--config``), and
``configs/cartpole_apex.yaml`` spells the same values out. Loading collects every problem
(unknown keys with the nearest valid one, wrong types, values out of range) and raises one
ConfigError that lists them all.
"""

from apex.config.algorithms import AlgoConfig, ApexDqnConfig, AppoConfig, ImpalaConfig, ReplayConfig
from apex.config.apex_ddpg import ApexDdpgConfig
from apex.config.loading import (
    from_dict,
    load,
    load_dict,
    read_yaml,
)
from apex.config.migration import MOVED_KEYS, MOVED_SECTIONS, RETIRED_KEYS
from apex.config.network import DEFAULT_PORT, ServeConfig, TransportConfig, port_problem
from apex.config.presets import (
    annotated_yaml,
    describe_preset,
    flatten_settings,
    presets,
    setting_docs,
    tuned_settings,
)
from apex.config.sections import (
    ATARI_PREFIX,
    MAX_ENVS_PER_ACTOR,
    ActorConfig,
    Config,
    EnvConfig,
    LearnerConfig,
    ModelConfig,
    StopConditions,
    wrapper_problem,
)
from apex.core import ALGOS
from apex.errors import ConfigError

__all__ = [
    "ALGOS",
    "ATARI_PREFIX",
    "DEFAULT_PORT",
    "MAX_ENVS_PER_ACTOR",
    "MOVED_KEYS",
    "MOVED_SECTIONS",
    "RETIRED_KEYS",
    "ActorConfig",
    "AlgoConfig",
    "ApexDdpgConfig",
    "ApexDqnConfig",
    "AppoConfig",
    "Config",
    "ConfigError",
    "EnvConfig",
    "ImpalaConfig",
    "LearnerConfig",
    "ModelConfig",
    "ReplayConfig",
    "ServeConfig",
    "StopConditions",
    "TransportConfig",
    "annotated_yaml",
    "describe_preset",
    "flatten_settings",
    "from_dict",
    "load",
    "load_dict",
    "port_problem",
    "presets",
    "read_yaml",
    "setting_docs",
    "tuned_settings",
    "wrapper_problem",
]
