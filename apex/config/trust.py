"""What a config that came from elsewhere may make this process import.

A config given on this machine (a YAML file, a preset, ``--set``, ``apex.train``'s argument)
is the user's own: every module it names is imported and every wrapper it names is called.
A config that arrives from elsewhere names code that someone else chose: the one saved in a
checkpoint (``apex eval``, ``apex.load_policy``, a resume without ``--config``) and the one in
a learner's welcome (``apex actor``, ``apex serve``; without CURVE anyone who takes the
learner's address can send one). Importing a module runs its code, and a wrapper is a
callable that is then called (``pydoc.pipepager`` runs a shell command), so such a config may
import only what this side allows: ``--allow-import MODULE``, ``env.allow_imports`` of the
local config (and what that config names itself), or ``APEX_ALLOW_IMPORTS``
(comma-separated). Allowing a package allows its submodules. Gymnasium ids from installed
packages (``CartPole-v1``, ``ALE/Pong-v5``, a plugin's ``MinAtar/Breakout-v1``) import nothing
named by the config and need no allowance.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Iterable
from typing import Any

from apex.config.loading import load_dict
from apex.config.sections import Config, EnvConfig
from apex.errors import ConfigError

ALLOW_IMPORTS_ENV = "APEX_ALLOW_IMPORTS"
PETTINGZOO_FAMILY = re.compile(r"pettingzoo\.(atari|butterfly|classic|mpe|sisl)|mpe2")
PETTINGZOO_ENV = re.compile(r"[a-z][a-z0-9_]*_v[0-9]+")


def split_path(path: str) -> tuple[str, str]:
    """(module, attribute) of a dotted path to an object: ``pkg.mod:Name.attr`` or
    ``pkg.mod.Name`` (the last dotted part is the attribute)."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    return module, attr


def named_modules(env: EnvConfig, mapping_function: str | None = None) -> list[tuple[str, str]]:
    """(the key that names it, the module) for every module that making ``env``'s
    environments imports because the config says so, in the order they are imported, and
    the module of a multi_agent.mapping function."""
    named = [(f"env.imports[{i}]", module) for i, module in enumerate(env.imports)]
    if ":" in env.id and not is_pettingzoo_env_id(env.id):
        named.append(("env.id", env.id.partition(":")[0]))
    for i, item in enumerate(env.wrappers):
        path = item if isinstance(item, str) else item.get("type", "") if isinstance(item, dict) else ""
        named.append((f"env.wrappers[{i}] {path!r}", split_path(path)[0]))
    if mapping_function is not None:
        named.append(("multi_agent.mapping", split_path(mapping_function)[0]))
    return named


def is_pettingzoo_env_id(env_id: str) -> bool:
    """Whether ``env_id`` names one of PettingZoo's own environments (``pettingzoo.classic:
    tictactoe_v3``, or Farama's MPE package's, ``mpe2:simple_spread_v3``): a module of the
    installed package whose ``env()``/``parallel_env()`` are all that is called, so it needs
    no allowance, like a Gymnasium id."""
    module, _, name = env_id.partition(":")
    return bool(PETTINGZOO_FAMILY.fullmatch(module) and PETTINGZOO_ENV.fullmatch(name))


def is_allowed(module: str, allowed: Collection[str]) -> bool:
    """Whether ``module`` is allowed: named itself, or one of the packages it is in."""
    parts = module.split(".")
    return any(".".join(parts[:n]) in allowed for n in range(1, len(parts) + 1))


def allowed_imports(
    flags: Iterable[str] = (), local: EnvConfig | None = None, local_mapping: str | None = None
) -> tuple[str, ...]:
    """What this side allows a config from elsewhere to import: ``--allow-import`` flags,
    ``APEX_ALLOW_IMPORTS``, and the local config's env.allow_imports and the modules it names
    itself (it is this side's own: `apex run` hands its actors the run's config file); never
    what the config from elsewhere says (that is the other side's word)."""
    given = [
        *((name, "--allow-import") for name in flags),
        *((name, ALLOW_IMPORTS_ENV) for name in os.environ.get(ALLOW_IMPORTS_ENV, "").split(",")),
        *((name, "env.allow_imports") for name in (local.allow_imports if local else ())),
    ]
    names = []
    for name, where in given:
        name = name.strip()
        if name and not all(part.isidentifier() for part in name.split(".")):
            raise ConfigError(f"{where} {name!r} is not a module name (give one such as mypackage.envs)")
        if name:
            names.append(name)
    names += [module for _, module in (named_modules(local, local_mapping) if local else ())]
    return tuple(dict.fromkeys(names))


def check_imports(env: EnvConfig, allowed: Collection[str], source: str, mapping_function: str | None = None) -> None:
    """ConfigError (one line) naming the first module that ``env`` (and the multi_agent
    mapping function), a config from ``source``, would import and that ``allowed`` does not
    allow."""
    for key, module in named_modules(env, mapping_function):
        if not is_allowed(module, allowed):
            raise ConfigError(
                f"{source} names module {module!r} ({key}), which this side does not allow to import: importing it "
                f"would run its code; if you trust it, pass --allow-import {module or '?'} (or env.allow_imports in "
                f"the local config, or {ALLOW_IMPORTS_ENV}={module or '?'})"
            )


def from_elsewhere(
    raw: Any, allowed: Collection[str], source: str, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """The validated Config of ``raw`` (nested dicts from a checkpoint or a welcome, then the
    local ``overrides``), refused with a ConfigError if it would import what ``allowed`` does
    not allow (``source`` names where it came from, for the message)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} holds no config mapping (got {type(raw).__name__})")
    config = load_dict(raw, overrides)
    check_imports(config.env, allowed, source, config.multi_agent.mapping_function)
    return config
