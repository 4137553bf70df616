"""The package's shape: packages by role, no import cycle, the seam and the registry agree.

lint-imports (run by .ci/run and pre-commit) checks the layers of pyproject.toml; these check
what a layers contract does not say."""

from __future__ import annotations

from pathlib import Path

import grimp

import apex
from apex import algos, core

PACKAGE = Path(apex.__file__).parent


def import_graph() -> grimp.ImportGraph:
    # Lazy imports (inside functions) count: a cycle through one breaks as surely, only later.
    return grimp.build_graph("apex", exclude_type_checking_imports=True)


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    cycles = []
    for module in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(module):
            if graph.chain_exists(importer=imported, imported=module):
                cycles.append((*graph.find_shortest_chain(importer=imported, imported=module), imported))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_at_most_ten_modules_sit_directly_in_the_package():
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert len(modules) <= 10, modules


def test_the_seam_imports_nothing_else_of_apex_at_run_time():
    graph = import_graph()
    imported = {
        m
        for module in graph.find_children("apex.core") | {"apex.core"}
        for m in graph.find_modules_directly_imported_by(module)
    }
    assert {m for m in imported if not m.startswith("apex.core")} == set()


def test_every_algorithm_named_by_the_seam_is_registered_and_no_other():
    assert tuple(algos.REGISTRY) == core.ALGOS


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def test_no_module_is_over_400_lines_and_no_function_over_80():
    """Where a module or a function grows past these, it holds more than one concern: split it
    (issue 31). Lines as `wc -l` counts them; a function from its def to its last line."""
    import ast

    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if (lines := text.count("\n")) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
                continue
            if (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                too_long.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    assert not too_long, "\n".join(too_long)
