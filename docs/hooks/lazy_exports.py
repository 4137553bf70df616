"""A griffe extension: the names ``apex`` exports lazily (its ``_API`` table, resolved by a
module ``__getattr__`` on first use) become aliases that the API page can document as
``apex.train`` and so on, wherever the table says they live."""

from __future__ import annotations

import ast
from typing import Any

import griffe


class LazyExports(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "apex" or pkg.filepath is None:
            return
        tree = ast.parse(pkg.filepath.read_text())
        for node in tree.body:
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "_API"):
                table = ast.literal_eval(node.value)
                break
        else:
            raise RuntimeError("apex/__init__.py has no _API table of lazy exports")
        for name, module in table.items():
            if name not in pkg.members:
                pkg.set_member(name, griffe.Alias(name, f"{module}.{name}", parent=pkg))
