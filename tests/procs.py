"""Process and /dev/shm helpers shared by every test folder (and the leak checker, leaks.py):
is a pid alive, what runs below a process, wait for pids to be gone, what /dev/shm holds; and
the ``own_tmpdir`` fixture (a TMPDIR for a process a test kills). Read from /proc: Linux only, as
the tests that use them."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM_DIR = "/dev/shm"


def read_stat(pid: int) -> tuple[str, int] | None:
    """``(state, ppid)`` of ``pid`` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = data[data.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not reaped) counts as dead."""
    stat = read_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def descendants(root: int | None = None) -> dict[int, str]:
    """``{pid: state}`` of every process below ``root`` (default: this process)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    states: dict[int, str] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = read_stat(int(name))
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


def children(pid: int) -> list[int]:
    """The direct children of ``pid`` (any state), from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = read_stat(int(name))
            if stat is not None and stat[1] == pid:
                out.append(int(name))
    return out


def state(pid: int) -> str:
    """The /proc state letter of ``pid`` (``"T"`` stopped, ``"Z"`` zombie, ...), ``"gone"`` once it is."""
    stat = read_stat(pid)
    return "gone" if stat is None else stat[0]


def live_descendants(root: int | None = None) -> set[int]:
    """The live (non-zombie) processes below ``root`` (default: this process)."""
    return {pid for pid, state in descendants(root).items() if state not in ("Z", "X")}


def wait_gone(pids, timeout: float = 5.0) -> list[int]:
    """Wait up to ``timeout`` s for every pid to die; return those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if pid_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if pid_alive(p)]
    return alive


def assert_gone(pids, timeout: float = 5.0) -> None:
    alive = wait_gone(pids, timeout)
    assert not alive, f"processes {alive} still alive {timeout} s after shutdown"


def shm_entries() -> set[str]:
    """The names in /dev/shm now."""
    try:
        return set(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return set()


@pytest.fixture
def own_tmpdir() -> Iterator[Path]:
    """A fresh folder to give a child process as its TMPDIR, removed after the test (import it
    into the test module). A SIGKILLed Python process never removes the temp folder that
    multiprocessing made for it (``pymp-*``: its fork server's address, the listener that hands
    tensors' file descriptors on), so a test that kills one on purpose points it here. Short, in
    the temp folder and not under ``tmp_path``: multiprocessing makes AF_UNIX sockets in it,
    whose paths may not pass 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="rlc-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def end_processes(*procs) -> None:
    """Kill each ``subprocess.Popen`` still running (None: skipped), reap it and close its pipes:
    a test's ``finally`` for the processes it started."""
    for p in procs:
        if p is not None:
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdin, p.stdout, p.stderr):
                if f is not None:
                    f.close()
