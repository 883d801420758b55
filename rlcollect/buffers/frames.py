"""A replay buffer's view of a batch: a TensorDict flattened into ``{key: (k, *shape)}`` frames
(masked frames and "_" keys dropped) for ``extend``, and frames back into a TensorDict for
``sample``.  tensordict is imported only when a TensorDict is built or read, so that workers stay
light.

A group of agents of different shapes (a ``LazyStackedTensorDict`` stacked along the first dim
past the batch's, as torchrl's ``HeterogeneousCountingEnv`` gives it) has no single shape per key:
each agent's entries are stored as fields of their own, ``(*group, "#i", ...)`` (the naming of the
collector's batches, ``envs/grouped.py``), and read back lazily stacked again, so a sample has the
structure the batch had.  The stored keys alone say which groups are lazy (:func:`lazy_groups`):
a process that opens the buffer later needs nothing else."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlcollect.buffers.storage import NestedKey
from rlcollect.envs.grouped import agent_index, agent_part, is_lazy_stack, stack_agents

if TYPE_CHECKING:
    from tensordict import TensorDictBase

MASK: NestedKey = ("collector", "mask")


def lazy_groups(keys) -> tuple[tuple[NestedKey, int], ...]:
    """The lazily stacked groups that stored ``keys`` hold, ``((group, agents),)``: a group is
    the key prefix before an agent part ``"#i"``.

    Example:
        >>> lazy_groups([("lazy", "#0", "obs"), ("lazy", "#1", "obs"), ("lazy", "#1", "camera"), ("x",)])
        ((('lazy',), 2),)
    """
    agents: dict[NestedKey, int] = {}
    for key in keys:
        for depth, part in enumerate(key):
            index = agent_index(part)
            if index is not None:
                agents[key[:depth]] = max(agents.get(key[:depth], 0), index + 1)
    return tuple(agents.items())


def to_tensordict(tensors: dict[NestedKey, torch.Tensor], batch_size: list[int],
                  lazy: tuple[tuple[NestedKey, int], ...] = ()) -> TensorDictBase:
    """``{key: (n, *shape)}`` as a TensorDict of ``batch_size``; each of the ``lazy`` groups
    (:func:`lazy_groups`) lazily stacked again from its agents' entries, along the dim past the
    batch's."""
    from tensordict import TensorDict

    td = TensorDict({}, batch_size=batch_size)
    for key, value in tensors.items():
        td.set(key[0] if len(key) == 1 else key, value)
    if lazy:
        stack_agents(td, tuple((group, agents, 0) for group, agents in lazy), len(batch_size))
    return td


_KEYS: dict[Any, NestedKey | None] = {}


def _stored_key(key: str | tuple) -> NestedKey | None:
    """``key`` as a tuple, or None for a key that is not stored (a component starts with "_")."""
    try:
        return _KEYS[key]
    except KeyError:
        pass
    as_tuple = (key,) if isinstance(key, str) else tuple(key)
    stored = None if any(part.startswith("_") for part in as_tuple) else as_tuple
    if len(_KEYS) < 4096:  # memoised: extend() is on the hot path and key sets are small
        _KEYS[key] = stored
    return stored


def frames_of(td: Any) -> tuple[dict[NestedKey, torch.Tensor], int]:
    """``{key: (k, *shape)}`` leaves of ``td`` flattened row-major, masked, "_" keys dropped."""
    from tensordict import TensorDictBase

    if not isinstance(td, TensorDictBase):
        raise TypeError(f"extend() expects a TensorDict, got {type(td).__name__}")
    dims = td.batch_dims
    count = int(np.prod(tuple(td.batch_size), dtype=np.int64))
    frames: dict[NestedKey, torch.Tensor] = {}
    mask = None
    for key, value in _leaves(td, (), dims):
        key = _stored_key(key)
        if key is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"extend(): key {key} holds a {type(value).__name__}, only tensors can be stored")
        flat = value.reshape(count, *value.shape[dims:])
        if key == MASK:
            mask = flat.reshape(count).to(torch.bool)
        else:
            frames[key] = flat
    if mask is not None and not bool(mask.all()):
        frames = {key: value[mask] for key, value in frames.items()}
        count = int(mask.sum())
    if not frames and count:
        raise ValueError("extend(): the batch has no tensor to store")
    return frames, count


def _leaves(td: Any, prefix: tuple, dims: int):
    """``(key, leaf)`` of every leaf of ``td`` under ``prefix``; a group lazily stacked past the
    batch dims ``dims`` gives its agents' leaves under ``(*group, "#i", ...)`` (the module
    docstring)."""
    for name, value in td.items():
        parts = (*prefix, name)
        if isinstance(value, torch.Tensor):
            yield parts, value
        elif is_lazy_stack(value) and value.stack_dim >= dims:
            if value.stack_dim != dims:
                raise ValueError(
                    f"extend(): the group {parts} is lazily stacked along dim {value.stack_dim}, not the first dim "
                    f"past the batch's ({dims}): rlcollect's ReplayBuffer stores agents of different shapes only "
                    "stacked there (torchrl's layout for them); give it the batch with that group stacked along "
                    f"dim {dims}, or use a torchrl ReplayBuffer")
            if any(agent_index(part) is not None for part in parts):
                raise ValueError(f"extend(): the key {parts} has a part of the form '#<int>', which the buffer "
                                 "keeps for the agents of lazily stacked groups: rename it")
            for i, agent in enumerate(value.tensordicts):
                yield from _leaves(agent, (*parts, agent_part(i)), dims)
        else:
            yield from _leaves(value, parts, dims)
