"""``ReplayBuffer``: a ring of frames that many processes extend and sample at once.

Usage, and what the collectors build on::

    rb = ReplayBuffer(100_000)               # owner: creates /dev/shm/rlcollect-rb-*/
    collector = MultiAsyncCollector(..., replay_buffer=rb)
    # each worker receives rb pickled (spawn): a handle on the SAME storage, which it extends
    # with its batches; the first extend, wherever it happens, allocates the storage.
    batch = rb.sample(256)                  # the trainer samples while the workers write
    rb.close()                              # the owner frees the storage (also at GC / exit)

The contract a collector may rely on:

- ``rb.share()`` returns an object to pickle into workers (``rb`` itself; a ``shared=False``
  buffer is moved to shared memory first).  Pickling a shared buffer never copies frames.
- ``extend(td)`` may be called from any number of processes and threads at once.  It takes a
  batch of any shape (``(*B, T)`` from a collector, ``(*B,)`` frame by frame), flattens it
  row-major, drops frames whose ``("collector", "mask")`` is False, and returns the ring slots it
  wrote.  Each call's frames land in consecutive slots (modulo the capacity).  A group of agents
  of different shapes (lazily stacked along the first dim past the batch's) is stored agent by
  agent and sampled lazily stacked again (``frames.py``).
- ``write_count`` counts every frame accepted, across all processes, exactly; it only grows,
  so freezing it (``pause()``) is the collectors' business: stop calling ``extend``.
- ``sample()`` never returns a frame that is being written or was half-written by a process that
  died: it is drawn uniformly among the complete frames.
- Only the owner (the process that constructed the buffer) removes storage; handles in workers
  only unmap on ``close()``, so a worker exiting or crashing leaves the buffer intact.  If the
  owner dies without closing (even by SIGKILL), its reaper process removes the storage
  (``lifetime.Reaper``).  Lock waits are bounded by ``lock_timeout`` (``LockTimeout``).

How concurrent writers stay exact (a seqlock over the ring slots: ``seqlock.py``): a writer
takes the cross-process lock only to reserve its slots and again to commit them, and copies
outside it, so writers copy in parallel; a reader redraws slots that were being written.  Two
writes never interleave in one slot, even when the ring laps itself.

Cost (measured on a 2-core x86-64 VM with CartPole-like frames, 11 keys, 1000 frames per call):
about 0.2 ms of CPU per call, i.e. ~5 M frames per CPU-second into /dev/shm (~2.7 M into a
memmap on disk); two concurrent writers each keep ~3.6 M frames per CPU-second (the copies run
outside the lock).  The fixed part of a call dominates small batches: extend with whole batches
where possible.

Limits, chosen knowingly:

- ``write_count`` counts a frame when its slot is reserved; a write that fails midway (an
  exception, a killed worker) leaves its slots counted but empty until the ring overwrites them.
- A writer that holds slots for more than ``seqlock.STALL_TIMEOUT_S`` while alive is overtaken (with a
  logged warning); liveness is judged by pid, so writers must share the owner's pid namespace.
- The seqlock relies on x86-64's store ordering (see ``seqlock.read``); on weakly ordered CPUs a torn
  frame is possible in principle.
- ``state_dict()`` should be taken while writers are paused; ``close()`` must not race with other
  calls on the same object (other processes' handles are unaffected).
- ``copy.deepcopy`` or pickling a buffer gives a handle on the same storage, never a copy.
"""

from __future__ import annotations

import math
import os
import shutil
import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlcollect.buffers.checkpoint import Checkpointing
from rlcollect.buffers.frames import frames_of, lazy_groups, to_tensordict
from rlcollect.buffers.lifetime import Reaper, make_storage_dir, release, shm_root
from rlcollect.buffers.seqlock import finish, read, reserve
from rlcollect.buffers.storage import (
    ALLOCATED,
    DEFAULT_LOCK_TIMEOUT_S,
    CURSOR,
    SIZE,
    WRITE_COUNT,
    Layout,
    NestedKey,
    Region,
    StorageMismatch,
)

if TYPE_CHECKING:  # tensordict is imported where a TensorDict is built: workers stay light
    from tensordict import TensorDictBase

STORAGES = ("memory", "memmap")


class ReplayBuffer(Checkpointing):
    """A ring buffer of frames, shared between processes, extended and sampled concurrently.

    Args:
        capacity: how many frames it holds; older frames are overwritten first.
        storage: ``"memory"`` (RAM: a directory in /dev/shm when ``shared``) or ``"memmap"``
            (memory-mapped files in ``path``, which survive the process).
        path: the directory of a ``"memmap"`` buffer.  Created if missing; if it already holds a
            buffer, that buffer is reopened with its frames and counters (``capacity`` must
            match).  Without ``path`` a temporary directory is used and removed on ``close()``;
            a given ``path`` is never removed.  Not accepted with ``"memory"``.
        shared: ``"memory"`` only: False keeps the frames in this process's private memory
            (faster to create, not picklable until :meth:`share`).  Memmap storage is always
            shareable.
        lock_timeout: seconds that ``extend``, ``state_dict``, ``load_state_dict`` and
            ``empty`` wait for the cross-process lock (held for microseconds by a working
            process) before raising :class:`~rlcollect.buffers.LockTimeout` (a ``TimeoutError``)
            naming the pid that holds it, stopped or stuck.  Handles sent to other processes
            keep it.  A holder that dies releases the lock at once.

    The storage is allocated by the first :meth:`extend`, from that batch's keys, per-frame
    shapes and dtypes, in whatever process it runs; later batches must have the same structure.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> rb = ReplayBuffer(8)
        >>> batch = TensorDict({"obs": torch.arange(10.).reshape(2, 5)}, [2, 5])
        >>> rb.extend(batch).tolist()          # 10 frames into 8 slots: the ring wraps
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
        >>> len(rb), rb.write_count
        (8, 10)
        >>> rb.sample(4)["obs"].shape
        torch.Size([4])
        >>> rb.close()
    """

    def __init__(
        self,
        capacity: int,
        *,
        storage: str = "memory",
        path: str | os.PathLike | None = None,
        shared: bool = True,
        lock_timeout: float = DEFAULT_LOCK_TIMEOUT_S,
    ):
        if isinstance(capacity, bool) or not isinstance(capacity, int | np.integer) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
        if path is not None and storage != "memmap":
            raise ValueError(f"path={str(path)!r} is only used with storage='memmap', got storage={storage!r}")
        if not isinstance(shared, bool):
            raise ValueError(f"shared must be True or False, got {shared!r}")
        if (isinstance(lock_timeout, bool) or not isinstance(lock_timeout, int | float)
                or not 0 < lock_timeout < math.inf):
            raise ValueError(f"lock_timeout must be a positive, finite number of seconds, got {lock_timeout!r}")
        self._lock_timeout = float(lock_timeout)
        self._capacity = int(capacity)
        self._storage = storage
        self._shared = shared or storage == "memmap"
        self._user_path = None if path is None else os.path.abspath(os.fspath(path))
        self._local = threading.Lock()
        self._closed = False
        if storage == "memory" and not shared:
            self._directory = None
            self._adopt(Region.private(self._capacity), remove=None)
        elif self._user_path is None:
            self._directory, reaper = make_storage_dir(shm_root() if storage == "memory" else None)
            self._create_in(self._directory, remove=self._directory, reaper=reaper)
        else:
            self._directory = self._user_path
            self._open_user_path()

    def _create_in(self, directory: str, remove: str | None, reaper: Reaper | None = None) -> None:
        try:
            region = Region.create(directory, self._capacity)
        except BaseException:
            if remove is not None:
                shutil.rmtree(remove, ignore_errors=True)
            if reaper is not None:
                reaper.stop()
            raise
        self._adopt(region, remove, reaper)

    def _open_user_path(self) -> None:
        path = self._user_path
        if os.path.exists(os.path.join(path, "control")):
            try:
                region = Region.open(path, self._capacity)
            except StorageMismatch as e:
                raise ValueError(f"path={path!r}: {e}") from None
            self._adopt(region, remove=None)
            return
        if os.path.isdir(path) and os.listdir(path):
            raise ValueError(
                f"path={path!r} exists, is not empty and holds no ReplayBuffer: give an empty or new directory"
            )
        os.makedirs(path, exist_ok=True)
        self._create_in(path, remove=None)

    def _adopt(self, region: Region, remove: str | None, reaper: Reaper | None = None) -> None:
        region.lock_timeout = self._lock_timeout
        self._region = region
        self._reaper = reaper  # the process that removes ``remove`` if this one dies
        self._finalizer = weakref.finalize(self, release, region, remove, os.getpid(), reaper)

    # -- pickling: a handle on the same storage ------------------------------------------------
    def __getstate__(self) -> dict:
        if self._closed:
            raise RuntimeError("cannot send a closed ReplayBuffer to another process")
        if self._directory is None:
            raise TypeError(
                "a ReplayBuffer(shared=False) lives in this process's memory and cannot be sent to "
                "another process: call share() first, or construct it with shared=True"
            )
        return {
            "capacity": self._capacity,
            "storage": self._storage,
            "directory": self._directory,
            "user_path": self._user_path,
            "lock_timeout": self._lock_timeout,
        }

    def __setstate__(self, state: dict) -> None:
        self._capacity, self._storage = state["capacity"], state["storage"]
        self._directory, self._user_path = state["directory"], state["user_path"]
        self._lock_timeout = state.get("lock_timeout", DEFAULT_LOCK_TIMEOUT_S)
        self._shared = True
        self._local = threading.Lock()
        self._closed = False
        self._region = None  # mapped on first use: unpickling stays cheap and cannot fail

    def share(self) -> ReplayBuffer:
        """This buffer, made shareable: pickle the result into other processes.

        A shared buffer returns itself.  A ``shared=False`` buffer first moves its frames and
        counters to shared memory (so handles already pickled elsewhere do not exist).

        Example:
            >>> import pickle
            >>> rb = ReplayBuffer(4, shared=False)
            >>> handle = pickle.loads(pickle.dumps(rb.share()))
            >>> handle.capacity
            4
            >>> handle.close(); rb.close()
        """
        self._check_open()
        if self._directory is not None:
            return self
        with self._local:
            old = self._region
            directory, reaper = make_storage_dir(shm_root())
            try:
                region = Region.create(directory, self._capacity)
                if old.attached:
                    region.allocate(old.layout)
                    for key, tensor in old.tensors.items():
                        region.tensors[key].copy_(tensor)
                region.seq[:], region.owner[:] = old.seq, old.owner
                region.header[[CURSOR, SIZE, WRITE_COUNT]] = old.header[[CURSOR, SIZE, WRITE_COUNT]]
            except BaseException:
                shutil.rmtree(directory, ignore_errors=True)
                reaper.stop()
                raise
            self._finalizer.detach()
            old.close()
            self._directory, self._shared = directory, True
            self._adopt(region, remove=directory, reaper=reaper)
        return self

    # -- properties ------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """The number of frames the ring holds."""
        return self._capacity

    @property
    def storage(self) -> str:
        """``"memory"`` or ``"memmap"``."""
        return self._storage

    @property
    def path(self) -> str | None:
        """The storage directory (None for a ``shared=False`` memory buffer)."""
        return self._directory

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def write_count(self) -> int:
        """Frames ever accepted by :meth:`extend` (overwritten ones included), in all processes.

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> rb = ReplayBuffer(2)
            >>> _ = rb.extend(TensorDict({"x": torch.zeros(3)}, [3]))
            >>> rb.write_count, len(rb)
            (3, 2)
            >>> rb.close()
        """
        return int(self._open_region().header[WRITE_COUNT])

    def __len__(self) -> int:
        """Frames stored now (at most ``capacity``).

        Slots still being written count, and so do those of a write that failed (a writer killed
        mid-write): indexing raises RuntimeError for those, :meth:`sample` skips them.
        """
        return int(self._open_region().header[SIZE])

    def __repr__(self) -> str:
        if self._closed:
            return f"ReplayBuffer(capacity={self._capacity}, storage={self._storage!r}, closed)"
        return (
            f"ReplayBuffer(capacity={self._capacity}, storage={self._storage!r}, len={len(self)}, "
            f"write_count={self.write_count}, path={self._directory!r})"
        )

    # -- lifetime --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this ReplayBuffer is closed")

    def _open_region(self) -> Region:
        region = self._region
        if region is not None:
            return region
        self._check_open()
        with self._local:
            if self._region is None:
                try:
                    region = Region.open(self._directory, self._capacity)
                except FileNotFoundError:
                    raise RuntimeError(
                        f"the ReplayBuffer storage at {self._directory} no longer exists: the process "
                        "that created the buffer has closed it (or exited)"
                    ) from None
                self._adopt(region, remove=None)
        return self._region

    def _data_region(self) -> Region:
        """The region, with its data mapped if any process has allocated it."""
        region = self._open_region()
        if not region.attached and region.header[ALLOCATED]:
            with self._local:
                region.attach()
        return region

    def close(self) -> None:
        """Release the storage: unmap it and, in the owner, delete what was created.

        Idempotent.  In the process that constructed the buffer, a /dev/shm or temporary
        directory is removed (other processes' maps stay valid until they close); a memmap
        ``path`` given by the user is kept.  In other processes only the maps are released.
        Also runs when the buffer is garbage-collected and at interpreter exit.

        Example:
            >>> rb = ReplayBuffer(4)
            >>> rb.close(); rb.close()
            >>> rb.closed
            True
        """
        if self._closed:
            return
        self._closed = True
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
        self._region = None

    def __enter__(self) -> ReplayBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- writing ---------------------------------------------------------------------------------
    def extend(self, td: TensorDictBase) -> torch.Tensor:
        """Append the frames of ``td``; return the ring slots written (a LongTensor).

        The batch dims are flattened row-major, so each env row's frames stay contiguous: a
        ``(2, 5)`` batch writes row 0's five frames, then row 1's.  Frames whose
        ``("collector", "mask")`` is False are dropped (the mask itself is not stored), as are
        keys with a component starting with ``"_"``.  Past ``capacity`` the ring wraps and the
        oldest frames are overwritten; the result has one slot per frame accepted, including
        frames that a batch larger than the ring overwrote itself.

        Each call has a fixed cost of some 0.1-0.2 ms (two lock round trips, a copy call per key)
        on top of the copying: extend with whole batches rather than frame by frame if possible.

        Raises ValueError if the keys, per-frame shapes or dtypes differ from the first batch's.

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> rb = ReplayBuffer(10)
            >>> mask = torch.tensor([[True, True, False], [True, False, False]])
            >>> td = TensorDict({"x": torch.tensor([[0, 1, 2], [10, 11, 12]]), ("collector", "mask"): mask}, [2, 3])
            >>> rb.extend(td).tolist()
            [0, 1, 2]
            >>> rb[:]["x"].tolist()
            [0, 1, 10]
            >>> rb.close()
        """
        frames, count = frames_of(td)
        if count == 0:
            return torch.empty(0, dtype=torch.long)
        region = self._writable_region(frames)
        start, slots = reserve(region, count)
        try:
            pos = count - sum(b - a for a, b, _ in slots)  # frames that the call overwrites itself
            for a, b, _ in slots:
                whole = pos == 0 and b - a == count  # the common case: skip slicing the source
                for key, dst in region.tensors.items():
                    src = frames[key]
                    dst[a:b].copy_(src if whole else src[pos : pos + b - a])
                pos += b - a
        except BaseException:
            finish(region, slots, committed=False)
            raise
        finish(region, slots, committed=True)
        return (start + torch.arange(count)) % self._capacity

    def _writable_region(self, frames: dict[NestedKey, torch.Tensor]) -> Region:
        self._check_open()
        region = self._data_region()
        if not region.attached:
            layout = Layout.of(frames, self._capacity)
            with self._local, region.lock():
                if region.header[ALLOCATED]:
                    region.attach()  # another process got there first
                else:
                    region.allocate(layout)
        mine = region.signature
        if len(mine) != len(frames) or any(mine.get(key) != (v.shape[1:], v.dtype) for key, v in frames.items()):
            problem = region.layout.difference(Layout.of(frames, self._capacity))
            raise ValueError(f"extend(): the batch does not match the layout set by the first batch: {problem}")
        return region

    # -- reading ---------------------------------------------------------------------------------
    def sample(self, batch_size: int) -> TensorDictBase:
        """``batch_size`` frames drawn uniformly (with replacement) from the frames stored.

        Uses torch's global random generator (``torch.manual_seed`` makes it reproducible).
        Raises RuntimeError on an empty buffer.

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> rb = ReplayBuffer(100)
            >>> _ = rb.extend(TensorDict({"x": torch.ones(5, 3), ("next", "r"): torch.zeros(5, 1)}, [5]))
            >>> s = rb.sample(2)
            >>> s.batch_size, s["x"].shape, s["next", "r"].shape
            (torch.Size([2]), torch.Size([2, 3]), torch.Size([2, 1]))
            >>> rb.close()
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int | np.integer) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self._check_open()
        region = self._data_region()
        size = int(region.header[SIZE])
        if size == 0 or not region.attached:
            raise RuntimeError("sample() on an empty ReplayBuffer: nothing has been written yet (len == 0)")
        idx = torch.randint(size, (int(batch_size),))
        return to_tensordict(read(region, idx, redraw_below=size), [int(batch_size)], lazy_groups(region.signature))

    def __getitem__(self, index: int | slice | torch.Tensor | list) -> TensorDictBase:
        """The frames in the given ring slots (as returned by :meth:`extend`), in that order.

        Slots ``0 .. len(self) - 1`` hold frames; others raise IndexError.  Waits for a slot
        that is being written; raises RuntimeError for one whose write failed.

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> rb = ReplayBuffer(4)
            >>> _ = rb.extend(TensorDict({"x": torch.arange(6)}, [6]))
            >>> rb[:]["x"].tolist(), rb[1]["x"].item()
            ([4, 5, 2, 3], 5)
            >>> rb.close()
        """
        self._check_open()
        region = self._data_region()
        size = int(region.header[SIZE]) if region.attached else 0
        idx = torch.arange(size)[index]
        flat = idx.reshape(-1)
        out = read(region, flat, redraw_below=None)
        td = to_tensordict(out, [flat.numel()], lazy_groups(region.signature))
        return td.reshape(idx.shape) if idx.shape != flat.shape else td

    def empty(self) -> None:
        """Drop every frame (``len`` becomes 0); the storage and ``write_count`` are kept.

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> rb = ReplayBuffer(4)
            >>> _ = rb.extend(TensorDict({"x": torch.zeros(3)}, [3]))
            >>> rb.empty()
            >>> len(rb), rb.write_count
            (0, 3)
            >>> rb.close()
        """
        self._check_open()
        region = self._open_region()
        with region.lock():
            region.header[CURSOR] = 0
            region.header[SIZE] = 0
