"""Test-wide fixtures: a leak check around every test and around the whole session.

After each test we check that it left behind
- no live child process (descendants of this process, given ~3 s to exit; zombies are reaped),
- no new entry in /dev/shm (torch's ``torch_*`` files, multiprocessing's ``psm_*`` and
  ``sem.*``; given a short grace period),
- no more than ``FD_SLACK`` extra open file descriptors (re-measured after a garbage
  collection and a short wait, so that only growth that persists counts).

A test that leaks on purpose is marked ``@pytest.mark.allow_leaks`` (everything) or
``@pytest.mark.allow_leaks("children", "shm", "fds")`` (only those kinds). Setting the
environment variable ``RLCOLLECT_LEAK_CHECK=0`` turns the check off (for debugging only).

The same check runs over the whole session with a larger fd slack, which catches a leak that
is small per test but adds up. The helpers are exposed through the ``leak_checker`` fixture
so that tests/test_leak_check.py can show that the checker sees what it should.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import pytest

pytest_plugins = ["pytester"]

LEAK_KINDS = ("children", "shm", "fds")
FD_SLACK = 4  # per test: a library may lazily open a file or two on first use
SESSION_FD_SLACK = 32
CHILD_GRACE_S = 3.0
SHM_GRACE_S = 2.0
FD_GRACE_S = 0.5
SHM_DIR = "/dev/shm"
# Long-lived helpers that multiprocessing and torch start on first use and keep for the
# whole interpreter: they are not leaks of the test that happened to start them.
HELPER_CMDLINE_MARKERS = ("resource_tracker", "forkserver", "torch_shm_manager")


# -- measurements ------------------------------------------------------------------------------
def _read_stat(pid: int) -> tuple[str, int] | None:
    """``(state, ppid)`` of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int | None = None) -> dict[int, str]:
    """``{pid: state}`` of every process below ``root`` (default: this process)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = _read_stat(int(name))
        if stat is None:
            continue
        states[int(name)] = stat[0]
        children.setdefault(stat[1], []).append(int(name))
    found: dict[int, str] = {}
    todo = list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found[pid] = states[pid]
        todo.extend(children.get(pid, ()))
    return found


def _helper_pids() -> set[int]:
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    pids = {
        getattr(getattr(multiprocessing.resource_tracker, "_resource_tracker", None), "_pid", None),
        getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_forkserver_pid", None),
    }
    return {p for p in pids if p is not None}


def _helper_fds() -> set[int]:
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    fds = {
        getattr(getattr(multiprocessing.resource_tracker, "_resource_tracker", None), "_fd", None),
        getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_forkserver_alive_fd", None),
    }
    return {fd for fd in fds if fd is not None}


def is_helper(pid: int) -> bool:
    """True for multiprocessing's resource tracker / forkserver and torch's shm manager."""
    if pid in _helper_pids():
        return True
    cmdline = _cmdline(pid)
    return any(marker in cmdline for marker in HELPER_CMDLINE_MARKERS)


def live_children() -> set[int]:
    """Live (non-zombie) descendants of this process, helpers excluded."""
    return {pid for pid, state in descendants().items() if state != "Z" and not is_helper(pid)}


def reap_zombies(only: set[int] | None = None, skip: set[int] = frozenset()) -> None:
    """Collect exited children so they do not pile up in the process table.

    multiprocessing's own children are left to ``active_children()``, which reaps them through
    their ``Process`` objects: reaping one behind its back would leave that object unable to
    learn its exit code (``is_alive()`` would stay True for ever). Other zombies are reaped
    directly: those in ``only`` when given, never those in ``skip`` (a zombie that existed
    before the test belongs to something older, a module-scoped fixture say, which may want
    to wait for it itself).
    """
    import multiprocessing
    import multiprocessing.process

    multiprocessing.active_children()
    # Read after active_children(): a child that exits meanwhile is still listed, so skipped.
    owned = {p.pid for p in list(multiprocessing.process._children)}
    for pid, state in descendants().items():
        if state != "Z" or pid in owned or pid in skip or (only is not None and pid not in only):
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass  # not our direct child, or already reaped by its owner


def shm_entries() -> set[str]:
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


def _shm_is_foreign(name: str, ours: set[int]) -> bool:
    """True if ``name`` is a torch file of another live process (say, a concurrent test run);
    cheap enough to poll, unlike ``shm_holders``.

    torch names its files ``torch_<pid>_<random>_<counter>``; other names carry no owner.
    """
    parts = name.split("_")
    if len(parts) < 3 or parts[0] != "torch" or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    return pid not in ours and os.path.exists(f"/proc/{pid}")


def shm_holders(names: set[str]) -> dict[str, set[int]]:
    """``{name: pids}`` of the processes that have each /dev/shm entry open or mapped."""
    paths = {os.path.join(SHM_DIR, name): name for name in names}
    holders: dict[str, set[int]] = {name: set() for name in names}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                maps = f.read().decode(errors="replace")
            fd_targets = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    fd_targets.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
        except OSError:
            continue  # gone, or not ours to read
        for path, name in paths.items():
            if path in fd_targets or path in maps:
                holders[name].add(pid)
    return holders


def open_fds() -> dict[int, str]:
    """``{fd: target}`` of this process's open file descriptors, helpers excluded."""
    fds: dict[int, str] = {}
    helpers = _helper_fds()
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in helpers:
            continue
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile (the directory handle listdir itself used, for one)
    return fds


@dataclass
class Snapshot:
    children: set[int]  # live descendants, helpers excluded
    known: set[int]  # every descendant, zombies and helpers included
    shm: set[str]
    fds: dict[int, str]

    @classmethod
    def take(cls) -> Snapshot:
        known = set(descendants())
        return cls(children=live_children(), known=known, shm=shm_entries(), fds=open_fds())


@dataclass
class Leaks:
    """What was found left behind, by kind; empty when clean."""

    children: dict[int, str] = field(default_factory=dict)  # pid -> command line
    shm: set[str] = field(default_factory=set)
    fds: dict[int, str] = field(default_factory=dict)  # fd -> target, when over the slack
    fd_growth: int = 0

    def kinds(self) -> list[str]:
        return [kind for kind in LEAK_KINDS if getattr(self, kind)]

    def describe(self, kinds: tuple[str, ...] = LEAK_KINDS) -> str:
        lines = []
        if "children" in kinds and self.children:
            lines.append(f"{len(self.children)} child process(es) still alive:")
            lines += [f"  pid {pid}: {cmd or '?'}" for pid, cmd in sorted(self.children.items())]
        if "shm" in kinds and self.shm:
            lines.append(f"{len(self.shm)} new entr(y/ies) left in {SHM_DIR}:")
            lines += [f"  {SHM_DIR}/{name}" for name in sorted(self.shm)]
        if "fds" in kinds and self.fds:
            lines.append(f"{self.fd_growth} more open file descriptor(s) than before; new ones:")
            lines += [f"  fd {fd} -> {target}" for fd, target in sorted(self.fds.items())]
        return "\n".join(lines)


def _wait_until(predicate, timeout: float, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(interval)


def find_leaks(
    before: Snapshot,
    fd_slack: int = FD_SLACK,
    child_grace: float = CHILD_GRACE_S,
    shm_grace: float = SHM_GRACE_S,
    fd_grace: float = FD_GRACE_S,
) -> Leaks:
    """Compare the present with ``before``, giving each kind of resource time to go away."""
    leaks = Leaks()

    def new_children() -> set[int]:
        reap_zombies(skip=before.known)
        return live_children() - before.children

    _wait_until(lambda: not new_children(), child_grace)
    leaks.children = {pid: _cmdline(pid) for pid in new_children()}

    ours = {os.getpid(), *descendants()}

    def new_shm() -> set[str]:
        return {n for n in shm_entries() - before.shm if not _shm_is_foreign(n, ours)}

    # Dropping the last reference to a shared tensor is what unlinks its file.
    if new_shm():
        gc.collect()
    _wait_until(lambda: not new_shm(), shm_grace)
    leaks.shm = new_shm()
    if leaks.shm:
        # /dev/shm is shared with every process on the machine (another test run, say): an
        # entry that only processes outside our tree hold is theirs. One nobody holds is
        # counted as ours, since nothing tells whose it was.
        for name, pids in shm_holders(leaks.shm).items():
            if pids and not pids & ours:
                leaks.shm.discard(name)

    def fd_growth() -> int:
        return len(open_fds()) - len(before.fds)

    if fd_growth() > fd_slack:
        gc.collect()
        _wait_until(lambda: fd_growth() <= fd_slack, fd_grace)
    growth = fd_growth()
    if growth > fd_slack:
        now = open_fds()
        leaks.fd_growth = growth
        leaks.fds = {fd: t for fd, t in now.items() if before.fds.get(fd) != t}
    return leaks


def kill_children(pids) -> None:
    """SIGKILL leaked processes and reap them, so one leaky test does not slow the rest."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _wait_until(lambda: not (set(pids) & live_children()), 2.0)
    reap_zombies(only=set(pids))


def remove_shm(names) -> None:
    """Unlink leaked /dev/shm entries (after they were reported), except those that another
    process (outside this one's tree) holds or owns by now: /dev/shm is shared with every
    process on the machine, and an entry nobody held a moment ago may be one that a concurrent
    run has just created and not yet mapped."""
    ours = {os.getpid(), *descendants()}
    names = {n for n in names if not _shm_is_foreign(n, ours)}
    for name, pids in shm_holders(names).items():
        if pids - ours:
            continue
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


# -- fixtures ----------------------------------------------------------------------------------
def _enabled() -> bool:
    return os.environ.get("RLCOLLECT_LEAK_CHECK", "1") != "0"


def _allowed_kinds(item: pytest.Item) -> tuple[str, ...]:
    marker = item.get_closest_marker("allow_leaks")
    if marker is None:
        return ()
    kinds = marker.args or LEAK_KINDS
    unknown = set(kinds) - set(LEAK_KINDS)
    if unknown:
        raise pytest.UsageError(f"allow_leaks: unknown kind(s) {sorted(unknown)}; accepted: {list(LEAK_KINDS)}")
    return tuple(kinds)


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; repeated here so that a copy of this conftest works alone.
    config.addinivalue_line(
        "markers",
        "allow_leaks(*kinds): skip the leak check for this test (kinds: children, shm, fds; default all)",
    )


@dataclass
class _SessionAllowance:
    """Resources that tests marked ``allow_leaks`` left on purpose: not the session's leak."""

    children: set[int] = field(default_factory=set)
    shm: set[str] = field(default_factory=set)
    fds: int = 0


@pytest.fixture(scope="session", autouse=True)
def _session_leak_check():
    if not _enabled():
        yield None
        return
    before = Snapshot.take()
    allowance = _SessionAllowance()
    yield allowance
    leaks = find_leaks(before, fd_slack=SESSION_FD_SLACK + allowance.fds)
    leaks.children = {p: c for p, c in leaks.children.items() if p not in allowance.children}
    leaks.shm -= allowance.shm
    if leaks.kinds():
        kill_children(leaks.children)
        remove_shm(leaks.shm)
        pytest.fail("the test session leaked resources:\n" + leaks.describe(), pytrace=False)


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest, _session_leak_check):
    """Fail the test if it leaves child processes, /dev/shm entries or open fds behind."""
    if not _enabled():
        yield
        return
    allowed = _allowed_kinds(request.node)
    before = Snapshot.take()
    yield
    # No grace period for the kinds the test may leak: we only note what it left.
    grace = {
        "child_grace": 0.0 if "children" in allowed else CHILD_GRACE_S,
        "shm_grace": 0.0 if "shm" in allowed else SHM_GRACE_S,
        "fd_grace": 0.0 if "fds" in allowed else FD_GRACE_S,
    }
    leaks = find_leaks(before, **grace)
    if "children" in allowed:
        _session_leak_check.children |= set(leaks.children)
    if "shm" in allowed:
        _session_leak_check.shm |= leaks.shm
    if "fds" in allowed:
        _session_leak_check.fds += max(len(open_fds()) - len(before.fds), 0)
    checked = tuple(kind for kind in leaks.kinds() if kind not in allowed)
    if checked:
        # Clean up what is reported, so that the session check reports only what was not.
        kill_children(leaks.children if "children" in checked else ())
        remove_shm(leaks.shm if "shm" in checked else ())
        pytest.fail(
            f"{request.node.nodeid} leaked resources (mark it allow_leaks if on purpose):\n"
            + leaks.describe(checked),
            pytrace=False,
        )


@pytest.fixture
def leak_checker():
    """The leak-check helpers, for tests of the checker itself."""
    return sys.modules[__name__]
