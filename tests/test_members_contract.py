"""The member-control contract both wings hold (issue 37; docs/architecture.md, ``members.py``):
each face holds one ``Members`` (rlcollect/members.py) over its pool, gather, recovery and
statistics; recovery sits beside the gather, never inside it (no gather, nor free running,
imports or calls a recovery); and no part writes another part's fields (the statistics own
their counters: the gathers report). Read from the source with ``ast``: nothing is imported
or run, so these hold in the fast tier."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rlcollect"

pytestmark = pytest.mark.timeout(60)

#: The faces, each of which holds a ``Members``.
FACES = {"multiprocess/collector.py": "MultiCollectorBase", "distributed/collector.py": "DistributedCollector"}
#: The gathers (and free running, which gathers what workers running free wrote): they raise a
#: member's failure, ``Members`` repairs it.
GATHERS = ("multiprocess/gather.py", "multiprocess/gather_async.py", "multiprocess/freerun.py",
           "distributed/gather.py")
#: The attributes through which a face or a part reaches the other parts: a store through one of
#: them (``self.stats.frames += n``, ``self._gather.frames = n``, ``self.pool.handles[i].frames
#: += n``) writes another part's fields.
PARTS = {"pool", "_pool", "gather", "_gather", "stats", "_stats", "recovery", "_recovery", "restarts",
         "_restart", "slots", "acting", "_acting", "free", "_free", "members", "_member_control",
         "weights", "_weights", "schedule"}
#: Where the parts live: both wings' top floors and the shared member control.
PART_MODULES = sorted([PACKAGE / "members.py",
                       *(PACKAGE / "multiprocess").glob("*.py"), *(PACKAGE / "distributed").glob("*.py")])


def _tree(relative: str | Path) -> ast.Module:
    return ast.parse((PACKAGE / relative).read_text())


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(node for node in ast.walk(tree) if isinstance(node, ast.ClassDef) and node.name == name)


def _holds_members(cls: ast.ClassDef) -> bool:
    """Whether a method of ``cls`` sets ``self._member_control = Members(...)``."""
    for node in ast.walk(cls):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                ast.unparse(node.value.func) == "Members":
            if any(ast.unparse(t) == "self._member_control" for t in node.targets):
                return True
    return False


def test_both_faces_hold_a_members():
    for path, name in FACES.items():
        assert _holds_members(_class(_tree(path), name)), path


def test_the_scan_sees_a_face_without_members():
    source = "class Face:\n    def __init__(self):\n        self._member_control = Gather()\n"
    assert not _holds_members(_class(ast.parse(source), "Face"))


def _recovery_uses(tree: ast.Module) -> list[str]:
    """Imports of a ``recovery`` module, and calls of ``recover``, ``forgive`` or ``run`` on a
    restarts or recovery object."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("recovery"):
            found.append(f"{node.lineno}: from {node.module} import ...")
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names if a.name.endswith("recovery")]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("recover", "forgive", "run"):
            owner = ast.unparse(node.func.value)
            if "restart" in owner or "recover" in owner:
                found.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_no_gather_imports_or_calls_a_recovery():
    """The gathers raise (``MemberFailed``, or a node's marked failure) and keep their state;
    ``Members`` has the recovery repair the failure and asks again."""
    assert {path: found for path in GATHERS if (found := _recovery_uses(_tree(path)))} == {}


def test_the_scan_sees_a_gather_that_recovers():
    source = ("from rlcollect.multiprocess.recovery import WorkerRestarts\n"
              "def collect(self, i, err):\n    self.restarts.recover(i, err)\n")
    assert len(_recovery_uses(ast.parse(source))) == 2


def _rooted_at_a_part(node: ast.AST, aliases: set[str]) -> bool:
    """Whether ``node`` (an attribute's owner) is reached through ``self.<part>`` or a local bound
    to such an object (``h = self.pool.handles[i]``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        inner = node.func if isinstance(node, ast.Call) else node.value
        if isinstance(node, ast.Attribute) and isinstance(inner, ast.Name) and inner.id == "self":
            return node.attr in PARTS
        node = inner
    return isinstance(node, ast.Name) and node.id in aliases


def _foreign_writes(source: str, where: str) -> list[str]:
    """Attribute stores (``=``, ``+=``, ``setattr``) on an object that is not ``self``'s own but
    another part's: reached through one of ``PARTS``."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        aliases: set[str] = set()
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and _rooted_at_a_part(node.value, aliases):
                aliases.add(node.targets[0].id)
        for node in ast.walk(func):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
                owners = [node.args[0]]
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                owners = [t.value for t in flat if isinstance(t, ast.Attribute)]
            else:
                continue
            found += [f"{where}:{node.lineno} {ast.unparse(node)[:100]}" for owner in owners
                      if _rooted_at_a_part(owner, aliases)]
    return sorted(set(found))


def test_no_part_writes_another_parts_fields():
    """The statistics own their counters (the gathers report: ``note_batch``, ...), the pool its
    handles, the recovery its restart counts and seeds: no face or part stores into another's."""
    found = [w for path in PART_MODULES for w in _foreign_writes(path.read_text(), path.name)]
    assert found == []


@pytest.mark.parametrize("line", [
    "self.stats.frames += 1", "setattr(self._stats, 'frames', 1)", "self._gather.frames = 1",
    "self.pool.handles[i].frames += 1", "h = self._pool.handles[i]; h.seed = 1",
])
def test_the_scan_sees_a_write_into_another_part(line):
    assert len(_foreign_writes(f"def f(self, i):\n    {line}\n", "x")) == 1


def test_the_scan_leaves_a_parts_own_fields_alone():
    source = "def f(self, i, batch):\n    self.frames += 1\n    self.handles[i].hung = True\n    batch.names = []\n"
    assert _foreign_writes(source, "x") == []
