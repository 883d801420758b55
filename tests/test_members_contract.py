"""The member-control contract both wings hold (issue 37; docs/architecture.md, ``members.py``):
each face holds one ``Members`` (rlcollect/members.py) over its pool, gather, recovery and
statistics; recovery sits beside the gather, never inside it (no gather, nor free running,
imports or calls a recovery); and no part writes another part's fields (the statistics own
their counters: the gathers report). Both pools answer the one pool contract (``Pool``), and the
faces leave member control to ``Members``. Read from the source with ``ast``: nothing is imported
or run, so these hold in the fast tier; one test has mypy check that the classes wired answer the
``Protocol`` each part is handed as."""

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


# -- one pool contract for both wings (members.py's ``Pool``) ------------------------------------
#: The pools of both wings, each of which answers ``Pool``.
POOLS = {"multiprocess/pool.py": "WorkerPool", "distributed/pool.py": "NodePool"}


def _shape(fn: ast.FunctionDef) -> tuple:
    """A method's call shape: its positional parameters after ``self`` (how many), whether it
    takes ``*args``, its keyword-only parameters (by name) and whether it takes ``**kwargs``."""
    a = fn.args
    return len(a.posonlyargs) + len(a.args) - 1, a.vararg is not None, tuple(k.arg for k in a.kwonlyargs), \
        a.kwarg is not None


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _misfits(protocol: ast.ClassDef, cls: ast.ClassDef) -> list[str]:
    """The methods of ``protocol`` that ``cls`` lacks or takes in another shape."""
    mine = _methods(cls)
    return [f"{name}{_shape(fn)}: {'missing' if name not in mine else _shape(mine[name])}"
            for name, fn in _methods(protocol).items() if name not in mine or _shape(mine[name]) != _shape(fn)]


def test_both_pools_answer_the_one_pool_contract():
    """``Members`` controls both wings' members through ``Pool`` (``serving``, ``ask``,
    ``ask_all``): both pools take those calls in the same shape."""
    protocol = _class(_tree("members.py"), "Pool")
    assert {"serving", "ask", "ask_all", "alive", "__len__"} <= set(_methods(protocol))
    assert {path: found for path, name in POOLS.items() if (found := _misfits(protocol, _class(_tree(path), name)))} \
        == {}


def test_the_shape_check_sees_a_pool_in_its_own_words():
    protocol = _class(_tree("members.py"), "Pool")
    source = ("class Pool:\n    def __len__(self): ...\n    def serving_nodes(self): ...\n"
              "    def ask(self, i, name, payload=b'', **args): ...\n    def ask_all(self, command, *args): ...\n"
              "    def alive(self): ...\n")
    assert len(_misfits(protocol, _class(ast.parse(source), "Pool"))) == 3


#: What controlling the members is made of: a face that names one of these on its pool, gather or
#: recovery writes member control in its own words (``Members`` writes it once for both wings).
MEMBER_CONTROL = {"ask", "ask_all", "request", "send", "receive", "serving", "serving_nodes", "wait_for",
                  "settled", "drained", "quiesce", "discard", "note_seed", "seeds"}


def _member_control(tree: ast.AST) -> list[str]:
    """``self.<part>.<name>`` with ``name`` in ``MEMBER_CONTROL`` and ``part`` a pool, gather or
    recovery (read or called)."""
    return sorted({f"{node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
                   if isinstance(node, ast.Attribute) and node.attr in MEMBER_CONTROL
                   and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name)
                   and node.value.value.id == "self"
                   and node.value.attr in ("_pool", "_gather", "_recovery", "_restart", "pool", "gather")})


#: The faces and the multi-process face's base (the calls of torchrl's face that reach the workers).
FACE_CLASSES = {**FACES, "multiprocess/worker_control.py": "WorkerControl"}


def test_the_faces_leave_member_control_to_members():
    """Seed, reset, state, load, a command to a member and the waits before them are
    ``Members``' (members.py), written once over the pool contract; a face only calls them."""
    assert {path: found for path, name in FACE_CLASSES.items()
            if (found := _member_control(_class(_tree(path), name)))} == {}


def test_the_faces_are_under_400_lines():
    """A face keeps its own: the signature, the wiring, and what only its wing has."""
    assert {path: n for path in FACES if (n := len((PACKAGE / path).read_text().splitlines())) >= 400} == {}


@pytest.mark.parametrize("line", ["self._pool.ask(i, 'seed', 1)", "self._pool.serving_nodes()",
                                  "self._member_control.run(self._gather.discard)", "self._restart.seeds[i] = 1"])
def test_the_scan_sees_member_control_in_a_face(line):
    assert len(_member_control(ast.parse(f"def f(self, i):\n    {line}\n"))) == 1


# -- the parts' Protocols, checked by mypy against the classes wired ------------------------------
#: Each wing's parts assigned to the Protocol they are handed as (what ``Members``, a gather or a
#: recovery asks of them): mypy refuses the script when a class stops answering its Protocol.
PROTOCOL_SCRIPT = """\
from rlcollect.distributed.config import DistributedConfig
from rlcollect.distributed.gather import Gather as NodeGather, Handle, Nodes, Options
from rlcollect.distributed.nodes import NodeHandle
from rlcollect.distributed.pool import NodePool
from rlcollect.distributed.recovery import Handle as RecoveryHandle, Nodes as RecoveryNodes, Policy, \
    Recovery as NodeRecovery
from rlcollect.members import BatchGather, Gather, Pool, Recovery, Repairable
from rlcollect.multiprocess.freerun import BackgroundThread, FreeRunningWorkers
from rlcollect.multiprocess.gather import SyncGather
from rlcollect.multiprocess.gather_async import AsyncGather
from rlcollect.multiprocess.pool import WorkerPool
from rlcollect.multiprocess.recovery import Restarts, WorkerRestarts


def wired(wp: WorkerPool, np_: NodePool, sg: SyncGather, ag: AsyncGather, ng: NodeGather, wr: WorkerRestarts,
          nr: NodeRecovery, fw: FreeRunningWorkers, ft: BackgroundThread, dc: DistributedConfig,
          nh: NodeHandle) -> None:
    pools: list[Pool] = [wp, np_]
    batch_gathers: list[BatchGather] = [sg, ag]
    node_gather: Gather = ng
    recoveries: list[Recovery] = [wr, nr]
    free: list[Repairable] = [fw, ft]
    node_pools: tuple[Nodes, RecoveryNodes] = (np_, np_)
    worker_pool: Restarts = wp
    options: tuple[Options, Policy] = (dc, dc)
    handles: tuple[Handle, RecoveryHandle] = (nh, nh)
"""
MYPY_INI = """\
[mypy]
ignore_missing_imports = True
follow_imports = silent
cache_dir = /dev/null

[mypy-torch.*,tensordict.*,numpy.*,gymnasium.*,cloudpickle.*,torchrl.*,psutil.*]
follow_imports = skip
"""


@pytest.mark.timeout(600)
def test_the_wired_classes_answer_the_protocols_they_are_handed_as(tmp_path):
    """Both pools answer ``Pool``, the gathers ``BatchGather`` / ``Gather``, both recoveries
    ``Recovery``, free running ``Repairable``, ``NodePool`` the distributed gather's and
    recovery's ``Nodes``, ``DistributedConfig`` their ``Options``/``Policy`` and ``NodeHandle``
    their ``Handle`` (mypy; the heavy libraries are left unknown, which keeps it to seconds)."""
    pytest.importorskip("mypy")
    import os
    import subprocess
    import sys

    (tmp_path / "wired.py").write_text(PROTOCOL_SCRIPT)
    (tmp_path / "mypy.ini").write_text(MYPY_INI)
    env = {**os.environ, "PYTHONPATH": str(PACKAGE.parent)}
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(tmp_path / "mypy.ini"),
                          "--no-error-summary", str(tmp_path / "wired.py")],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=540)
    assert run.returncode == 0, run.stdout + run.stderr
