"""Shared-memory batch slots: where a batch crosses the process boundary.

Each slot is one flat shared-memory byte tensor (one file descriptor, not one per field),
carved (rlcollect/data.py) into the typed ``(n, T, *feature)`` arrays of a :class:`BatchLayout`.
This module allocates them (once, before collecting; when nothing refers to one any more is
told by rlcollect/multiprocess/slots.py, which lends them).  The main process allocates the
slots once from the layout a worker reports; the worker writes a batch into a
slot and only sends a short "ready" reply.

A *stacked* slot holds the batches of ``parts`` workers with the same layout field by field:
field ``k`` is one ``(parts, n, T, *feature)`` block, and worker ``i`` writes the ``i``-th
``(n, T, *feature)`` of each (it is handed a :class:`SlotPart`). The stacked batch is then a
view of the slot (``data.stacked_tensors``): nothing is copied to gather it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re

import torch

from rlcollect.data import BatchLayout, field_bytes, stacked_layout

__all__ = ["SHM_DIR", "POISON", "allocate_slot", "allocate_stacked", "check_free_space", "slot_bytes"]

#: Where torch's shared memory lives (``shm_open``); its free space is checked before allocating.
SHM_DIR = "/dev/shm"
_TORCH_SHM_FILE = re.compile(r"for file </?(torch_\d+_\d+_\d+)>")
#: Fresh slots are filled with this byte so that a field nobody wrote shows up in tests.
POISON = 0xA5


def slot_bytes(layout: BatchLayout) -> int:
    """The size of one slot of ``layout`` in bytes."""
    return field_bytes(layout)[1]


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def _full(needed: int, free: int | None, what: str) -> OSError:
    have = f"only {_human(free)} are free" if free is not None else "the allocation failed (it is full)"
    return OSError(errno.ENOSPC, (
        f"not enough shared memory for {what}: {_human(needed)} are needed in {SHM_DIR} but {have}. Free space "
        f"there (leftovers of killed programs?), make it bigger (docker run --shm-size=...), or lower "
        f"frames_per_batch or num_workers"))


def check_free_space(needed: int, what: str) -> None:
    """Raise ``OSError(ENOSPC)`` naming ``what`` if :data:`SHM_DIR` has less than ``needed`` bytes free.

    Example:
        >>> check_free_space(64, "a tiny slot")  # fine: returns None
        >>> try:
        ...     check_free_space(1 << 62, "an absurd slot")
        ... except OSError as err:
        ...     print(err.errno == errno.ENOSPC, "an absurd slot" in str(err))
        True True
    """
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return  # no such folder (not Linux): torch reports what it cannot allocate
    free = stat.f_bavail * stat.f_frsize
    if free < needed:
        raise _full(needed, free, what)


def allocate_slot(layout: BatchLayout) -> torch.Tensor:
    """One flat shared-memory slot big enough for a batch of ``layout``."""
    _, total = field_bytes(layout)
    try:
        flat = torch.empty(total, dtype=torch.uint8).share_memory_()
    except RuntimeError as err:
        # torch leaves the file it could not grow in /dev/shm: remove it (only one of ours).
        found = _TORCH_SHM_FILE.search(str(err))
        if found and found.group(1).startswith(f"torch_{os.getpid()}_"):
            try:
                os.unlink(os.path.join(SHM_DIR, found.group(1)))
            except OSError:
                pass
        if "No space left" in str(err) or "unable to allocate shared memory" in str(err):
            raise _full(total, None, f"a batch slot ({_human(total)})") from err
        raise
    flat.fill_(POISON)
    return flat


def allocate_stacked(layout: BatchLayout, parts: int) -> torch.Tensor:
    """One flat shared-memory slot for the batches of ``parts`` workers of ``layout``, stacked."""
    return allocate_slot(stacked_layout(layout, parts))


@contextlib.contextmanager
def unclaimed_fds_closed_on_failure():
    """Close, if the block raises, the shared-memory file descriptors it handed to a worker
    that never took them.

    A shared tensor sent over a pipe travels as a file descriptor: multiprocessing's resource
    sharer keeps a duplicate of it until the receiving process asks for it while unpickling. A
    worker killed before it reads its message never asks, and the duplicates (each holding its
    segment's memory) would stay open in this process until it exits. On an exception, the
    duplicates registered during the block are closed; the pool sends one request at a time,
    so they are the dead worker's.

    Example:
        >>> with unclaimed_fds_closed_on_failure():
        ...     pass
    """
    from multiprocessing import resource_sharer

    sharer = getattr(resource_sharer, "_resource_sharer", None)
    cache = getattr(sharer, "_cache", None)
    if not isinstance(cache, dict):  # not CPython's layout: nothing we can reclaim
        yield
        return
    before = set(cache)
    try:
        yield
    except BaseException:
        with sharer._lock:
            stale = [cache.pop(key) for key in set(cache) - before]
        for _send, close in stale:
            with contextlib.suppress(OSError):
                close()
        raise
