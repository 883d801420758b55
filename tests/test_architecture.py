"""Facts about the package's structure that a reviewer can check (docs/architecture.md): no import
cycles between rlcollect's modules, no class that inherits from two rlcollect classes (the
collaborators of a collector are composed, not mixed in), no class that overrides a private
method its rlcollect base implements (only the hooks a base declares), no module that reads
the private attributes of another module's objects, central inference known only to its role
(both wings' member control: tests/test_members_contract.py), no module past ~600 lines, and
nothing in the package imports the benchmark suite (``bench/`` is not installed). Read from the
source with ``ast``: nothing is imported or run."""

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


def _is_import_module(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and ast.unparse(node.func) in ("importlib.import_module", "import_module")


def _imports(module: str) -> list[tuple[str, str | None]]:
    """``(module imported, name taken from it or None)`` for every import of ``module``,
    at any depth (a function's lazy import counts), except under ``if TYPE_CHECKING:``;
    ``importlib.import_module("rlcollect...")`` with a literal name counts as an import."""
    return _imports_in(MODULES[module].read_text(), module, MODULES[module].name == "__init__.py")


def _imports_in(source: str, module: str, is_package: bool = False) -> list[tuple[str, str | None]]:
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
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
        elif _is_import_module(node) and node.args and isinstance(node.args[0], ast.Constant):
            found.append((node.args[0].value, None))
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


def test_an_importlib_call_with_a_literal_name_is_an_import():
    source = "import importlib\ndef f():\n    return importlib.import_module('rlcollect.backends').dispatch\n"
    assert ("rlcollect.backends", None) in _imports_in(source, "rlcollect.collector")


#: Modules that look a module up by a name held in data (not a literal the cycle test follows),
#: each with its reason.
NAMED_LOOKUPS = {
    # the public API's names, each imported on first use (a worker need not import everything)
    "rlcollect": "_EXPORTS",
    "rlcollect.envs": "_EXPORTS",
    # collector_class="single"/"sync"/"async": the collector the user names, imported when named
    # (the collectors' modules import config.py, which checks their options)
    "rlcollect.config": "NAMED_COLLECTORS",
}


def test_every_import_by_name_is_a_literal_or_named_with_its_reason():
    """``importlib.import_module`` with a literal name is an import (the cycle test follows it);
    any other is one of ``NAMED_LOOKUPS``, the table it reads named."""
    found = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if _is_import_module(node) and not (node.args and isinstance(node.args[0], ast.Constant)):
                found[module] = NAMED_LOOKUPS.get(module, "?")
                assert NAMED_LOOKUPS.get(module, "?") in path.read_text(), module
    assert found == NAMED_LOOKUPS


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


def _defined_classes() -> dict[str, ast.ClassDef]:
    return {f"{module}.{node.name}": node for module, path in MODULES.items()
            for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}


def _methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _declared_hooks(node: ast.ClassDef) -> set[str]:
    """The private methods a base declares for its subclasses: listed in its ``_HOOKS``, or
    with a body that only raises ``NotImplementedError`` (or passes)."""
    hooks = set()
    for stmt in node.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_HOOKS" for t in stmt.targets):
            hooks |= {elt.value for elt in stmt.value.elts}
    for name, fn in _methods(node).items():
        body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        if not body or (len(body) == 1 and (isinstance(body[0], ast.Pass) or (
                isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])))):
            hooks.add(name)
    return hooks


#: Overrides outside this branch's rooms, named with their reason (none in rlcollect's collectors).
KNOWN_OVERRIDES: set[str] = set()


def _private_overrides() -> list[str]:
    classes, defined = _classes(), _defined_classes()

    def ancestors(name: str) -> list[str]:
        out, todo = [], list(classes.get(name, []))
        while todo:
            base = todo.pop(0)
            out.append(base)
            todo += classes.get(base, [])
        return out

    found = []
    for name, node in defined.items():
        for method in _methods(node):
            if not method.startswith("_") or method.startswith("__"):
                continue
            for base in ancestors(name):
                if method in _methods(defined[base]):
                    if method not in _declared_hooks(defined[base]):
                        found.append(f"{name}.{method}")
                    break
    return sorted(set(found) - KNOWN_OVERRIDES)


def test_no_class_overrides_a_private_method_of_an_rlcollect_base():
    """Parts are composed, not templated: a subclass overrides only the hooks its base declares."""
    assert _private_overrides() == []


def _private_names_by_module() -> dict[str, set[str]]:
    """The private attributes and methods each module's classes define (``self._x = ...``, ``def _x``)."""
    out: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        names = out.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in ast.walk(node):
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("_") \
                            and not item.name.startswith("__"):
                        names.add(item.name)
                    elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) and \
                            isinstance(item.value, ast.Name) and item.value.id == "self" and \
                            item.attr.startswith("_") and not item.attr.startswith("__"):
                        names.add(item.attr)
    return out


#: Reads of other libraries' private API (not rlcollect objects), each with its reason.
THIRD_PARTY = {
    ("rlcollect.distributed.control.transport", "options._timeout"),  # torch's ProcessGroupGloo options
    ("rlcollect.distributed.control.transport", "options._devices"),
    ("rlcollect.distributed.control.transport", "options._threads"),
    ("rlcollect.multiprocess.start", "server._preload_modules"),  # multiprocessing's fork server
    ("rlcollect.multiprocess.start", "server._forkserver_pid"),
    ("rlcollect.multiprocess.shm", "sharer._lock"),  # multiprocessing's resource sharer
    ("rlcollect.distributed.launch.launchers", "job._process"),  # submitit's local job
}


def _foreign_private_reads() -> list[str]:
    own = _private_names_by_module()
    found = []
    for module, path in MODULES.items():
        others = set().union(*(names for m, names in own.items() if m != module)) - own[module]
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr in others):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
                continue
            if (module, ast.unparse(node)) not in THIRD_PARTY:
                found.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_attributes():
    """What one room uses of another is public: the env <-> rollout array interface included."""
    assert _foreign_private_reads() == []


#: What each floor of ``distributed/`` may import of ``rlcollect.distributed`` (its sub-packages'
#: docstrings say so): the control plane nothing above it; the launchers the control plane and the
#: node's entry point, which the process they start runs.
DISTRIBUTED_FLOORS = {
    "rlcollect.distributed.control": ("rlcollect.distributed.control",),
    "rlcollect.distributed.launch": ("rlcollect.distributed.control", "rlcollect.distributed.launch",
                                     "rlcollect.distributed.node"),
}


def _floor_breaches() -> list[str]:
    found = []
    for module in MODULES:
        floor = next((f for f in DISTRIBUTED_FLOORS if module == f or module.startswith(f + ".")), None)
        if floor is None:
            continue
        allowed = DISTRIBUTED_FLOORS[floor]
        for target in _edges(module):
            inside = target == "rlcollect.distributed" or target.startswith("rlcollect.distributed.")
            if inside and not any(target == a or target.startswith(a + ".") for a in allowed):
                found.append(f"{module} imports {target}")
    return sorted(found)


def test_distributed_floors_import_only_what_their_docstrings_allow():
    """``distributed/control/`` imports nothing above it; ``distributed/launch/`` only the control
    plane and the node's entry point."""
    assert {"rlcollect.distributed.control.protocol", "rlcollect.distributed.launch.launchers"} <= set(MODULES)
    assert _floor_breaches() == []
    for floor in DISTRIBUTED_FLOORS:  # each floor says what it may import, and imports nothing itself
        init = MODULES[floor].read_text()
        assert "May import" in ast.get_docstring(ast.parse(init)), floor
        assert _imports(floor) == [], floor


#: Where central inference may be known: its own folder, the role that chooses where the policy
#: acts, the options that validate ``inference=`` and the worker that hands the pipes it was
#: started with to the client (``RemotePolicy``).
INFERENCE_ROOMS = ("rlcollect.inference", "rlcollect.multiprocess.acting", "rlcollect.multiprocess.config",
                   "rlcollect.multiprocess.worker")


def _inference_knowers() -> list[str]:
    found = []
    for module, path in MODULES.items():
        if module.startswith(INFERENCE_ROOMS):
            continue
        if any(t == "rlcollect.inference" or t.startswith("rlcollect.inference.") for t, _ in _imports(module)):
            found.append(f"{module} imports rlcollect.inference")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value == "central" for c in [node.left, *node.comparators]):
                found.append(f"{module}:{node.lineno} compares with 'central'")
    return found


def test_no_inference_branch_outside_its_role():
    """Nothing outside inference/ and multiprocess/acting.py knows whether inference is central;
    the single-process Collector and the rollout do not import inference/."""
    assert _inference_knowers() == []


def test_no_module_is_past_600_lines():
    assert {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 600} == {}


def test_a_replacement_seed_is_derived_in_one_place_for_both_wings():
    """Both wings' recovery take a restarted member's seed from ``members.replacement_seed``."""
    strides = sorted(module for module, path in MODULES.items() for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Constant) and node.value == 7919)
    assert strides == ["rlcollect.members"]
    for wing in ("rlcollect.multiprocess.recovery", "rlcollect.distributed.recovery"):
        assert ("rlcollect.members", "replacement_seed") in _imports(wing), wing


def _stats_writes(module: str) -> list[str]:
    return _stats_writes_in(MODULES[module].read_text(), module)


def _stats_writes_in(source: str, module: str) -> list[str]:
    """Attribute stores (``=``, ``+=``, ``setattr``) on an object reached through a ``stats`` or
    ``_stats`` attribute (``self.stats.frames += n``, ``setattr(self._stats, "frames", n)``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
            owners = [node.args[0]]
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            owners = [t.value for t in targets if isinstance(t, ast.Attribute)]
        else:
            continue
        found += [f"{module}:{node.lineno} {ast.unparse(node)}" for owner in owners
                  if isinstance(owner, ast.Attribute) and owner.attr in ("stats", "_stats")]
    return found


def test_the_gathers_report_to_the_statistics_and_do_not_write_them():
    """``MemberStats`` (members.py) owns its counters: the gathers, free running and the faces
    report a batch (``note_batch``, ...), they do not write its fields."""
    source = ("class Face:\n    def f(self):\n        setattr(self._stats, 'frames', 1)\n"
              "        self.stats.batches += 1\n")
    assert len(_stats_writes_in(source, "face")) == 2  # the scan sees a write
    parts = [m for m in MODULES if m.startswith(("rlcollect.multiprocess.", "rlcollect.distributed.",
                                                 "rlcollect.members"))]
    assert [w for m in parts for w in _stats_writes(m)] == []
