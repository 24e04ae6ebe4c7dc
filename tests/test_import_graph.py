"""The package import graph shows the architecture: nothing imports upward, no cycle.

Read from the sources (every import, function-level ones included; `if TYPE_CHECKING:` blocks
are annotations, not imports), plus the imports the component registries make at run time. A
node is a package (`eventlog`, `replay`, `orchestrator.core`, `orchestrator.shell`, ...) or a
top-level module of `orchestrator` (`orchestrator.config`, `orchestrator.rundir`, ...).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from orchestrator.config import ALGORITHMS, ENVS, INFERENCE, TRAINERS

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "eventlog", "replay")
CLI = "orchestrator.cli"  # the composition root of `orch`: its commands come from every package


def _front_end(module: str) -> bool:
    """A command-line front end (`orchestrator.cli`, a package's `cli` module): it composes the
    packages below it into commands, so it may use replay's tools (opening a run's log)."""
    return module == CLI or module.endswith(".cli")


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _module_of(path: Path) -> tuple[str, bool]:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def _imported(path: Path) -> list[str]:
    """The modules `path` imports (`from a import b` names `a.b` when b is a module)."""
    module, is_package = _module_of(path)
    found: list[str] = []

    def visit(tree: ast.AST) -> None:
        for child in ast.iter_child_nodes(tree):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for statement in child.orelse:
                    visit(statement)
                continue
            if isinstance(child, ast.Import):
                found.extend(alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")[: len(module.split(".")) - child.level + is_package]
                    source = ".".join(base + ([child.module] if child.module else []))
                else:
                    source = child.module
                for alias in child.names:
                    found.append(f"{source}.{alias.name}" if _is_module(f"{source}.{alias.name}") else source)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return [name for name in found if name.split(".")[0] in PACKAGES]


def _node(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "orchestrator" and len(parts) > 1 else parts[0]


def module_imports() -> list[tuple[str, str]]:
    """(module, a module of the three packages it imports), over every source file."""
    return [
        (_module_of(path)[0], target)
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        for target in _imported(path)
    ]


def package_graph(layers_only: bool = False) -> dict[str, dict[str, str]]:
    """node -> {imported node: one module-level import that makes the edge, for the message}.
    `layers_only`: without the front ends' imports (roots: nothing but the CLI imports them),
    which are not edges between layers."""
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for module, target in module_imports():
        if layers_only and _front_end(module):
            continue
        if _node(target) != _node(module):
            graph[_node(module)].setdefault(_node(target), f"{module} imports {target}")
    for registry in (TRAINERS, INFERENCE, ENVS, ALGORITHMS):  # `Registry.config`, called by the config
        for name in registry.names():
            target = registry.module(name)
            graph["orchestrator.config"].setdefault(_node(target), f"the {registry.kind} registry imports {target}")
    return graph


def _edges(graph: dict[str, dict[str, str]]) -> list[tuple[str, str, str]]:
    return [(a, b, why) for a, targets in graph.items() for b, why in targets.items()]


def test_the_core_imports_nothing_of_orchestrator_outside_it_nor_the_log_or_replay():
    bad = [why for a, b, why in _edges(package_graph()) if a == "orchestrator.core" and b.split(".")[0] in PACKAGES]
    assert bad == []


def test_the_event_log_imports_nothing_of_orchestrator_or_replay():
    assert [why for a, b, why in _edges(package_graph()) if a == "eventlog"] == []


def test_orchestrator_does_not_import_replay_but_from_its_command_line():
    bad = [
        f"{module} imports {target}"
        for module, target in module_imports()
        if module.startswith("orchestrator") and target.split(".")[0] == "replay" and not _front_end(module)
    ]
    assert bad == []


def test_front_ends_are_roots():
    importers = [
        f"{module} imports {target}"
        for module, target in module_imports()
        if _front_end(target) and module != CLI and not _front_end(module)
    ]
    assert importers == []


def test_no_cycle_between_packages():
    """Every strongly connected component of the graph (Tarjan) is a single node."""
    graph = {a: set(targets) for a, targets in package_graph(layers_only=True).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
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
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    edges = {(a, b): why for a, b, why in _edges(package_graph(layers_only=True))}
    assert cycles == [], [[why for (a, b), why in edges.items() if a in c and b in c] for c in cycles]


def test_the_graph_sees_imports_inside_functions_and_from_relative_imports():
    """The reader itself: a function-level import is an edge (the CLI's commands, the config's
    registries), and no edge comes from an annotation-only import."""
    graph = package_graph()
    assert "orchestrator.trainers" in graph["orchestrator.config"]  # through the trainer registry
    assert "orchestrator.config" not in graph.get("orchestrator.trainers", {})  # TYPE_CHECKING only
    assert "replay" in graph[CLI]  # `orch replay`, imported inside a function
