"""Lifetime helpers of a replay buffer's storage: where shared storage lives, the finalizer
that unmaps (and, in the owner, removes) it, and the ring slots of a write (whether a writer's
process still runs: ``rlcollect._pids``)."""

from __future__ import annotations

import os
import shutil

from rlcollect.buffers.storage import Region


def shm_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def release(region: Region, remove: str | None, owner_pid: int) -> None:
    """Finalizer: unmap, and remove the directory if this process created it."""
    region.close()
    # The pid check keeps a forked child (which inherits this finalizer) from deleting the
    # parent's storage when its copy of the buffer is collected.
    if remove is not None and os.getpid() == owner_pid:
        shutil.rmtree(remove, ignore_errors=True)


def ring_segments(first: int, count: int, capacity: int) -> list[tuple[int, int]]:
    """The ring slots ``first, first+1, ... (count of them)`` as at most two slices."""
    end = first + count
    if end <= capacity:
        return [(first, end)]
    return [(first, capacity), (0, end - capacity)]
