"""Imports run one way, and no files import each other: read from the source (ast), so an import inside a
function, or under TYPE_CHECKING, counts as much as one at the top.

    burst            the attention library: imports no other package of the project
    runtime          process plumbing (launching, process groups, memory): burst
    data             token stores, loader, tokenizer: burst, runtime
    models           the model, its checkpoints and conversion: burst, runtime (the directories it writes)
    checkpoints      the training checkpoint's format, every checkpoint source: burst, runtime, models
    planner          memory, time and FLOPs of a run shape, the GPU table, the fit check: burst, runtime, models
    trainer          `burst train`: all of the above, not evaluation
    evaluation       `burst eval`: all of the above, not trainer
    bench            `burst bench`: burst, runtime, planner (one sequence's plan)
    cli              the command line: anything
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
LOWER = {"burst": set(), "runtime": {"burst"}, "data": {"burst", "runtime"}, "models": {"burst", "runtime"},
         "checkpoints": {"burst", "runtime", "models"}}
ALLOWED = {  # package -> the project's packages it may import (its own always)
    **LOWER,
    "planner": {"burst", "runtime", "models"},
    "trainer": {*LOWER, "data", "models", "planner"},
    "evaluation": {*LOWER, "data", "models", "planner"},
    "bench": {"burst", "runtime", "planner"},
    "cli": {*LOWER, "trainer", "evaluation", "bench", "planner"},
}


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages above and cli.py."""
    modules = {"cli": REPO / "cli.py"}
    for package in ALLOWED.keys() - {"cli"}:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules the module `name` imports, each by its most specific name: `from a.b import c`
    names a.b.c when that is a module, else a.b."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name inside a module: its module
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imported_modules(name, path, modules) - {name} for name, path in modules.items()}


def top(module: str) -> str:
    return module.partition(".")[0]


def layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    return [f"{module} imports {target}" for module, targets in sorted(graph.items()) for target in sorted(targets)
            if top(target) != top(module) and top(target) not in ALLOWED[top(module)]]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each a set of files in a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_imports_run_one_way():
    assert layer_breaches(import_graph()) == []


def test_no_files_import_each_other():
    assert cycles(import_graph()) == []


def test_the_modules_are_all_read():
    graph = import_graph()
    assert {"cli", "burst.attention", "runtime.process", "checkpoints.training", "bench.attention",
            "evaluation.report"} <= set(graph)
    assert "checkpoints.training" in graph["trainer.checkpoint"]  # a from-import names the module
    assert "models.convert" in graph["checkpoints.sources"]  # `from models import convert` names it too


@pytest.mark.parametrize("graph, expected", [
    ({"burst.a": {"trainer.b"}, "trainer.b": set()}, ["burst.a imports trainer.b"]),
    ({"models.a": {"data.b"}, "data.b": set()}, ["models.a imports data.b"]),
    ({"data.a": {"models.b"}, "models.b": set()}, ["data.a imports models.b"]),
    ({"trainer.a": {"evaluation.b"}, "evaluation.b": set()}, ["trainer.a imports evaluation.b"]),
    ({"evaluation.a": {"trainer.b"}, "trainer.b": set()}, ["evaluation.a imports trainer.b"]),
    ({"planner.a": {"trainer.b"}, "trainer.b": set()}, ["planner.a imports trainer.b"]),
    ({"planner.a": {"evaluation.b"}, "evaluation.b": set()}, ["planner.a imports evaluation.b"]),
    ({"trainer.a": {"models.b", "burst.c"}, "models.b": {"burst.c"}, "burst.c": set()}, []),
])
def test_a_breach_is_named(graph, expected):
    assert layer_breaches(graph) == expected


def test_a_circle_is_found():
    graph = {"evaluation.a": {"evaluation.b"}, "evaluation.b": {"evaluation.c"}, "evaluation.c": {"evaluation.a"},
             "evaluation.d": {"evaluation.a"}}
    assert cycles(graph) == [["evaluation.a", "evaluation.b", "evaluation.c"]]
