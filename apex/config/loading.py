"""YAML in, a validated Config out: files and presets by name, ``--set a.b=c`` overrides,
every problem collected into one ConfigError (unknown keys with the nearest valid one)."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import logging
import math
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

from apex.config.migration import drop_retired, final_algo, move_older_keys, newer_key
from apex.config.presets import presets, tuned_settings
from apex.config.sections import Config
from apex.core import ALGOS
from apex.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

log = logging.getLogger("apex.config")
T = TypeVar("T", bound="DataclassInstance")

MAX_YAML_VALUES = 100_000  # what a config's YAML may expand to, aliases followed: a 510-byte alias bomb makes 10**9
MAX_INT = 2**53  # past it a config's integer is no count nor size (and JSON's doubles no longer hold it exactly)


class _HugeInt:
    """An integer literal past Python's 4,300 digits (int() refuses it): kept as its length,
    for the one-line error that names its key."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


class _Loader(yaml.SafeLoader):
    pass


def _construct_yaml_int(loader: _Loader, node: yaml.ScalarNode) -> int | _HugeInt:
    try:
        return yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError:
        return _HugeInt(len(node.value))


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_yaml_int)


def parse_yaml(text: str, source: str) -> Any:
    """``yaml.safe_load`` of a config's text, refusing (ConfigError, one line) what would
    expand past MAX_YAML_VALUES values or into itself through aliases, and nesting past
    Python's recursion limit; integers past int()'s digits come back as _HugeInt."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source} is not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ConfigError(f"{source} is nested too deep to be a config") from None
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node, source: str) -> None:
    """Counts the values ``root`` holds with every alias followed (each node once: the
    count of a shared one is reused), without building them."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()  # the nodes whose values are being counted: an alias to one is a loop
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, counted = stack.pop()
        children = (
            [v for pair in node.value for v in pair]
            if isinstance(node, yaml.MappingNode)
            else node.value
            if isinstance(node, yaml.SequenceNode)
            else []
        )
        if counted:
            sizes[id(node)] = min(MAX_YAML_VALUES + 1, 1 + sum(sizes[id(c)] for c in children))
            open_nodes.discard(id(node))
            if sizes[id(node)] > MAX_YAML_VALUES:
                raise ConfigError(
                    f"{source}: its YAML aliases expand it past {MAX_YAML_VALUES} values (an alias "
                    "bomb?): write the values out, or use fewer aliases"
                )
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            raise ConfigError(f"{source}: a YAML alias refers to a value that holds it (a loop): write the values out")
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if id(c) not in sizes)


def read_yaml(path: str | Path) -> tuple[str, dict[str, Any]]:
    """(where it came from, its sections) for a YAML file or a preset's name (``pong_apex``,
    with or without ``.yaml``); a file at that path wins over a preset."""
    name = str(path)
    if Path(path).is_file():
        source, text = str(path), Path(path).read_text()
    else:
        found = presets().get(name.removesuffix(".yaml")) if "/" not in name else None
        if found is None:
            raise ConfigError(
                f"config {name} not found: pass a YAML file or a preset name "
                f"({', '.join(presets())}; `apex config list`)"
            )
        source, text = f"preset {found.name}", found.read_text()
        if Path(f"{name}.yaml").is_file():
            log.warning("--config %s is the shipped preset; to read ./%s.yaml instead, pass it with .yaml", name, name)
    raw = parse_yaml(text, source) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source} must hold a mapping of sections, got {type(raw).__name__}")
    return source, raw


def load(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Reads a YAML file or a preset by name (or the defaults when ``path`` is None), applies
    ``key=value`` overrides (values parsed as YAML), validates, and returns the Config. A
    preset run on another environment than its own is warned about (its tuning is its task's)."""
    if path is None:
        return load_dict({}, overrides)
    source, raw = read_yaml(path)
    config = load_dict(raw, overrides)
    if source.startswith("preset ") and isinstance(raw.get("env"), dict) and raw["env"].get("id") != config.env.id:
        tuned = {k: v for k, v in tuned_settings(load_dict(raw)).items() if not k.startswith("env.id")}
        log.warning(
            "%s is tuned for %s (%s); on %s those may not fit: --algo %s --env %s alone gives %s's own defaults",
            source,
            raw["env"].get("id"),
            ", ".join(f"{k}={v}" for k, v in tuned.items()) or "nothing but its environment",
            config.env.id,
            config.algo,
            config.env.id,
            config.algo,
        )
    return config


def load_dict(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Like ``load``, from nested dicts (e.g. the config saved in a checkpoint)."""
    raw = copy.deepcopy(raw)
    algo = final_algo(raw, overrides)
    moved: list[str] = []
    raw = move_older_keys(raw, algo, moved)  # first, so that an override of either name wins
    for override in overrides:
        key, sep, text = override.partition("=")
        _apply_override(raw, f"{newer_key(key.strip(), algo, moved)}{sep}{text}" if sep else override)
    return _build_config(raw, moved)


def from_dict(raw: dict[str, Any]) -> Config:
    """Builds a validated Config from nested dicts (unknown keys are errors; the keys of an
    older config are read under their new names, with a warning)."""
    return _build_config(raw, [])


def _build_config(raw: Any, moved: list[str]) -> Config:
    algo = raw.get("algo") if isinstance(raw, dict) else None
    raw = move_older_keys(raw, algo if isinstance(algo, str) and algo in ALGOS else "apex_dqn", moved)
    if moved:
        log.warning(
            "settings under their older names, read as the new ones (write these to silence this): %s",
            ", ".join(dict.fromkeys(moved)),
        )
    raw = drop_retired(raw)
    problems: list[str] = []
    config = _build(Config, raw, "", problems)
    if len(problems) == 1:
        raise ConfigError(f"invalid configuration: {problems[0]}")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    config.validate()
    return config


def _apply_override(raw: dict[str, Any], override: str) -> None:
    key, sep, text = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set expects key=value (e.g. env.id=Acrobot-v1), got {override!r}")
    shown = override if len(override) <= 80 else f"{override[:60]}... ({len(override)} characters)"
    value = parse_yaml(text, f"--set {shown!r}: the value") if text else ""
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {part} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _build(cls: type[T], raw: Any, prefix: str, problems: list[str], default: T | None = None) -> T:
    """``cls`` from ``raw``, its keys over ``default`` (the field's own default, where a
    section's defaults differ from its class's: apex_ddpg.replay), else over cls()."""
    if not isinstance(raw, dict):
        problems.append(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
        return default if default is not None else cls()
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean {prefix}{close[0]}?" if close else f"; valid keys: {', '.join(fields)}"
            problems.append(f"unknown key {name}{hint}")
            continue
        hint = hints[key]
        number = None if dataclasses.is_dataclass(hint) else _number_problem(value)
        if number is not None:
            problems.append(f"{name} {number}")
            continue
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # (a hint is a class, never an instance)
            factory = fields[key].default_factory
            own = factory() if factory is not dataclasses.MISSING else None
            kwargs[key] = _build(hint, value, f"{name}.", problems, own)
        else:
            converted, ok = _convert(value, hint)
            if ok:
                kwargs[key] = converted
            else:
                shown = repr(value)
                shown = shown if len(shown) <= 80 else f"{shown[:60]}... ({len(shown)} characters)"
                problems.append(f"{name} must be {_type_name(hint)}, got {shown}")
    return dataclasses.replace(default, **kwargs) if default is not None else cls(**kwargs)


def _number_problem(value: Any) -> str | None:
    """What is wrong with an integer in ``value`` (itself, or one it holds), or None: every
    integer of a config is within +-2**53."""
    stack, seen = [value], 0
    while stack and seen <= MAX_YAML_VALUES:  # from_dict may have anything: a bounded walk
        item = stack.pop()
        seen += 1
        if isinstance(item, _HugeInt) or (isinstance(item, int) and not isinstance(item, bool) and abs(item) > MAX_INT):
            shown = (
                item
                if isinstance(item, _HugeInt)
                else f"{item}"
                if abs(item) < 10**30
                else f"an integer of {len(str(abs(item)))} digits"
            )
            if item is value:
                return f"must be within -2**53..2**53, got {shown}"
            return f"holds an integer outside -2**53..2**53: {shown}"
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return None


def _convert(value: Any, hint: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            converted, ok = _convert(value, option)
            if ok:
                return converted, True
        return value, False
    if hint is type(None):
        return None, value is None
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            return value, False
        items = [_convert(v, item) for v in value]
        return [v for v, _ in items], all(ok for _, ok in items)
    if hint is bool:
        return value, isinstance(value, bool)
    if hint is int:
        return value, isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # finite: a rate, a size, a time (null where a key may mean "none")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value), math.isfinite(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                number = float(value)
            except ValueError:
                return value, False
            return number, math.isfinite(number)
        return value, False
    if hint is str:
        return value, isinstance(value, str)
    if origin is dict:
        ok = isinstance(value, dict) and all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
        return (dict(value) if ok else value), ok
    if hint is Any:
        return value, _is_plain(value)
    return value, False


def _is_plain(value: Any) -> bool:
    """Whether a value is plain data (what YAML, JSON and the handshake's msgpack all hold)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_is_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(hint)[0])}"
    if origin is dict:
        return "a mapping of names to plain values"
    if hint is Any:
        return "a plain value"
    if hint is type(None):
        return "null"
    return {int: "an integer", float: "a finite number", bool: "true or false", str: "a string"}.get(hint, str(hint))
