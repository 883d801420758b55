"""The shared-memory batch slots of a multi-process collector: what each worker is handed to
write into, what is lent to the user (a delivered batch that is a view of a slot), and when a
slot is reclaimed (nothing outside the collector refers to its memory any more).

- ``WorkerSlots``: ``per_worker`` flat slots for each worker (async: 3, so a worker fills two
  while the user holds the third; sync when the workers' batches cannot be stacked: 1).
- ``StackedSlots``: sync, when every worker's batch has the same layout: the workers write
  into one stacked slot and the delivered batch is a view of it. Two stacked slots take turns,
  and a slot is reused only once nothing outside the collector refers to its memory. When the
  user still holds both, the workers write into a third, reserve slot and the batch is copied
  out of it (a slot is one file descriptor: batches kept by the hundred must not each hold one).

Neither calls the worker pool: whoever hands the slots to the workers asks ``handed(i)``. A
lent batch is told apart by counting the tensors that refer to a slot's memory
(:func:`references`).

Example:
    >>> import numpy as np, torch
    >>> from rlcollect.data import BatchLayout
    >>> from rlcollect.envs.base import ArraySpec
    >>> layout = BatchLayout({"x": ArraySpec((), np.dtype(np.float32))}, torch.Size([2]), 3)
    >>> slots = WorkerSlots([layout, layout], per_worker=3)
    >>> slots.settle()
    >>> batch = slots.view(0, 1)
    >>> slots.lend(0, 1); slots.lent(0), slots.reclaim()
    (True, [])
    >>> del batch
    >>> slots.reclaim(), slots.lent(0)
    ([(0, 1)], False)
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import torch

from rlcollect.data import BatchBuffer, BatchLayout, SlotPart, slot_buffer, stacked_tensors
from rlcollect.multiprocess.shm import allocate_slot, allocate_stacked, check_free_space, slot_bytes

#: Stacked slots kept: the batch the user holds while the next one is collected, and that one.
STACKED_SLOTS = 2

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def can_count_references() -> bool:
    """Whether :func:`references` works with this torch (a batch is delivered as a view of a
    slot only then: otherwise nothing tells when the user let go of it)."""
    return _use_count is not None


def references(flat: torch.Tensor) -> int:
    """How many tensors (and arrays made from them) in this process refer to ``flat``'s memory.

    Example:
        >>> flat = torch.zeros(8, dtype=torch.uint8)
        >>> before = references(flat)
        >>> view = flat[2:4]
        >>> references(flat) - before
        1
    """
    return _use_count(flat.untyped_storage()._cdata)


class WorkerSlots:
    """``per_worker`` flat slots for each worker, their typed views in this process, and which
    of them are lent to the user.

    Args:
        layouts: each worker's batch layout (as it reported it).
        per_worker: slots per worker.
    """

    def __init__(self, layouts: list[BatchLayout], per_worker: int):
        # Known only now (the workers report their layouts): check before allocating anything,
        # rather than fail half-way (or have a write hit SIGBUS) on a full /dev/shm.
        needed = sum(per_worker * slot_bytes(layout) for layout in layouts)
        check_free_space(needed, f"the batch slots of {len(layouts)} workers ({per_worker} each)")
        self.layouts = layouts
        self.flats = [[allocate_slot(layout) for _ in range(per_worker)] for layout in layouts]
        self.buffers = [[slot_buffer(flat, layout) for flat in flats] for flats, layout in zip(self.flats, layouts)]
        # Each slot's TensorDict, built once: a lent batch is a fresh view of it (view()).
        self.templates = [[buffer.td for buffer in buffers] for buffers in self.buffers]
        self._own: list[list[int]] = []
        self._lent: list[set[int]] = [set() for _ in layouts]

    def handed(self, index: int) -> list:
        """What worker ``index`` is handed: one flat slot per batch it may fill at once."""
        return self.flats[index]

    def layout_of(self, index: int) -> BatchLayout:
        """The layout worker ``index``'s slots were allocated with (the one it reported)."""
        return self.layouts[index]

    def settle(self) -> None:
        """Count the references the collector itself holds to each slot (once every worker has
        been handed its slots): more than these means a lent batch is still held (only where
        references can be counted: nothing is lent otherwise)."""
        if can_count_references():
            self._own = [[references(flat) for flat in flats] for flats in self.flats]

    def buffer(self, index: int, slot: int) -> BatchBuffer:
        """The collector's own typed view of worker ``index``'s ``slot``."""
        return self.buffers[index][slot]

    def view(self, index: int, slot: int):
        """A fresh TensorDict view of the slot (each leaf a new tensor on the slot's memory:
        the collector's own views must not change in number, a lent batch is told apart by
        the references beyond them)."""
        return self.templates[index][slot].apply(torch.Tensor.detach)

    def lend(self, index: int, slot: int) -> None:
        self._lent[index].add(slot)

    def lent(self, index: int) -> bool:
        """Whether a batch of worker ``index`` is lent to the user now."""
        return bool(self._lent[index])

    def is_lent(self, index: int, slot: int) -> bool:
        return slot in self._lent[index]

    def reclaim(self) -> list[tuple[int, int]]:
        """The ``(worker, slot)`` pairs whose lent batches nothing refers to any more (they are
        no longer lent)."""
        freed = []
        for i, lent in enumerate(self._lent):
            for slot in list(lent):
                if references(self.flats[i][slot]) <= self._own[i][slot]:
                    lent.discard(slot)
                    freed.append((i, slot))
        return freed


class StackedSlots:
    """The stacked slots of a sync collector whose workers' batches share one layout.

    Args:
        layout: the layout every worker reported.
        num_workers: the number of workers.
        stacked: the delivered batch's shape: ``(N, *env_batch, T)`` (True), or the workers'
            batches concatenated along the first dim (False).
    """

    def __init__(self, layout: BatchLayout, num_workers: int, stacked: bool = True):
        n = self.num_workers = num_workers
        self.layout, self.stacked = layout, stacked
        check_free_space(STACKED_SLOTS * n * slot_bytes(layout),
                         f"the batch slots of {n} workers ({STACKED_SLOTS} shared stacked slots)")
        self.parts: list[list[SlotPart]] = [[] for _ in range(n)]
        self.buffers: list[list[BatchBuffer]] = [[] for _ in range(n)]
        self.sets: list[tuple[torch.Tensor, int]] = []  # (flat slot, its references in the collector)
        # Each slot's delivered batch, built once: a batch is a fresh view of it (torch.Tensor.detach
        # of each leaf), so that the user's batch refers to the slot's memory on its own.
        self.templates: list = []
        self.current = 0  # the slot (of each worker) the next batch is collected into
        for _ in range(STACKED_SLOTS):
            self._new_set()

    def handed(self, index: int) -> list:
        """What worker ``index`` is handed: its part of every stacked slot."""
        return self.parts[index]

    def layout_of(self, index: int) -> BatchLayout:
        """The one layout of every worker's part (the first worker's order of the entries: a
        worker whose own order differs writes in this one, ``Worker.attach``)."""
        return self.layout

    def settle(self) -> None:
        """(The references are counted as each stacked slot is made.)"""

    def buffer(self, index: int, slot: int) -> BatchBuffer:
        return self.buffers[index][slot]

    def _new_set(self) -> None:
        """Allocate one more stacked slot (index ``len(self.sets)``) for every worker."""
        layout, n = self.layout, self.num_workers
        flat = allocate_stacked(layout, n)
        for i in range(n):
            part = SlotPart(flat, i, n)
            self.parts[i].append(part)
            self.buffers[i].append(slot_buffer(part, layout))
        size = (n, *layout.batch_size) if self.stacked else (n * layout.batch_size[0], *layout.batch_size[1:])
        self.templates.append(BatchBuffer(dataclasses.replace(layout, batch_size=torch.Size(size)),
                                          tensors=stacked_tensors(flat, layout, n)).td)
        self.sets.append((flat, references(flat)))

    def pick(self) -> tuple[bool, Any]:
        """Choose the stacked slot the next batch goes into (``current``): one no delivered
        batch refers to, else the reserve. Returns ``(made, batch)``: ``made`` True when the
        reserve was made just now (the workers must then be handed their parts of it);
        ``batch``, the batch the workers are about to write, as a view of the slot (named
        ``(..., "time")``), or None for the reserve (its batch is copied out once written:
        ``batch()``)."""
        order = [(self.current + k) % STACKED_SLOTS for k in range(1, STACKED_SLOTS + 1)]  # the other one first
        for attempt in range(2):
            for s in order:
                flat, own = self.sets[s]
                if references(flat) <= own:
                    self.current = s
                    return False, self.templates[s].apply(torch.Tensor.detach)
            if attempt == 0:
                gc.collect()  # a batch in a reference cycle is only freed by the collector
        # The user holds every slot: collect into the reserve (handed to the workers once) and copy.
        made = len(self.sets) == STACKED_SLOTS
        if made:
            check_free_space(self.num_workers * slot_bytes(self.layout), "the reserve batch slot")
            self._new_set()
        self.current = STACKED_SLOTS
        return made, None

    def batch(self):
        """The batch the workers just wrote, as a view of the current stacked slot (copied out
        of the reserve), named ``(..., "time")``."""
        template = self.templates[self.current]
        if self.current == STACKED_SLOTS:  # the reserve: the batch is copied out
            return template.clone()
        return template.apply(torch.Tensor.detach)


def check_layouts(layouts: list[BatchLayout], cat_results: str | int) -> int | None:
    """The dim the workers' batches are concatenated along (None: stacked), checked against
    the layouts they reported."""
    shapes = {(tuple(lay.batch_size), lay.time) for lay in layouts}
    keys = {tuple(sorted(map(str, lay.fields))) for lay in layouts}
    if len(keys) > 1:
        raise ValueError("the workers' batches hold different keys; they cannot be combined into one batch")
    if cat_results == "stack" and len(shapes) > 1:
        raise ValueError(
            f"cat_results='stack' needs every worker's batch to have the same shape, got {sorted(shapes)}; "
            "use cat_results=0 (same T) or -1 (same env batch size)"
        )
    if cat_results == "stack":
        return None
    dims = {len(b) + 1 for b, _ in shapes}
    ndim = min(dims)
    if len(dims) > 1 or not -ndim <= cat_results < ndim:
        raise ValueError(f"cat_results={cat_results} is not a dim of the workers' batches (shapes "
                         f"{sorted(shapes)}, {ndim} dims: give one in {-ndim}..{ndim - 1})")
    dim = cat_results % ndim
    full = {(*b, t) for b, t in shapes}
    if len({s[:dim] + s[dim + 1:] for s in full}) > 1:
        raise ValueError(f"cat_results={cat_results} needs the workers' batches to agree on every dim "
                         f"but dim {dim}, got {sorted(shapes)}")
    # 0 keeps its meaning of "along the first dim, same T"; the last dim is time
    return -1 if dim == ndim - 1 and cat_results != 0 else dim
