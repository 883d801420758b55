"""No worker outlives the main process: a guard process per worker pool.

A worker's own watchdog thread (worker.py) starts only once the worker runs rlcollect code,
which with "spawn" and "forkserver" comes after the worker has imported the main module and
torch (seconds). The guard closes that gap: a tiny standard-library process, started before the
first worker, holding the read end of a pipe whose only write end is in the main process. When
the main process dies, however it dies, the kernel closes that end, the guard reads end of file
and SIGKILLs every worker (and the fork server) registered with it. A pool that shuts down
normally unregisters its processes first, so closing the pipe then kills nothing.

Example:
    >>> import subprocess, sys
    >>> child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    >>> guard = Reaper()
    >>> guard.watch(child.pid)
    >>> guard.close(kill=True)  # what the main process's death does
    >>> child.wait(5)
    -9
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import weakref

logger = logging.getLogger("rlcollect")

_MAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_reaper_main.py")
_live: weakref.WeakSet[Reaper] = weakref.WeakSet()


def _close_in_fork_child() -> None:
    # A process forked from the main process ("fork" workers) must not hold the pipe open: the
    # guard would never see end of file. A raw fd (no file object, no lock) is safe to close here.
    for reaper in list(_live):
        fd, reaper._fd = reaper._fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


os.register_at_fork(after_in_child=_close_in_fork_child)


def _start_time(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rfind(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0  # no /proc: the guard then kills without checking for a recycled pid


class Reaper:
    """The guard process of one pool: ``watch(pid)`` after a process starts, ``forget(pid)``
    once it has been reaped, ``close()`` at shutdown."""

    def __init__(self):
        read_fd, self._fd = os.pipe()
        self._lock = threading.Lock()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", _MAIN], stdin=read_fd, stdout=subprocess.DEVNULL,
                close_fds=True, start_new_session=True,  # out of the terminal's Ctrl-C
            )
        except BaseException:
            os.close(self._fd)
            self._fd = -1
            raise
        finally:
            os.close(read_fd)
        _live.add(self)

    @property
    def pid(self) -> int:
        return self._process.pid

    def _send(self, line: str) -> None:
        with self._lock:
            if self._fd < 0:
                return
            try:
                os.write(self._fd, line.encode())  # one short line: a single atomic write
            except OSError as err:
                logger.warning("rlcollect: the worker guard process is gone (%s); workers now rely on their "
                               "own watchdog to end with the main process", err)
                os.close(self._fd)
                self._fd = -1

    def watch(self, pid: int) -> None:
        """SIGKILL ``pid`` if the main process dies before ``forget(pid)``."""
        self._send(f"+ {pid} {_start_time(pid)}\n")

    def forget(self, pid: int) -> None:
        self._send(f"- {pid}\n")

    def close(self, kill: bool = False, timeout: float = 5.0) -> None:
        """End the guard (``kill=True``: as if the main process died, killing what it watches)."""
        if not kill:
            self._send("clear\n")
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
        _live.discard(self)
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
