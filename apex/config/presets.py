"""The shipped presets (configs/*.yaml, installed as apex.configs) and the annotated YAML of
`apex config show`, its comments from the settings' docstrings."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from apex.config import algorithms, apex_ddpg, multi_agent, network, sections
from apex.config.sections import Config
from apex.core import ALGO_SECTIONS, ALGOS

if TYPE_CHECKING:
    from importlib.abc import Traversable


def presets() -> dict[str, Traversable]:
    """The shipped presets (configs/*.yaml, installed as apex.configs): name -> file."""
    from importlib.resources import files

    try:
        folder = files("apex.configs")
    except ModuleNotFoundError:  # apex imported from a source tree (PYTHONPATH), not installed
        folder = Path(__file__).resolve().parents[2] / "configs"  # the checkout's configs/, beside apex/
    return (
        {f.name[: -len(".yaml")]: f for f in sorted(folder.iterdir(), key=lambda f: f.name) if f.name.endswith(".yaml")}
        if folder.is_dir()
        else {}
    )


def describe_preset(preset: Traversable) -> str:
    """A preset's first header comment line (what it is), without the '#'."""
    for line in preset.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def setting_docs() -> dict[tuple[str, str], str]:
    """(class name, field) -> the docstring written under that field in the config's modules."""
    import ast
    import inspect

    docs = {}
    modules = (sections, algorithms, apex_ddpg, network, multi_agent)
    nodes = [node for module in modules for node in ast.parse(inspect.getsource(module)).body]
    for node in nodes:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for field_node, doc in itertools.pairwise(body):
            if (
                isinstance(field_node, ast.AnnAssign)
                and isinstance(field_node.target, ast.Name)
                and isinstance(doc, ast.Expr)
                and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)
            ):
                docs[(node.name, field_node.target.id)] = " ".join(doc.value.value.split())
    return docs


def annotated_yaml(config: Config) -> str:
    """The config as YAML that ``load`` reads back, each setting preceded by its docstring."""
    docs = setting_docs()
    lines: list[str] = []

    def emit(obj: Any, indent: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            doc = docs.get((type(obj).__name__, f.name))
            if dataclasses.is_dataclass(value):
                lines.append(f"{indent}{f.name}:")
                emit(value, indent + "  ")
                continue
            if doc:
                lines.extend(f"{indent}# {part}" for part in _wrap(doc, 96 - len(indent)))
            dumped = yaml.safe_dump({f.name: value}, default_flow_style=True, sort_keys=False).strip()
            lines.append(f"{indent}{dumped.removeprefix('{').removesuffix('}')}")

    emit(config, "")
    return "\n".join(lines) + "\n"


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, max(40, width))


def tuned_settings(config: Config) -> dict[str, Any]:
    """The settings (dotted key -> value) in which ``config`` differs from what ``--algo``
    and ``--env`` alone give for its algorithm and environment: what a preset tunes for its
    task. The sections of the other algorithms, and the seed, are left out."""
    plain = Config(algo=config.algo, env=dataclasses.replace(Config().env, id=config.env.id))
    others = {section for name in ALGOS for section in ALGO_SECTIONS[name]} - set(ALGO_SECTIONS[config.algo])
    defaults = flatten_settings(plain.to_dict())
    return {
        key: value
        for key, value in flatten_settings(config.to_dict()).items()
        if key.split(".")[0] not in others and key != "seed" and defaults.get(key) != value
    }


def flatten_settings(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A config's nested dict by dotted key (``impala.lr``), as ``--set`` names them; a
    ``kwargs`` mapping stays one value."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and key not in ("kwargs",):
            flat.update(flatten_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
