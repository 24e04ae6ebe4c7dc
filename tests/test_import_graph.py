"""The import graph shows the architecture: layers, bottom to top, that import only downward, and
no circle of modules.

Read from the sources: every import counts, at module level, inside a function or under
`if TYPE_CHECKING:` (an annotation-only import still ties the modules together), plus the imports
the component registries make at run time. A node is a module (a package is its `__init__`);
`from a import b` names the module `a.b` when there is one, else `a`. Only the modules of
`orchestrator/`, `eventlog/` and `replay/` are nodes.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from collections import defaultdict
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import cache
from pathlib import Path

import pytest

# The layers, bottom to top: a module may import from its own layer and the layers below it.
# Each module's layer is that of the topmost layer with a pattern (fnmatch) matching its name.
LAYERS: dict[str, tuple[str, ...]] = {
    "core": ("orchestrator", "orchestrator.core", "orchestrator.core.*", "eventlog", "eventlog.*"),
    # the component Protocols, requests, results and errors, and where the processes components
    # start run (a BuildContext's placement): imports only the core
    "contracts": ("orchestrator.contracts", "orchestrator.placement"),
    # leaf utilities, and the tools that read or write runs without choosing a component
    "utilities": (
        "orchestrator.urls",
        "orchestrator.http_limits",
        "orchestrator.model_path",
        "orchestrator.plugins",
        "orchestrator.orch_log",
        "orchestrator.figures",
        "orchestrator.rundir",
        "orchestrator.notices",
        "orchestrator.gc_tuning",
        "orchestrator.quick_exit",
        "orchestrator.process_guard",
        "orchestrator.slurm_job",
        "orchestrator.effects",
        "orchestrator.fold",
        "orchestrator.tasks",
        "orchestrator.collection",
        "orchestrator.collection.*",
        "orchestrator.observe",
        "orchestrator.observe.*",
        "replay",
        "replay.*",
    ),
    # each a config section plus its factory, chosen by name from a registry
    "components": (
        "orchestrator.envs",
        "orchestrator.envs.*",
        "orchestrator.inference",
        "orchestrator.inference.*",
        "orchestrator.embedded",
        "orchestrator.embedded.*",
        "orchestrator.hf",
        "orchestrator.hf.*",
        "orchestrator.trainers",
        "orchestrator.trainers.*",
        "orchestrator.verifiers",
        "orchestrator.verifiers.*",
        "orchestrator.nemo_gym",
        "orchestrator.nemo_gym.*",
        "orchestrator.algorithms",
        "orchestrator.algorithms.*",
        "orchestrator.serve",  # `orch serve`'s policy, tokenizer and server
        "orchestrator.serve.*",
        "orchestrator.weight_push",  # the trainer's weight push and its vLLM engine (weight_sync vllm_push)
        "orchestrator.weight_push.*",
    ),
    # the registries, RunConfig and the rules that span components
    "composition root": ("orchestrator.config", "orchestrator.config_docs"),
    "shell": ("orchestrator.shell", "orchestrator.shell.*"),
    "cli": ("orchestrator.cli", "*.cli"),
}
REGISTRIES = "orchestrator.config"  # the module whose Registry objects name every plugin module

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("orchestrator", "eventlog", "replay")
CLI = "orchestrator.cli"  # the composition root of `orch`: its commands come from every package


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module
    where: str  # path:line of the import
    how: str = ""  # "", "in a function", "TYPE_CHECKING" or "registry: KIND NAME"

    def __str__(self) -> str:
        return f"{self.source} -> {self.target}  ({self.where}{', ' + self.how if self.how else ''})"


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


def _is_type_checking(test: ast.expr) -> bool:
    return "TYPE_CHECKING" in ast.unparse(test)


def _imports_of(path: Path) -> list[Import]:
    """The imports of the three packages that `path` makes, each with its line and how it is made."""
    module, is_package = _module_of(path)
    where = path.relative_to(REPO).as_posix()
    found: list[Import] = []

    def visit(tree: ast.AST, how: str) -> None:
        for child in ast.iter_child_nodes(tree):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.body:
                    read(statement, "TYPE_CHECKING")
                for statement in child.orelse:
                    read(statement, how)
            else:
                read(child, how)

    def read(node: ast.AST, how: str) -> None:
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + is_package]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if _is_module(f"{source}.{a.name}") else source for a in node.names]
        for target in targets:
            if target.split(".")[0] in PACKAGES:
                found.append(Import(module, target, f"{where}:{node.lineno}", how))
        in_function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        visit(node, how or ("in a function" if in_function else ""))

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return found


def _registry_imports() -> list[Import]:
    """The plugin modules the registries of REGISTRIES name, which a config imports through them
    (`Registry.config`): edges of REGISTRIES, each at the line its registry is declared on."""
    registries = importlib.import_module(REGISTRIES)
    path = Path(inspect.getfile(registries))
    declared = {
        target.id: node.lineno
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Name)
    }
    where = path.relative_to(REPO).as_posix()
    found = []
    for variable, registry in vars(registries).items():
        is_registry = callable(getattr(registry, "names", None)) and callable(getattr(registry, "module", None))
        if is_registry and not isinstance(registry, type) and variable in declared:
            kind = getattr(registry, "kind", variable)
            found += [
                Import(REGISTRIES, registry.module(name), f"{where}:{declared[variable]}", f"registry: {kind} {name!r}")
                for name in registry.names()
            ]
    return found


@cache
def all_imports() -> tuple[Import, ...]:
    """Every import between modules of the three packages, over every source file."""
    read = [imp for package in PACKAGES for path in sorted((REPO / package).rglob("*.py")) for imp in _imports_of(path)]
    return tuple(imp for imp in [*read, *_registry_imports()] if imp.source != imp.target)


def modules() -> list[str]:
    return sorted({_module_of(path)[0] for package in PACKAGES for path in (REPO / package).rglob("*.py")})


def layer_of(module: str) -> str | None:
    for layer in reversed(LAYERS):
        if any(fnmatchcase(module, pattern) for pattern in LAYERS[layer]):
            return layer
    return None


def circles(edges: list[tuple[str, str]]) -> list[list[str]]:
    """Every strongly connected component of more than one node (Tarjan), each sorted."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found, key=lambda c: (-len(c), c))


def circle_report() -> str:
    """Each circle of modules with every import inside it, then the smaller circles inside one
    package that a larger circle holds (each a loop to break on its own)."""
    imports = all_imports()

    def described(circle: list[str], what: str) -> str:
        members = set(circle)
        inside = sorted({str(imp) for imp in imports if imp.source in members and imp.target in members})
        return f"{what} of {len(circle)} modules: {', '.join(circle)}\n  " + "\n  ".join(inside)

    whole = circles([(imp.source, imp.target) for imp in imports])
    report = [described(circle, "circle") for circle in whole]
    for package in sorted({_node(m) for circle in whole for m in circle}):
        edges = [(i.source, i.target) for i in imports if _node(i.source) == _node(i.target) == package]
        report += [described(c, f"inside {package}: circle") for c in circles(edges) if c not in whole]
    return "\n".join(report)


def upward_arrows() -> list[str]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    arrows = set()
    for imp in all_imports():
        source, target = layer_of(imp.source), layer_of(imp.target)
        if source is not None and target is not None and rank[target] > rank[source]:
            arrows.add(f"{imp}: {source} -> {target}")
    return sorted(arrows)


def test_every_module_has_a_layer():
    """A module the table does not name is added to LAYERS above (the layer its job belongs to)."""
    unplaced = [m for m in modules() if layer_of(m) is None]
    if unplaced:
        pytest.fail(f"modules in no layer of LAYERS: {', '.join(unplaced)}", pytrace=False)


def test_every_layer_names_modules_that_exist():
    """A pattern that matches no module is left over from a module moved or never written."""
    names = modules()
    empty = [p for patterns in LAYERS.values() for p in patterns if not any(fnmatchcase(m, p) for m in names)]
    assert empty == []


def test_no_circle_of_modules():
    report = circle_report()
    if report:
        pytest.fail(report, pytrace=False)


def test_no_module_imports_from_a_layer_above_it():
    arrows = upward_arrows()
    if arrows:
        layers = ", ".join(LAYERS)
        pytest.fail(
            f"{len(arrows)} upward arrows (layers, bottom to top: {layers}):\n" + "\n".join(arrows), pytrace=False
        )


def _node(module: str) -> str:
    """A package-level node: `eventlog`, `replay`, `orchestrator.core`, `orchestrator.shell`, ..."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "orchestrator" and len(parts) > 1 else parts[0]


def test_the_core_imports_nothing_of_orchestrator_outside_it_nor_the_log_or_replay():
    bad = [str(imp) for imp in all_imports() if _node(imp.source) == "orchestrator.core" != _node(imp.target)]
    assert bad == []


def test_the_event_log_imports_nothing_of_orchestrator_or_replay():
    assert [str(imp) for imp in all_imports() if _node(imp.source) == "eventlog" != _node(imp.target)] == []


def test_orchestrator_does_not_import_replay_but_from_its_command_line():
    bad = [
        str(imp)
        for imp in all_imports()
        if imp.source.startswith("orchestrator") and _node(imp.target) == "replay" and not _front_end(imp.source)
    ]
    assert bad == []


def test_front_ends_are_roots():
    importers = [
        str(imp) for imp in all_imports() if _front_end(imp.target) and imp.source != CLI and not _front_end(imp.source)
    ]
    assert importers == []


def test_no_cycle_between_packages():
    """The coarse check, as it stood before the module graph: between package-level nodes, without
    the front ends' imports (roots: nothing but the CLI imports them) and the annotation-only ones,
    a registry's imports counted as the config's (which calls `Registry.config`)."""
    edges = [
        (_node("orchestrator.config" if imp.how.startswith("registry") else imp.source), _node(imp.target), str(imp))
        for imp in all_imports()
        if not _front_end(imp.source) and imp.how != "TYPE_CHECKING"
    ]
    found = circles([(a, b) for a, b, _ in edges if a != b])
    assert found == [], [[why for a, b, why in edges if a != b and {a, b} <= set(c)] for c in found]


def test_the_graph_sees_every_kind_of_import():
    """The reader itself: an import inside a function, under TYPE_CHECKING, relative, or made by a
    registry is an edge, with the line it is on; a module of a package is its own node."""
    imports = all_imports()
    seen = {(imp.source, imp.target, imp.how) for imp in imports}
    assert (CLI, "replay.cli", "in a function") in seen  # `orch replay`, imported inside a function
    assert any(imp.how == "TYPE_CHECKING" for imp in imports)
    assert any(
        imp.how.startswith("registry: trainer") and imp.target.startswith("orchestrator.trainers") for imp in imports
    )
    assert ("eventlog.log", "eventlog.fileformat", "") in seen  # `from . import fileformat`
    assert ("eventlog.log", "eventlog.codec", "") in seen  # `from .codec import ...`
    lines = [int(imp.where.rsplit(":", 1)[1]) for imp in imports]
    assert all(line >= 1 for line in lines)
    assert circles([("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]) == [["a", "b", "c"]]
    assert layer_of("replay.cli") == "cli" and layer_of("replay.summary") == "utilities"
