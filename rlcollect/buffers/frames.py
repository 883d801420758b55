"""A replay buffer's view of a batch: a TensorDict flattened into ``{key: (k, *shape)}`` frames
(masked frames and "_" keys dropped) for ``extend``, and frames back into a TensorDict for
``sample``.  tensordict is imported only when a TensorDict is built or read, so that workers stay
light."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlcollect.buffers.storage import NestedKey

if TYPE_CHECKING:
    from tensordict import TensorDictBase

MASK: NestedKey = ("collector", "mask")


def to_tensordict(tensors: dict[NestedKey, torch.Tensor], batch_size: list[int]) -> TensorDictBase:
    from tensordict import TensorDict

    td = TensorDict({}, batch_size=batch_size)
    for key, value in tensors.items():
        td.set(key[0] if len(key) == 1 else key, value)
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
    for key, value in td.items(include_nested=True, leaves_only=True):
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
