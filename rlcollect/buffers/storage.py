"""Where a ReplayBuffer's frames live: a directory of memory-mapped files that processes share.

A shared region is a directory (under /dev/shm for ``storage="memory"``, anywhere on disk for
``storage="memmap"``) holding three files:

``control``
    int64 words: a small header (capacity, allocated flag, cursor, size, write count), then one
    sequence number and one owner pid per slot.  It exists from construction on, so every
    process can read the counters before any frame has been written.  It is also the file that
    ``fcntl.flock`` locks for cross-process mutual exclusion (through a file description of
    its own in each process, never shared with a forked child: see :meth:`Region.lock`).
``layout.json``
    the fields (nested key, per-frame shape, torch dtype, byte offset), written once by the
    first writer, from the structure of the first batch.  JSON rather than pickle: reopening a
    memmap directory must not execute anything it finds there.
``data``
    every field as a ``(capacity, *shape)`` array at an aligned offset of one flat file.  One
    file, not one per field: Python's ``mmap`` keeps a duplicate of the file descriptor for the
    life of the map, so one file costs one fd per process whatever the number of keys.

A :class:`Region` is one process's view of such a directory; the process that writes the first
batch allocates ``data`` (under the lock), the others map it when they see the allocated flag.
:meth:`Region.private` is the same interface over plain process memory (``shared=False``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

NestedKey = tuple[str, ...]

# Header words of the control file (HOLDER: pid of the process inside the lock, 0 if none).
MAGIC, VERSION, CAPACITY, ALLOCATED, CURSOR, SIZE, WRITE_COUNT, HOLDER = range(8)
HEADER_WORDS = 8
MAGIC_VALUE = 0x726C63726231  # b"rlcrb1"
FORMAT_VERSION = 1
_ALIGN = 64

CONTROL_FILE, LAYOUT_FILE, DATA_FILE = "control", "layout.json", "data"


#: How long a process waits for the buffer's cross-process lock before raising LockTimeout.
DEFAULT_LOCK_TIMEOUT_S = 30.0


class StorageMismatch(ValueError):
    """A directory or a batch does not match the buffer it is meant for."""


class LockTimeout(TimeoutError):
    """The replay buffer's lock was not acquired within ``lock_timeout``.

    Attributes: ``pid`` (the process holding the lock, or None if it cannot be told), ``timeout``
    (seconds waited) and ``path`` (the control file).  The lock is held only for microseconds
    by a working process, so this means its holder is stopped (SIGSTOP, a debugger) or stuck.

    Example:
        >>> err = LockTimeout("/dev/shm/rlcollect-rb-1/control", 30.0, 1234, "stopped")
        >>> isinstance(err, TimeoutError), err.pid
        (True, 1234)
    """

    def __init__(self, path: str, timeout: float, pid: int | None, state: str):
        self.path, self.timeout, self.pid = path, timeout, pid
        holder = f"pid {pid} ({state})" if pid is not None else state
        super().__init__(
            f"could not take the ReplayBuffer lock ({path}) within lock_timeout={timeout:g} s: it is held by "
            f"{holder}.  Resume or kill that process, or pass ReplayBuffer(..., lock_timeout=...) a larger "
            "value if it is only slow"
        )


_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible sleep", "T": "stopped", "t": "stopped by a tracer"}


def _process_state(pid: int) -> str | None:
    """``"stopped"``, ``"running"``, ... for a live ``pid``; None if it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    state = stat[stat.rfind(")") + 2 : stat.rfind(")") + 3]
    return None if state in ("Z", "X", "") else _STATES.get(state, f"state {state}")


def _flock_holders(fd: int) -> list[int]:
    """Pids that /proc/locks lists as holding an flock on the file of ``fd`` (the process that
    took it; a forked child sharing the description is not named)."""
    st = os.fstat(fd)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    try:
        with open("/proc/locks") as f:
            for line in f:
                parts = line.split()
                # "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF" ("->" marks a waiter)
                if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == ident and parts[4].isdigit():
                    pids.append(int(parts[4]))
    except OSError:
        pass
    return pids


# Every Region with a lock fd, so that a forked child closes its copies at once: flock locks
# belong to the open file description, and a child holding a copy would keep the lock of a
# holder that died (or make parent and child not exclude each other).
_LOCKING: weakref.WeakSet[Region] = weakref.WeakSet()


def _close_lock_fds_in_child() -> None:
    for region in list(_LOCKING):
        region._after_fork()


os.register_at_fork(after_in_child=_close_lock_fds_in_child)


@dataclass(frozen=True)
class Field:
    key: NestedKey
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0

    def nbytes(self, capacity: int) -> int:
        return capacity * int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """The per-frame structure of a buffer: its fields, in a fixed order, with byte offsets.

    Example:
        >>> layout = Layout.build({("obs",): ((4,), torch.float32), ("next", "done"): ((1,), torch.bool)}, 10)
        >>> [(f.key, f.offset) for f in layout.fields], layout.nbytes(10)
        ([(('next', 'done'), 0), (('obs',), 64)], 224)
    """

    fields: tuple[Field, ...]

    @classmethod
    def of(cls, frames: dict[NestedKey, torch.Tensor], capacity: int) -> Layout:
        """The layout of ``{key: (k, *shape) tensor}``, with offsets for ``capacity`` slots."""
        return cls.build({key: (tuple(v.shape[1:]), v.dtype) for key, v in frames.items()}, capacity)

    @classmethod
    def build(cls, specs: dict[NestedKey, tuple[tuple[int, ...], torch.dtype]], capacity: int) -> Layout:
        """Fields in key order, each at the next aligned offset after the previous one."""
        fields, offset = [], 0
        for key in sorted(specs):
            shape, dtype = specs[key]
            spec = Field(key, tuple(shape), dtype, offset)
            fields.append(spec)
            offset += (spec.nbytes(capacity) + _ALIGN - 1) // _ALIGN * _ALIGN
        return cls(tuple(fields))

    def signature(self) -> dict[NestedKey, tuple[tuple[int, ...], torch.dtype]]:
        return {f.key: (f.shape, f.dtype) for f in self.fields}

    def nbytes(self, capacity: int) -> int:
        if not self.fields:
            return 0
        last = self.fields[-1]
        return last.offset + last.nbytes(capacity)

    def to_json(self) -> list:
        return [[list(f.key), list(f.shape), str(f.dtype).removeprefix("torch."), f.offset] for f in self.fields]

    @classmethod
    def from_json(cls, data: list) -> Layout:
        fields = []
        for key, shape, dtype, offset in data:
            torch_type = getattr(torch, dtype, None)
            if not isinstance(torch_type, torch.dtype):
                raise StorageMismatch(f"layout names an unknown dtype {dtype!r}")
            fields.append(Field(tuple(key), tuple(int(s) for s in shape), torch_type, int(offset)))
        return cls(tuple(fields))

    def difference(self, other: Layout) -> str:
        """What differs between two layouts, in words (empty when they match)."""
        mine, theirs = self.signature(), other.signature()
        parts = []
        if missing := sorted(set(mine) - set(theirs)):
            parts.append(f"missing keys {[_show(k) for k in missing]}")
        if extra := sorted(set(theirs) - set(mine)):
            parts.append(f"unexpected keys {[_show(k) for k in extra]}")
        for key in sorted(set(mine) & set(theirs)):
            if mine[key] != theirs[key]:
                (s0, d0), (s1, d1) = mine[key], theirs[key]
                parts.append(f"{_show(key)}: expected shape {s0} {d0}, got {s1} {d1}")
        return "; ".join(parts)


def _show(key: NestedKey) -> str | NestedKey:
    return key[0] if len(key) == 1 else key


class Region:
    """One process's view of a buffer's storage: counters, per-slot seqlocks, the field tensors.

    ``header``, ``seq`` and ``owner`` are int64 numpy arrays; ``tensors`` maps each nested key to
    a ``(capacity, *shape)`` tensor (empty until the first batch fixes the layout).  All the
    mutation protocols (reserve, commit) are in :mod:`rlcollect.buffers.replay`; this class only
    knows how to create, map, lock and unmap the memory.

    Example:
        >>> import shutil, tempfile
        >>> region = Region.create(tempfile.mkdtemp(), capacity=4)
        >>> with region.lock():
        ...     region.allocate(Layout.build({("x",): ((), torch.int64)}, 4))
        >>> other = Region.open(region.directory)  # as another process would
        >>> other.attach(); other.tensors[("x",)].shape
        torch.Size([4])
        >>> other.close(); region.close(); shutil.rmtree(region.directory)
    """

    def __init__(self, capacity: int, directory: str | None):
        self.capacity = capacity
        self.directory = directory
        self.layout: Layout | None = None
        self.signature: dict[NestedKey, tuple[torch.Size, torch.dtype]] = {}
        self.tensors: dict[NestedKey, torch.Tensor] = {}
        self._maps: list[mmap.mmap] = []
        self._fd = -1  # the lock's fd: -1 in a private region, or until reopened after a fork
        self._lock_path: str | None = None  # the control file, for a shared region
        self.lock_timeout = DEFAULT_LOCK_TIMEOUT_S
        self._pid = os.getpid()
        self._thread_lock = threading.Lock()
        self.header = self.seq = self.owner = None

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def private(cls, capacity: int) -> Region:
        """Process-private storage (``shared=False``): same interface, no files, a thread lock."""
        region = cls(capacity, None)
        control = np.zeros(HEADER_WORDS + 2 * capacity, dtype=np.int64)
        region._set_control(control)
        region.header[[MAGIC, VERSION, CAPACITY]] = (MAGIC_VALUE, FORMAT_VERSION, capacity)
        return region

    @classmethod
    def create(cls, directory: str, capacity: int) -> Region:
        """A fresh control file in ``directory`` (which must exist and hold no buffer)."""
        region = cls(capacity, directory)
        path = os.path.join(directory, CONTROL_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _reserve_space(fd, (HEADER_WORDS + 2 * capacity) * 8, path)
            region._map_control(fd, path)
        finally:
            os.close(fd)
        region.header[[MAGIC, VERSION, CAPACITY]] = (MAGIC_VALUE, FORMAT_VERSION, capacity)
        return region

    @classmethod
    def open(cls, directory: str, capacity: int | None = None) -> Region:
        """Map the control file of an existing buffer directory (``capacity`` checked if given)."""
        path = os.path.join(directory, CONTROL_FILE)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_WORDS * 8:
                raise StorageMismatch(f"{path} is not a ReplayBuffer control file ({size} bytes)")
            head = np.frombuffer(os.pread(fd, HEADER_WORDS * 8, 0), dtype=np.int64)
            if head[MAGIC] != MAGIC_VALUE or head[VERSION] != FORMAT_VERSION:
                raise StorageMismatch(f"{path} is not a ReplayBuffer control file (format {FORMAT_VERSION})")
            stored = int(head[CAPACITY])
            if capacity is not None and stored != capacity:
                raise StorageMismatch(
                    f"capacity={capacity} does not match the buffer stored in {directory} "
                    f"(capacity {stored}); pass capacity={stored} or use another path"
                )
            if size != (HEADER_WORDS + 2 * stored) * 8:
                raise StorageMismatch(f"{path} has {size} bytes, expected {(HEADER_WORDS + 2 * stored) * 8}")
            region = cls(stored, directory)
            region._map_control(fd, path)
        finally:
            os.close(fd)
        return region

    def _map_control(self, fd: int, path: str) -> None:
        mm = mmap.mmap(fd, 0)  # keeps a duplicate of fd: its description is not the lock's
        self._maps.append(mm)
        self._set_control(np.frombuffer(mm, dtype=np.int64))
        self._lock_path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        _LOCKING.add(self)

    def _set_control(self, control: np.ndarray) -> None:
        cap = self.capacity
        self.header = control[:HEADER_WORDS]
        self.seq = control[HEADER_WORDS : HEADER_WORDS + cap]
        self.owner = control[HEADER_WORDS + cap : HEADER_WORDS + 2 * cap]

    # -- locking ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive across threads (a thread lock) and processes (flock on the control file).

        Waits at most ``self.lock_timeout`` seconds, then raises :class:`LockTimeout` naming the
        holder's pid.  A holder that dies releases the lock at once (the kernel drops an flock
        when the last fd of its description closes, and no other process has one: forked
        children close their copies at the fork).
        """
        if self._pid != os.getpid():
            self._after_fork()
        timeout = self.lock_timeout
        deadline = time.monotonic() + timeout
        if not self._thread_lock.acquire(timeout=timeout):
            raise LockTimeout(self._lock_path or "private", timeout, os.getpid(), "another thread of this process")
        try:
            if self._lock_path is None:
                yield
                return
            if self._fd < 0:
                self._fd = os.open(self._lock_path, os.O_RDWR | os.O_CLOEXEC)
            self._flock(deadline, timeout)
            try:
                self.header[HOLDER] = os.getpid()
                yield
            finally:
                if self.header is not None:
                    self.header[HOLDER] = 0
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def _flock(self, deadline: float, timeout: float) -> None:
        # Polled (LOCK_NB) rather than blocking: a blocking flock cannot be given a timeout
        # without signals.  Uncontended, this is the same single syscall.
        delay = 0.0001
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timeout_error(timeout)
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.005)

    def _timeout_error(self, timeout: float) -> LockTimeout:
        named = int(self.header[HOLDER])
        for pid in [named, *_flock_holders(self._fd)]:
            state = _process_state(pid) if pid > 0 else None
            if state is not None:
                return LockTimeout(self._lock_path, timeout, pid, state)
        return LockTimeout(
            self._lock_path,
            timeout,
            None,
            "a process that cannot be named (its last holder, pid %d, is gone; a process it forked "
            "outside rlcollect may keep the lock)" % named,
        )

    def _after_fork(self) -> None:
        # A forked child shares the parent's open file description, and flock() locks belong to
        # the description: the child closes its copy (reopened at its first lock()).  The maps
        # themselves are MAP_SHARED and stay valid.
        self._pid = os.getpid()
        self._thread_lock = threading.Lock()
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    # -- the data file -----------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return self.layout is not None

    def allocate(self, layout: Layout) -> None:
        """Create the data storage for ``layout``.  Call under :meth:`lock`, when not allocated."""
        nbytes = layout.nbytes(self.capacity)
        if self.directory is None:
            self._set_tensors(layout, torch.zeros(max(nbytes, 1), dtype=torch.uint8).numpy())
        else:
            layout_path = os.path.join(self.directory, LAYOUT_FILE)
            with open(layout_path + ".tmp", "w") as f:
                json.dump({"capacity": self.capacity, "fields": layout.to_json()}, f)
            os.replace(layout_path + ".tmp", layout_path)
            data_path = os.path.join(self.directory, DATA_FILE)
            fd = os.open(data_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                _reserve_space(fd, max(nbytes, 1), data_path)
                self._map_data(fd, layout)
            finally:
                os.close(fd)
        # Set last: another process that sees the flag finds both files complete.
        self.header[ALLOCATED] = 1

    def attach(self) -> None:
        """Map the data storage another process (or an earlier run) allocated."""
        if self.attached or not self.header[ALLOCATED]:
            return
        with open(os.path.join(self.directory, LAYOUT_FILE)) as f:
            meta = json.load(f)
        layout = Layout.from_json(meta["fields"])
        data_path = os.path.join(self.directory, DATA_FILE)
        fd = os.open(data_path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < layout.nbytes(self.capacity):
                raise StorageMismatch(f"{data_path} has {size} bytes, its layout needs {layout.nbytes(self.capacity)}")
            self._map_data(fd, layout)
        finally:
            os.close(fd)

    def _map_data(self, fd: int, layout: Layout) -> None:
        mm = mmap.mmap(fd, 0)
        self._maps.append(mm)
        self._set_tensors(layout, np.frombuffer(mm, dtype=np.uint8))

    def _set_tensors(self, layout: Layout, flat: np.ndarray) -> None:
        # numpy -> torch.from_numpy keeps a buffer export on the mmap, so unmapping while a view
        # is alive fails with BufferError instead of leaving a dangling pointer.
        tensors = {}
        for f in layout.fields:
            nbytes = f.nbytes(self.capacity)
            if nbytes == 0:
                tensors[f.key] = torch.zeros((self.capacity, *f.shape), dtype=f.dtype)
                continue
            raw = torch.from_numpy(flat[f.offset : f.offset + nbytes])
            tensors[f.key] = raw.view(f.dtype).view(self.capacity, *f.shape)
        self.tensors, self.layout = tensors, layout
        self.signature = {key: (torch.Size(shape), dtype) for key, (shape, dtype) in layout.signature().items()}

    # -- teardown ----------------------------------------------------------------------------------
    def flush(self) -> None:
        for mm in self._maps:
            mm.flush()

    def close(self) -> None:
        """Unmap everything and close the lock fd (idempotent; files are left in place)."""
        self.tensors, self.layout, self.signature = {}, None, {}
        self.header = self.seq = self.owner = None
        maps, self._maps = self._maps, []
        for mm in maps:
            try:
                mm.close()
            except BufferError:
                pass  # a view is still referenced somewhere: the map goes when it does
        self._lock_path = None
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def _reserve_space(fd: int, nbytes: int, path: str) -> None:
    # posix_fallocate makes a full /dev/shm (64 MiB in a default docker container) fail here,
    # with a clear error, rather than with a SIGBUS at the first write past the end.
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            os.ftruncate(fd, nbytes)
        elif e.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"no space for {nbytes} bytes of replay-buffer storage at {path}: free space, lower "
                "capacity, or use storage='memmap' with a path on a bigger disk "
                "(in docker, /dev/shm is small unless --shm-size is given)",
            ) from None
        else:
            raise
