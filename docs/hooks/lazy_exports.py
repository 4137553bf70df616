"""A griffe extension (mkdocs.yml, mkdocstrings' python handler): the names ``apex`` exports
lazily (its ``_API`` table, resolved by a module ``__getattr__`` on first use) become aliases,
so that the API page documents them as ``apex.train`` and so on, wherever the table says they
live. Static analysis alone cannot see them: nothing in ``apex/__init__.py`` imports them."""

from __future__ import annotations

import ast
from typing import Any

import griffe


def _lazy_table(source: str) -> dict[str, str]:
    """``_API`` (name -> module) as written in apex/__init__.py, with or without an annotation."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(target, ast.Name) and target.id == "_API" for target in targets):
            return dict(ast.literal_eval(value))
    raise RuntimeError("apex/__init__.py has no _API table of lazy exports")


class LazyExports(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "apex" or pkg.filepath is None or isinstance(pkg.filepath, list):
            return
        for name, module in _lazy_table(pkg.filepath.read_text()).items():
            if name not in pkg.members:
                pkg.set_member(name, griffe.Alias(name, f"{module}.{name}", parent=pkg))
