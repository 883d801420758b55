"""The batch layout: preallocated batch storage, trajectory ids and ``split_trajectories``.

A batch is stored row-major as ``(n, T, *feature)`` where ``n`` is the number of env rows and
``T`` the time steps; the TensorDict users see is a view of that storage reshaped to
``(*batch_size, T)`` with the last dim named ``"time"``.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlcollect.envs.base import ArraySpec, NestedKey, torch_dtype
from rlcollect.envs.grouped import stack_agents

_ALIGN = 64
#: A fresh batch of at least this many bytes gets its own memory map (see :func:`fresh_batch`).
MAP_BYTES = 1 << 20

if TYPE_CHECKING:
    from tensordict import TensorDict

TRAJ_IDS = ("collector", "traj_ids")
POLICY_VERSION = ("collector", "policy_version")
MASK = ("collector", "mask")
WORKER_ID = ("collector", "worker_id")

#: Each worker (and each node's worker) draws trajectory ids from its own block of this size,
#: so ids are unique across the whole run without any coordination.
TRAJ_ID_BLOCK = 1 << 40


@dataclass(frozen=True)
class BatchLayout:
    """What one batch holds: ``{key: ArraySpec}`` per env row and time step. ``groups``: the
    extra batch dims of sub-TensorDicts (a grouped env's agent dims, ``((("agents",), (3,)),)``).
    ``lazy``: the lazily stacked groups of agents of different shapes, ``((key, agents, stack
    dim past the env's batch dims),)``; agent ``i``'s entries are the fields ``(*key, "#i",
    ...)`` (``envs/grouped.py``), lazily stacked again in the batch's TensorDict."""

    fields: dict[NestedKey, ArraySpec]
    batch_size: torch.Size
    time: int
    groups: tuple = ()
    lazy: tuple = ()

    @property
    def rows(self) -> int:
        return math.prod(self.batch_size)

    @property
    def frames(self) -> int:
        return self.rows * self.time


def with_mask(layout: BatchLayout) -> BatchLayout:
    """``layout`` with a ``("collector", "mask")`` field: which steps of a batch were collected
    (one that stopped early, preempted or interrupted, leaves the rest False, traj id -1)."""
    return BatchLayout({**layout.fields, MASK: ArraySpec((), np.dtype(np.bool_))}, layout.batch_size, layout.time,
                       layout.groups, layout.lazy)


class BatchBuffer:
    """A batch allocated once and refilled in place.

    ``arrays[key]`` is the numpy view ``(n, T, *feature)`` the rollout writes into;
    ``td`` is the user-facing TensorDict view ``(*batch_size, T)`` of the same memory.

    Example:
        >>> import numpy as np, torch
        >>> layout = BatchLayout({"x": ArraySpec((2,), np.dtype(np.float32))}, torch.Size([3]), 4)
        >>> BatchBuffer(layout).td["x"].shape
        torch.Size([3, 4, 2])
    """

    def __init__(self, layout: BatchLayout, share_memory: bool = False, tensors: dict | None = None):
        self.layout = layout
        n, t = layout.rows, layout.time
        if tensors is None:
            tensors = {}
            for key, spec in layout.fields.items():
                tensor = torch.zeros((n, t, *spec.shape), dtype=torch_dtype(spec.dtype))
                tensors[key] = tensor.share_memory_() if share_memory else tensor
        self.tensors = tensors
        self.arrays = {key: tensor.numpy() for key, tensor in tensors.items()}
        self._td = None

    @property
    def td(self) -> TensorDict:
        """The ``(*batch_size, T)`` TensorDict view (built on first use)."""
        if self._td is None:
            from tensordict import TensorDict

            layout = self.layout
            shape = (*layout.batch_size, layout.time)
            td = TensorDict({}, batch_size=shape)
            for key, tensor in self.tensors.items():
                td.set(key, tensor.reshape(*shape, *tensor.shape[2:]))
            for key, dims in layout.groups:  # (parents first: their dims are a prefix of their children's)
                td.get(key).batch_size = (*shape, *dims)
            if layout.lazy:
                stack_agents(td, layout.lazy, len(shape))
            td.names = [None] * len(layout.batch_size) + ["time"]
            self._td = td
        return self._td


def field_bytes(layout: BatchLayout) -> tuple[list[tuple], int]:
    """Where each field of ``layout`` lies in one flat block: ``[(key, offset, nbytes, shape,
    torch dtype)]`` (64-byte aligned), and the block's size.  The carving shared by the
    multi-process slots (multiprocess/shm.py) and the distributed transport.

    Example:
        >>> layout = BatchLayout({"x": ArraySpec((2,), np.dtype(np.float32))}, torch.Size([3]), 4)
        >>> fields, total = field_bytes(layout)
        >>> fields[0][:3], total
        (('x', 0, 96), 128)
    """
    out, offset = [], 0
    n, t = layout.rows, layout.time
    for key, spec in layout.fields.items():
        shape = (n, t, *spec.shape)
        nbytes = int(np.prod(shape)) * np.dtype(spec.dtype).itemsize
        out.append((key, offset, nbytes, shape, torch_dtype(spec.dtype)))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return out, max(offset, _ALIGN)


def carve(flat: torch.Tensor, layout: BatchLayout) -> dict[NestedKey, torch.Tensor]:
    """The typed ``(n, T, *feature)`` views of ``layout``'s fields in the flat byte tensor ``flat``."""
    fields, total = field_bytes(layout)
    if flat.numel() < total:
        raise ValueError(f"the flat block holds {flat.numel()} bytes, the layout needs {total}")
    return {key: flat[off : off + nbytes].view(dtype).view(shape) for key, off, nbytes, shape, dtype in fields}


class SlotPart:
    """Worker ``index``'s share of a stacked slot of ``parts`` workers (what that worker is
    handed instead of a flat slot; :func:`slot_buffer` carves it)."""

    def __init__(self, flat: torch.Tensor, index: int, parts: int):
        self.flat, self.index, self.parts = flat, index, parts

    def __reduce__(self):
        return SlotPart, (self.flat, self.index, self.parts)


def stacked_layout(layout: BatchLayout, parts: int) -> BatchLayout:
    """The layout of a stacked slot: field k is ``parts`` consecutive ``(n, T, ...)`` blocks."""
    # Stacking along the rows: field k of the stacked layout is parts consecutive (n, T, ...) blocks.
    return BatchLayout(layout.fields, torch.Size([parts * layout.rows]), layout.time, layout.groups, layout.lazy)


def stacked_tensors(flat: torch.Tensor, layout: BatchLayout, parts: int) -> dict:
    """The ``(parts * n, T, *feature)`` views of a stacked slot, by key (fresh tensors each call)."""
    return slot_buffer(flat, stacked_layout(layout, parts)).tensors


def slot_buffer(flat: torch.Tensor | SlotPart, layout: BatchLayout) -> BatchBuffer:
    """The typed view of a flat slot (or of a worker's part of a stacked one) as a :class:`BatchBuffer`."""
    if isinstance(flat, SlotPart):
        rows, i = layout.rows, flat.index
        stacked = stacked_tensors(flat.flat, layout, flat.parts)
        return BatchBuffer(layout, tensors={key: t[i * rows:(i + 1) * rows] for key, t in stacked.items()})
    return BatchBuffer(layout, tensors=carve(flat, layout))


def fresh_batch(layout: BatchLayout) -> BatchBuffer:
    """A zeroed batch in new memory, for a collector that hands each batch over without a copy.

    A batch of :data:`MAP_BYTES` or more is one anonymous memory map carved into its fields, so
    the memory goes back to the system as soon as the last tensor viewing it is freed (``malloc``
    keeps freed blocks of up to 32 MiB for reuse: a process that drops batch after batch would
    keep a batch or two more resident than it holds), and its pages come zeroed from the kernel.

    Example:
        >>> layout = BatchLayout({"x": ArraySpec((2,), np.dtype(np.float32))}, torch.Size([3]), 4)
        >>> fresh_batch(layout).td["x"].sum().item()
        0.0
    """
    _, total = field_bytes(layout)
    if total < MAP_BYTES:
        return BatchBuffer(layout)
    flat = torch.frombuffer(mmap.mmap(-1, total), dtype=torch.uint8)  # the tensors keep the map alive
    return BatchBuffer(layout, tensors=carve(flat, layout))


def _flat_rows(td: TensorDict) -> TensorDict:
    """Row-major flattening of every batch dim: ``(*B, T) -> (prod(B) * T,)``."""
    return td.reshape(-1)


def _whole_rows(td: TensorDict) -> bool:
    """Whether every row of ``td`` along time is one whole trajectory, each its own."""
    ids = td.get(TRAJ_IDS).reshape(-1, td.shape[-1])
    if MASK in td.keys(include_nested=True) and not bool(td.get(MASK).all()):
        return False
    first = ids[:, 0]
    return bool((ids == first[:, None]).all()) and bool((first != -1).all()) and first.unique().numel() == len(first)


def split_trajectories(td: TensorDict) -> TensorDict:
    """One trajectory per row: ``(num_traj, T_max)``, right-padded with zeros.

    Trajectories are told apart by ``("collector", "traj_ids")``; rows are ordered by first
    appearance in row-major order, frames keep their order, and a trajectory's frames need not
    be contiguous.  Frames with id ``-1`` (invalid) are dropped.  ``("collector", "mask")`` is
    True for real frames.

    Args:
        td: a batch from a collector (any batch dims, time last), holding
            ``("collector", "traj_ids")`` and optionally ``("collector", "mask")``.

    Returns:
        A TensorDict of shape ``(num_traj, T_max)`` with the same keys, plus the mask; a batch
        of more than two dims (stacked workers' batched envs) whose every row along time is one
        whole trajectory keeps its shape, as torchrl's ``split_trajectories`` keeps it.

    Example:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> td = TensorDict({"x": torch.arange(4.), ("collector", "traj_ids"): torch.tensor([7, 7, 3, 7])}, [4])
        >>> out = split_trajectories(td)
        >>> out["x"].tolist(), out["collector", "mask"].tolist()
        ([[0.0, 1.0, 3.0], [2.0, 0.0, 0.0]], [[True, True, True], [True, False, False]])
    """
    if TRAJ_IDS not in td.keys(include_nested=True):
        raise KeyError("split_trajectories needs ('collector', 'traj_ids') in the batch")
    if td.batch_dims > 2 and _whole_rows(td):
        out = td.copy()
        out.set(MASK, torch.ones(td.shape, dtype=torch.bool, device=td.device))
        return out
    flat = _flat_rows(td)
    ids = flat.get(TRAJ_IDS)
    valid = ids != -1
    if MASK in flat.keys(include_nested=True):
        valid &= flat.get(MASK)
    flat, ids = flat[valid], ids[valid]
    if ids.numel() == 0:
        out = flat.reshape(0, 0) if flat.batch_dims == 1 else flat
        out.set(MASK, torch.zeros(0, 0, dtype=torch.bool))
        return out
    uniq, inverse = torch.unique(ids, return_inverse=True)
    # Order trajectories by their first frame, not by id value.
    first = torch.full((uniq.numel(),), ids.numel(), dtype=torch.long).scatter_reduce_(
        0, inverse, torch.arange(ids.numel()), reduce="amin"
    )
    rank = torch.empty_like(first)
    rank[torch.argsort(first)] = torch.arange(first.numel())
    traj = rank[inverse]
    order = torch.argsort(traj, stable=True)
    counts = torch.bincount(traj, minlength=uniq.numel())
    starts = torch.cumsum(counts, 0) - counts
    sorted_traj = traj[order]
    pos = torch.arange(order.numel()) - starts[sorted_traj]
    num_traj, t_max = uniq.numel(), int(counts.max())

    out = _padded(flat[order], sorted_traj, pos, num_traj, t_max)
    mask = torch.zeros(num_traj, t_max, dtype=torch.bool)
    mask[sorted_traj, pos] = True
    out.set(MASK, mask)
    out.names = [None, "time"]
    return out


def _padded(src: TensorDict, traj: torch.Tensor, pos: torch.Tensor, num_traj: int, t_max: int) -> TensorDict:
    """``src`` (frames ``(N, ...)``) laid out ``(num_traj, t_max, ...)``: frame ``k`` at
    ``(traj[k], pos[k])``, zeros elsewhere. A sub-TensorDict keeps its own dims (an agent dim);
    a lazily stacked group of agents of different shapes is padded agent by agent and stacked
    lazily again."""
    from tensordict import LazyStackedTensorDict, TensorDict

    out = TensorDict({}, batch_size=[num_traj, t_max, *src.batch_size[1:]], device=src.device)
    for name in src.keys():
        value = src.get(name)
        if isinstance(value, torch.Tensor):
            buf = torch.zeros((num_traj, t_max, *value.shape[1:]), dtype=value.dtype, device=value.device)
            buf[traj, pos] = value
        elif isinstance(value, LazyStackedTensorDict) and value.stack_dim > 0:
            buf = LazyStackedTensorDict(*(_padded(agent, traj, pos, num_traj, t_max) for agent in value.tensordicts),
                                        stack_dim=value.stack_dim + 1)
        else:
            buf = _padded(value, traj, pos, num_traj, t_max)
        out.set(name, buf)
    return out


def deliver(
    batch: TensorDict,
    *,
    storing_device=None,
    split_trajs: bool = False,
    postproc=None,
    replay_buffer=None,
    extend_buffer: bool = True,
    stacked_workers: bool = False,
    post_hook=None,
) -> TensorDict | None:
    """What every collector does to a finished batch: move it to ``storing_device``, split it
    into trajectories, apply ``postproc``, and either return it or write it into
    ``replay_buffer`` and return None.

    ``post_hook``: called with the batch after ``postproc``, before it is written or returned
    (torchrl 0.14's ``post_collect_hook``; what it returns is ignored).

    ``stacked_workers``: dim 0 of ``batch`` stacks the batches of several workers. A foreign
    buffer (a torchrl ``ReplayBuffer``) is written as torchrl's collectors write it: each
    worker's batch ``(*env_batch, T)`` is ``extend``-ed on its own (so an unbatched env's frames
    are the buffer's items), or with ``extend_buffer=False`` each time step ``(*env_batch,)`` is
    ``add``-ed as one item. rlcollect's own ``ReplayBuffer`` stores frames either way.
    """
    if storing_device is not None:
        import torch as _torch

        if _torch.device(storing_device) != batch.device:
            batch = batch.to(storing_device)
    if split_trajs:
        batch = split_trajectories(batch)
    if postproc is not None:
        batch = postproc(batch)
    if post_hook is not None:
        post_hook(batch)
    if replay_buffer is None:
        return batch
    if not _is_own_buffer(replay_buffer):
        _write_foreign(replay_buffer, batch, extend_buffer, stacked_workers and not split_trajs)
    elif extend_buffer:
        replay_buffer.extend(batch)
    else:
        for t in range(batch.shape[-1]):
            replay_buffer.extend(batch[..., t])
    return None


def _is_own_buffer(replay_buffer) -> bool:
    from rlcollect.buffers import ReplayBuffer

    return isinstance(replay_buffer, ReplayBuffer)


def _valid_steps(part: TensorDict) -> TensorDict:
    """``part`` without the time steps a preempted worker did not fill."""
    if MASK not in part.keys(include_nested=True):
        return part
    steps = int(part.get(MASK).reshape(-1, part.shape[-1])[0].sum())
    part = part.exclude(MASK)
    return part if steps == part.shape[-1] else part[..., :steps]


def _write_foreign(replay_buffer, batch: TensorDict, extend_buffer: bool, stacked_workers: bool) -> None:
    parts = batch.unbind(0) if stacked_workers else (batch,)
    for part in parts:
        if stacked_workers:
            part = _valid_steps(part)
        if part.shape[-1] == 0:
            continue
        if extend_buffer:
            part.names = None  # as torchrl's workers hand them over
            replay_buffer.extend(part)
        else:
            add = getattr(replay_buffer, "add", None)
            for t in range(part.shape[-1]):
                step = part[..., t]
                if add is not None:
                    add(step)
                else:  # a buffer with extend() only gets each step's rows
                    replay_buffer.extend(step)
