"""The leak checker, a pytest plugin (registered by conftest.py): a leak check around every test
and around the whole session.

After each test we check that it left behind
- no live child process (descendants of this process, given ~3 s to exit; zombies are reaped),
- no new entry in /dev/shm (torch's ``torch_*`` files, multiprocessing's ``psm_*`` and
  ``sem.*``, replay-buffer directories; given a short grace period) that this process's tree
  made: /dev/shm is the whole machine's, so an entry counts only if this process created it or
  a process of its tree held it, by inode (``ShmTracker``); another program's entries are never
  reported nor removed,
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

import contextlib
import gc
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
from procs import SHM_DIR, cmdline, descendants, read_stat, shm_entries

LEAK_KINDS = ("children", "shm", "fds")
FD_SLACK = 4  # per test: a library may lazily open a file or two on first use
SESSION_FD_SLACK = 32
CHILD_GRACE_S = 3.0
SHM_GRACE_S = 2.0
FD_GRACE_S = 0.5
SHM_POLL_S = 0.05  # how often new /dev/shm entries are attributed to their holders
SHM_UNCLAIMED_S = 5.0  # a new entry nobody of ours held for this long is someone else's
# Long-lived helpers that multiprocessing and torch start on first use and keep for the
# whole interpreter: they are not leaks of the test that happened to start them.
HELPER_CMDLINE_MARKERS = ("resource_tracker", "forkserver", "torch_shm_manager")


# -- measurements (process and /dev/shm basics: procs.py) ---------------------------------------
_read_stat, _cmdline = read_stat, cmdline


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


def _shm_inodes(names=None) -> dict[str, tuple[int, int]]:
    """``{name: (st_dev, st_ino)}`` of the /dev/shm entries (all, or those of ``names`` that exist)."""
    found: dict[str, tuple[int, int]] = {}
    for name in shm_entries() if names is None else names:
        try:
            st = os.stat(os.path.join(SHM_DIR, name), follow_symlinks=False)
        except OSError:
            continue
        found[name] = (st.st_dev, st.st_ino)
    return found


def _shm_is_foreign(name: str, ours: set[int]) -> bool:
    """True if ``name`` is a torch file of another live process (say, a concurrent test run);
    cheap enough to poll, unlike ``shm_holders``.

    torch names its files ``torch_<pid>_<random>_<counter>``; other names carry no owner.
    """
    pid = _torch_creator(name)
    return pid is not None and pid not in ours and os.path.exists(f"/proc/{pid}")


def _torch_creator(name: str) -> int | None:
    parts = name.split("_")
    if len(parts) < 3 or parts[0] != "torch" or not parts[1].isdigit():
        return None
    return int(parts[1])


def _top_inode(path: str, cache: dict[str, tuple[int, int] | None]) -> tuple[int, int] | None:
    """The inode of the /dev/shm entry that contains ``path`` (a directory such as a replay
    buffer's, whose files are what is mapped), or None for a top-level file or a vanished one."""
    rest = path[len(SHM_DIR) + 1 :]
    if "/" not in rest:
        return None
    top = os.path.join(SHM_DIR, rest.split("/", 1)[0])
    if top not in cache:
        try:
            st = os.stat(top, follow_symlinks=False)
            cache[top] = (st.st_dev, st.st_ino)
        except OSError:
            cache[top] = None
    return cache[top]


def held_inodes(pid: int) -> set[tuple[int, int]]:
    """``(st_dev, st_ino)`` of every /dev/shm entry that ``pid`` maps or has open (for a file
    inside a directory there, the directory's too).

    By inode, not by name: glibc's ``sem_open`` maps a temporary file and then links it to
    the semaphore's name, so /proc/PID/maps names ``sem.XXXXXX (deleted)``, not
    ``sem.mp-...``. Empty when ``pid`` is gone or not ours to read.
    """
    held: set[tuple[int, int]] = set()
    tops: dict[str, tuple[int, int] | None] = {}
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            maps = f.read()
    except OSError:
        return held
    marker = SHM_DIR.encode() + b"/"
    if marker in maps:
        for line in maps.splitlines():
            if marker not in line:
                continue
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue
            major, _, minor = fields[3].partition(b":")
            try:
                held.add((os.makedev(int(major, 16), int(minor, 16)), int(fields[4])))
            except ValueError:
                continue
            top = _top_inode(fields[5].decode(errors="replace").removesuffix(" (deleted)"), tops)
            if top is not None:
                held.add(top)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return held
    for fd in fds:
        link = f"/proc/{pid}/fd/{fd}"
        try:
            target = os.readlink(link)
            if not target.startswith(SHM_DIR + "/"):
                continue
            st = os.stat(link)
        except OSError:
            continue
        held.add((st.st_dev, st.st_ino))
        top = _top_inode(target.removesuffix(" (deleted)"), tops)
        if top is not None:
            held.add(top)
    return held


def shm_holders(names: set[str]) -> dict[str, set[int]]:
    """``{name: pids}`` of the processes (whose /proc we may read) that have each /dev/shm entry
    open or mapped, matched by inode."""
    inodes = _shm_inodes(names)
    by_inode: dict[tuple[int, int], str] = {ino: name for name, ino in inodes.items()}
    holders: dict[str, set[int]] = {name: set() for name in names}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            for ino in held_inodes(int(entry)) & by_inode.keys():
                holders[by_inode[ino]].add(int(entry))
    return holders


class ShmTracker:
    """Which /dev/shm entries this process's tree made, told apart from everyone else's.

    /dev/shm is shared with every process on the machine (another test run, any program using
    multiprocessing): an entry is this tree's only if
    - this process created it (an ``open``/``os.open`` for writing, seen by an audit hook), or
    - a process of this tree had it open or mapped, matched by inode (``held_inodes``), seen by
      a poll every ``SHM_POLL_S`` while the entry was new and unclaimed, and once more at each
      check, or
    - it is a torch file (``torch_<pid>_...``) whose creator pid was seen in this tree.
    Everything else is never reported nor removed. The blind spot: a child process that writes
    a plain file into /dev/shm and closes it within one poll, without mapping it.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.created: set[str] = set()  # names this process opened for writing (audit hook)
        self.claimed: dict[str, tuple[int, int]] = {}  # name -> inode held by our tree
        self.tree_pids: set[int] = {self.pid}  # every pid seen in our tree
        self._first_seen: dict[str, float] = {}  # unclaimed new entries -> when first seen
        self._known = _shm_inodes()  # entries older than the tracker: never ours
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- creator: this very process ------------------------------------------------------------
    def _audit(self, event: str, args: tuple) -> None:
        # Runs in every process forked from this one too, and may run while the poll holds its
        # lock: no lock here, only an atomic set.add in the tracker's own process.
        if event not in ("open", "os.mkdir") or os.getpid() != self.pid or not args:
            return
        path = os.fspath(args[0]) if isinstance(args[0], (str, os.PathLike)) else None
        if not isinstance(path, str) or not path.startswith(SHM_DIR + "/"):
            return
        mode, flags = (tuple(args[1:]) + (None, None))[:2]
        writing = event == "os.mkdir" or (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & (os.O_CREAT | os.O_WRONLY | os.O_RDWR)
        )
        if writing:
            self.created.add(path[len(SHM_DIR) + 1 :].split("/", 1)[0])

    # -- holders: the whole tree ---------------------------------------------------------------
    def poll(self, names: set[str] | None = None) -> None:
        """Claim the new entries that a process of our tree holds now: all of ``names``, or (the
        periodic poll) those that appeared less than ``SHM_UNCLAIMED_S`` ago."""
        with self._lock:
            now = time.monotonic()
            present = _shm_inodes(names)
            pending = {
                name: ino
                for name, ino in present.items()
                if self._known.get(name) != ino and self.claimed.get(name) != ino and name not in self.created
            }
            if names is None:
                for name in list(self._first_seen):
                    if name not in pending:
                        del self._first_seen[name]
                # An entry unclaimed for long is someone else's: stop paying to look at it.
                pending = {
                    n: i for n, i in pending.items() if now - self._first_seen.setdefault(n, now) < SHM_UNCLAIMED_S
                }
            if not pending:
                return
            tree = {self.pid, *descendants(self.pid)}
            self.tree_pids |= tree
            held: set[tuple[int, int]] = set()
            for pid in tree:
                held |= held_inodes(pid)
            for name, ino in pending.items():
                if ino in held or _torch_creator(name) in self.tree_pids:
                    self.claimed[name] = ino

    def ours(self, names: set[str]) -> set[str]:
        """Those of ``names`` (present entries) that this tree made."""
        self.poll(set(names))
        inodes = _shm_inodes(names)
        with self._lock:
            return {
                name
                for name, ino in inodes.items()
                if name in self.created or self.claimed.get(name) == ino or _torch_creator(name) in self.tree_pids
            }

    def _run(self) -> None:
        while not self._stop.wait(SHM_POLL_S):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a racing /proc read must not end the tracking
                pass

    def start(self) -> ShmTracker:
        sys.addaudithook(self._audit)
        self._thread = threading.Thread(target=self._run, name="leak-check-shm", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


_TRACKER: ShmTracker | None = None


def shm_tracker() -> ShmTracker:
    """The process-wide tracker, started on first use (audit hooks cannot be removed: one only)."""
    global _TRACKER
    if _TRACKER is None or _TRACKER.pid != os.getpid():
        _TRACKER = ShmTracker().start()
    return _TRACKER


def open_fds() -> dict[int, str]:
    """``{fd: target}`` of this process's open file descriptors, helpers excluded."""
    fds: dict[int, str] = {}
    helpers = _helper_fds()
    tracker = _TRACKER if _TRACKER is not None and _TRACKER.pid == os.getpid() else None
    # Under the tracker's lock: its poll (a thread) opens an fd or two for a moment.
    with tracker._lock if tracker is not None else contextlib.nullcontext():
        names = os.listdir("/proc/self/fd")
        targets = {}
        for name in names:
            try:
                targets[name] = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                continue  # closed meanwhile (the directory handle listdir itself used, for one)
    for name, target in targets.items():
        if int(name) not in helpers:
            fds[int(name)] = target
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
    tracker = shm_tracker()

    def new_shm() -> set[str]:
        # Only what this tree made (see ShmTracker): /dev/shm is the whole machine's.
        return tracker.ours(shm_entries() - before.shm)

    # Dropping the last reference to a shared tensor is what unlinks its file.
    if new_shm():
        gc.collect()
    _wait_until(lambda: not new_shm(), shm_grace)
    leaks.shm = new_shm()
    if leaks.shm:
        # Ours, but held now only by processes outside our tree (a daemon that double-forked
        # away, say): theirs to clean up.
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
    """Unlink leaked /dev/shm entries (after they were reported), but only those this tree
    made (``ShmTracker``, same inode) and that no process outside this tree holds by now:
    /dev/shm is shared with every process on the machine."""
    ours = {os.getpid(), *descendants()}
    names = shm_tracker().ours(set(names))
    for name, pids in shm_holders(names).items():
        if pids - ours:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
        except OSError:
            continue
        if os.environ.get("RLCOLLECT_LEAK_LOG"):  # for tests/security/test_busy_machine.py
            with open(os.environ["RLCOLLECT_LEAK_LOG"], "a") as log:
                log.write(name + "\n")


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
    shm_tracker()  # from the first test on: what the tree holds is attributed as it appears
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
