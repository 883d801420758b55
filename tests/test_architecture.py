"""Facts about the package's structure that a reviewer can check (docs/architecture.md): no import
cycles between rlcollect's modules, no class that inherits from two rlcollect classes (the
collaborators of a collector are composed, not mixed in), and nothing in the package imports the
benchmark suite (``bench/`` is not installed). Read from the source with ``ast``: nothing is
imported or run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlcollect"

pytestmark = pytest.mark.timeout(60)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str) -> list[tuple[str, str | None]]:
    """``(module imported, name taken from it or None)`` for every import of ``module``,
    at any depth (a function's lazy import counts), except under ``if TYPE_CHECKING:``."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.extend((base, alias.name) for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _edges(module: str) -> set[str]:
    """The rlcollect modules ``module`` imports: ``from pkg import name`` is an edge to
    ``pkg.name`` when that is a module, else to ``pkg``."""
    out = set()
    for target, name in _imports(module):
        if name is not None and f"{target}.{name}" in MODULES:
            out.add(f"{target}.{name}")
        elif target in MODULES:
            out.add(target)
    out.discard(module)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_no_import_cycles_between_rlcollect_modules():
    graph = {m: _edges(m) for m in MODULES}
    assert graph["rlcollect.envs.adapter"] >= {"rlcollect.envs.base", "rlcollect.envs.gym"}  # lazy imports count
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _classes() -> dict[str, list[str]]:
    """``module.Class`` -> the rlcollect classes among its direct bases (``module.Base``)."""
    defined = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                defined[f"{module}.{node.name}"] = node
    out = {}
    for qualified, node in defined.items():
        module = qualified.rpartition(".")[0]
        names = {name or target: (f"{target}.{name}" if name else target) for target, name in _imports(module)}
        bases = []
        for base in node.bases:
            if isinstance(base, ast.Name):
                local = f"{module}.{base.id}"
                resolved = local if local in defined else names.get(base.id)
            elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name):
                resolved = f"{names.get(base.value.id, base.value.id)}.{base.attr}"
            else:
                resolved = None
            if resolved in defined:
                bases.append(resolved)
        out[qualified] = bases
    return out


def test_no_class_inherits_from_two_rlcollect_classes():
    classes = _classes()
    assert classes["rlcollect.multiprocess.collector.MultiSyncCollector"]  # the resolver sees rlcollect bases
    assert {name: bases for name, bases in classes.items() if len(bases) > 1} == {}


def test_the_package_does_not_import_the_benchmarks():
    assert [m for m in MODULES if any(t == "bench" or t.startswith("bench.") for t, _ in _imports(m))] == []
