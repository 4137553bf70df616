"""MkDocs hook: the configuration reference is written from the config's own docstrings.

``docs/configuration.md`` holds two placeholders, filled when the page is built:

- ``<!-- presets -->``: the shipped presets (``apex config list``), each with the first line
  of its header comment;
- ``<!-- config-reference -->``: every setting of ``apex.config.Config``, section by section,
  with its type, its default (the embedded CartPole Ape-X run) and the docstring written
  under the field (what ``apex config show`` prints above it).

Only ``apex.config`` is imported. A setting without a docstring, or a placeholder missing
from the page, is logged as a warning, which fails ``mkdocs build --strict``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

import yaml

from apex.config import Config, describe_preset, presets, setting_docs

log = logging.getLogger("mkdocs.hooks.config_reference")

PAGE = "configuration.md"
PRESETS = "<!-- presets -->"
REFERENCE = "<!-- config-reference -->"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    for placeholder in (PRESETS, REFERENCE):
        if placeholder not in markdown:
            log.warning("%s has no %s placeholder: the configuration reference is incomplete", PAGE, placeholder)
    return markdown.replace(PRESETS, presets_table()).replace(REFERENCE, reference())


def presets_table() -> str:
    rows = ["| preset | what it is |", "|---|---|"]
    for name, preset in presets().items():
        rows.append(f"| `{name}` | {cell(describe_preset(preset))} |")
    if len(rows) == 2:
        log.warning("no shipped presets found (apex.config.presets())")
    return "\n".join(rows)


def reference() -> str:
    docs = setting_docs()
    default = Config()
    top = [f for f in dataclasses.fields(default) if not dataclasses.is_dataclass(getattr(default, f.name))]
    out = ["### Top level", "", *table(default, "", top, docs)]
    for f in dataclasses.fields(default):
        if dataclasses.is_dataclass(value := getattr(default, f.name)):
            out += section(value, f.name, docs)
    return "\n".join(out)


def section(value: Any, name: str, docs: dict[tuple[str, str], str]) -> list[str]:
    """A section's table, then those of the sections inside it (``apex_dqn.replay``)."""
    out = ["", f"### `{name}`", ""]
    intro = class_doc(type(value))
    if intro:
        out += [intro, ""]
    fields = dataclasses.fields(value)
    out += table(value, f"{name}.", [f for f in fields if not dataclasses.is_dataclass(getattr(value, f.name))], docs)
    for f in fields:
        if dataclasses.is_dataclass(inner := getattr(value, f.name)):
            out += section(inner, f"{name}.{f.name}", docs)
    return out


def table(obj: Any, prefix: str, fields: Any, docs: dict[tuple[str, str], str]) -> list[str]:
    rows = ["| setting | type | default | meaning |", "|---|---|---|---|"]
    for f in fields:
        key = prefix + f.name
        doc = docs.get((type(obj).__name__, f.name))
        if not doc:
            log.warning("config setting %s has no docstring in apex.config: the reference cannot describe it", key)
            doc = ""
        value = dump(getattr(obj, f.name))
        rows.append(f'| <a id="{key}"></a>`{key}` | `{type_name(f.type)}` | `{value}` | {cell(doc)} |')
    return rows


def class_doc(cls: type) -> str:
    doc = cls.__doc__ or ""
    # A dataclass without a docstring gets a generated one: its signature, not a description.
    if not doc or doc.startswith(cls.__name__ + "("):
        return ""
    return " ".join(doc.split())


def type_name(annotation: Any) -> str:
    return annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))


def dump(value: Any) -> str:
    """A value as it is written in YAML (``--set`` parses values as YAML)."""
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def cell(text: str) -> str:
    """Docstring text for a table cell: RST double backticks as code, no bare pipes."""
    text = re.sub(r"``(.+?)``", r"`\1`", " ".join(text.split()))
    parts = text.split("`")
    return "`".join(part if i % 2 else part.replace("|", "&#124;") for i, part in enumerate(parts))
