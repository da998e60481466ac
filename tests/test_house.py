"""The house rules read from the tree: the shared core imports no component, no module
imports itself back through others, and no function outgrows one reader (80 lines;
numba kernels, whose loops stay whole to compile, are the exception)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "liverl", "promotion", "ingest", "feedback", "serving", "learner", "sync", "policies", "rollouts")
LONGEST = 80


def modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    found = {}
    for package in packages:
        for file in (ROOT / package).rglob("*.py"):
            name = ".".join(file.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = file
    return found


def imported(tree: ast.AST, known: dict[str, Path]) -> Iterator[str]:
    """The project's modules a module imports, at any depth of its code."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        yield from (name for name in candidates if name in known)


def test_no_module_imports_itself_back_and_the_core_imports_no_component():
    known = modules()
    graph = {name: set(imported(ast.parse(file.read_text()), known)) for name, file in known.items()}
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as error:
        raise AssertionError(f"an import circle: {' -> '.join(error.args[1])}") from None
    core = {f"{name} imports {target}" for name, targets in graph.items() if name.startswith("liverl")
            for target in targets if not target.startswith("liverl")}
    assert not core


def test_no_function_outgrows_one_reader():
    long = []
    for name, file in modules((*PACKAGES, "benchmarks", "sdk")).items():
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                kernel = any("njit" in ast.unparse(d) or "numba" in ast.unparse(d) for d in node.decorator_list)
                if not kernel and node.end_lineno - node.lineno + 1 > LONGEST:
                    long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long
