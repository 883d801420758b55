"""Whether a process still runs, for the watchdogs (a worker or node watching the process that
started it) and the replay buffer (a writer holding slots); and the removal of a process's
multiprocessing temp folder before an ``os._exit``.  Only ``os``: workers import it before
anything heavy."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped) counts as dead.

    Example:
        >>> pid_alive(os.getpid())
        True
    """
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")
    except OSError:
        return True  # no /proc: os.kill found the process


def remove_multiprocessing_temp_dir() -> None:
    """Remove the ``pymp-*`` folder that multiprocessing made for this process (its fork
    server's address, or the listener that hands shared tensors' file descriptors to other
    processes), which the interpreter's teardown removes and an ``os._exit`` leaves behind.
    Only right before ``os._exit``: what is still listening there stops working."""
    import multiprocessing.util
    import shutil

    # (made now if this process made none: removed all the same)
    shutil.rmtree(multiprocessing.util.get_temp_dir(), ignore_errors=True)
