"""Lifetime helpers of a replay buffer's storage: where shared storage lives, the reaper that
removes it when its owner dies, the finalizer that unmaps (and, in the owner, removes) it.  (Which
ring slots a write takes, and whether their writer still runs, is seqlock.py's.)

The reaper: the process that creates a storage directory (/dev/shm, or a temporary memmap
directory) starts one tiny process per buffer, *before* the directory exists, and keeps the
only write end of a pipe whose read end is the reaper's stdin.  However the owner ends (close,
garbage collection, exit, an exception, SIGKILL, the OOM killer) the kernel closes that write
end; the reaper then reads EOF, removes the directory (a no-op after a clean close) and exits.
Forked children close their copies of the write end at the fork, so that only the owner's
death counts.  Writers never own storage: their death leaves nothing behind (the kernel
releases the lock they may hold; their slots are taken over, see seqlock.py).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile

from rlcollect.buffers.storage import Region

#: How long ``close()`` waits for the reaper to exit once told (it exits in milliseconds).
REAPER_EXIT_TIMEOUT_S = 10.0

# A POSIX shell, not Python: it starts in ~2 ms where an interpreter takes 20-200 ms, and every
# buffer pays it.  It ignores the signals that a terminal or a job killer sends to a whole
# group (it must outlive its owner by the time of one rm, and ends at EOF however the owner
# ends); ``read`` returns non-zero at EOF, and the owner never writes.
_REAPER_SCRIPT = 'trap "" INT TERM HUP QUIT; while read -r _; do :; done; exec rm -rf -- "$1"'
REAPER_NAME = "rlcollect-rb-reaper"  # its $0: what ps shows
# The same in Python, where there is no /bin/sh (a distroless image, say).
_REAPER_PYTHON = """
import os, shutil, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
    signal.signal(sig, signal.SIG_IGN)
while os.read(0, 512):
    pass
shutil.rmtree(sys.argv[1], ignore_errors=True)
"""


SHELL = "/bin/sh"


def _reaper_argv(directory: str) -> list[str]:
    if os.access(SHELL, os.X_OK):
        return [SHELL, "-c", _REAPER_SCRIPT, REAPER_NAME, directory]
    return [sys.executable, "-I", "-S", "-c", _REAPER_PYTHON, directory]

_WRITE_ENDS: set[int] = set()  # the reapers' pipes this process holds: closed in forked children


def _close_write_ends_in_child() -> None:
    for fd in list(_WRITE_ENDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _WRITE_ENDS.clear()


os.register_at_fork(after_in_child=_close_write_ends_in_child)


class Reaper:
    """A process that removes ``directory`` when this process dies or calls :meth:`stop`.

    Example:
        >>> import os
        >>> reaper = Reaper(os.path.join(tempfile.gettempdir(), "rlcollect-reaper-doc"))
        >>> os.mkdir(reaper.directory)
        >>> reaper.stop()  # as if the owner had died: the directory is removed
        >>> os.path.exists(reaper.directory), reaper.process.poll()
        (False, 0)
    """

    def __init__(self, directory: str):
        self.directory = directory
        read_end, write_end = os.pipe()  # both non-inheritable: no other child gets them
        try:
            self.process = subprocess.Popen(
                _reaper_argv(directory),
                stdin=read_end,
                stdout=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,  # not in the owner's process group: Ctrl-C spares it
            )
        except BaseException:
            os.close(write_end)
            raise
        finally:
            os.close(read_end)
        self._write_end = write_end
        self._pid = os.getpid()
        _WRITE_ENDS.add(write_end)

    def stop(self) -> None:
        """Tell the reaper to remove the directory and exit, and wait for it (idempotent; only
        in the process that started it)."""
        if os.getpid() != self._pid:
            return
        if self._write_end >= 0:
            fd, self._write_end = self._write_end, -1
            _WRITE_ENDS.discard(fd)
            os.close(fd)
        try:
            self.process.wait(timeout=REAPER_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # never seen: only a stopped reaper could do this
            self.process.kill()
            self.process.wait()
            shutil.rmtree(self.directory, ignore_errors=True)


def shm_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def make_storage_dir(root: str | None) -> tuple[str, Reaper]:
    """A new private directory ``rlcollect-rb-<pid>-<random>`` under ``root`` (None: the
    temporary directory), with its reaper already running (so no death leaves it behind)."""
    root = tempfile.gettempdir() if root is None else root
    directory = os.path.join(root, f"rlcollect-rb-{os.getpid()}-{secrets.token_hex(6)}")
    reaper = Reaper(directory)
    try:
        os.mkdir(directory, 0o700)
    except BaseException:
        reaper.stop()
        raise
    return directory, reaper


def release(region: Region, remove: str | None, owner_pid: int, reaper: Reaper | None = None) -> None:
    """Finalizer: unmap, and remove the directory if this process created it."""
    region.close()
    # The pid check keeps a forked child (which inherits this finalizer) from deleting the
    # parent's storage when its copy of the buffer is collected.
    if remove is not None and os.getpid() == owner_pid:
        shutil.rmtree(remove, ignore_errors=True)
        if reaper is not None:
            reaper.stop()
