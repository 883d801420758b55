"""Shared-memory batch slots: where a batch crosses the process boundary.

Each slot is one flat shared-memory byte tensor (one file descriptor, not one per field),
carved into the typed ``(n, T, *feature)`` arrays of a :class:`BatchLayout`.  The main process
allocates the slots once from the layout a worker reports; the worker writes a batch into a
slot and only sends a short "ready" reply.
"""

from __future__ import annotations

import numpy as np
import torch

from rlcollect.data import BatchBuffer, BatchLayout
from rlcollect.envs.base import torch_dtype

_ALIGN = 64
#: Fresh slots are filled with this byte so that a field nobody wrote shows up in tests.
POISON = 0xA5


def _field_bytes(layout: BatchLayout) -> list[tuple]:
    out, offset = [], 0
    n, t = layout.rows, layout.time
    for key, spec in layout.fields.items():
        shape = (n, t, *spec.shape)
        nbytes = int(np.prod(shape)) * np.dtype(spec.dtype).itemsize
        out.append((key, offset, nbytes, shape, torch_dtype(spec.dtype)))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return out, max(offset, _ALIGN)


def allocate_slot(layout: BatchLayout) -> torch.Tensor:
    """One flat shared-memory slot big enough for a batch of ``layout``."""
    _, total = _field_bytes(layout)
    flat = torch.empty(total, dtype=torch.uint8).share_memory_()
    flat.fill_(POISON)
    return flat


def slot_buffer(flat: torch.Tensor, layout: BatchLayout) -> BatchBuffer:
    """The typed view of a flat slot as a :class:`BatchBuffer`."""
    fields, total = _field_bytes(layout)
    if flat.numel() < total:
        raise ValueError(f"shared slot holds {flat.numel()} bytes, the layout needs {total}")
    tensors = {key: flat[off : off + nbytes].view(dtype).view(shape) for key, off, nbytes, shape, dtype in fields}
    return BatchBuffer(layout, tensors=tensors)
