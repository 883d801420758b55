"""Where observations and actions cross between the env workers and the inference loop.

One shared-memory block holds, for every slot (one split of one worker's envs), its rows of
every policy input (``("in", key)``) and every policy output (``("out", key)``), slot after
slot, so that the rows of all slots form one batch: a forward over consecutive slots reads
and writes views of the block, with no copy. A small shared tensor holds the policy version
each slot's last actions were computed with.

Each slot has its own pipe, on which only single bytes travel: the worker sends
:data:`REQUEST` once its observations are in the block, the loop answers :data:`ACTIONS` once
the outputs are (or :data:`FAILED`). Before the block exists a worker learns what the policy
writes with one :data:`DISCOVER` message: its first observations, pickled, answered with the
policy's outputs on them.

Example:
    >>> import numpy as np
    >>> from rlcollect.envs.base import ArraySpec
    >>> spec = SlotSpec(rows=4, inputs={"observation": ArraySpec((3,), np.dtype(np.float32))},
    ...                 outputs={"action": ArraySpec((), np.dtype(np.int64))}, env_keys=["observation"])
    >>> layout = block_layout(spec, total_rows=8)
    >>> from rlcollect.multiprocess.shm import allocate_slot  # (the collector hands the loop its allocator)
    >>> ins, outs = block_views(allocate_slot(layout), spec, 8)
    >>> ins["observation"].shape, outs["action"].shape
    (torch.Size([8, 3]), torch.Size([8]))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlcollect.data import BatchLayout, carve
from rlcollect.envs.base import ArraySpec, NestedKey

REQUEST, ACTIONS, FAILED, DISCOVER = b"r", b"a", b"e", b"d"


@dataclass(frozen=True)
class SlotSpec:
    """What one slot carries: ``rows`` env rows of ``inputs`` (the policy's input keys, the
    env's observations and the carried keys) and ``outputs`` (every key the policy writes),
    per row; ``env_keys``: the env's own observation keys (a plain module's arguments are
    matched against them)."""

    rows: int
    inputs: dict[NestedKey, ArraySpec]
    outputs: dict[NestedKey, ArraySpec]
    env_keys: list[NestedKey]

    def same_keys(self, other: SlotSpec) -> bool:
        return self.inputs == other.inputs and self.outputs == other.outputs and self.env_keys == other.env_keys


def _tagged(tag: str, key: NestedKey) -> tuple[str, ...]:
    return (tag, key) if isinstance(key, str) else (tag, *key)


def block_layout(spec: SlotSpec, total_rows: int) -> BatchLayout:
    """The block of ``total_rows`` rows of ``spec``'s inputs and outputs (one time step)."""
    fields = {_tagged("in", k): v for k, v in spec.inputs.items()}
    fields.update({_tagged("out", k): v for k, v in spec.outputs.items()})
    return BatchLayout(fields, torch.Size([total_rows]), 1)


def block_views(flat: torch.Tensor, spec: SlotSpec, total_rows: int) -> tuple[dict, dict]:
    """``(inputs, outputs)``: ``{key: (total_rows, *feature) tensor}`` views of the block."""
    tensors = carve(flat, block_layout(spec, total_rows))
    ins = {k: tensors[_tagged("in", k)][:, 0] for k in spec.inputs}
    outs = {k: tensors[_tagged("out", k)][:, 0] for k in spec.outputs}
    return ins, outs
