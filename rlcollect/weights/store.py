"""Versioned weight stores: how new weights reach a worker's policy.

``SharedWeights`` is one shared-memory copy of a policy's state (parameters and buffers) plus
a shared version and a shared sequence counter.  The main process writes the weights and the
version between two increments of the sequence counter; a worker, between two batches, sees a
new version and copies the weights into its own module, again if the counter moved meanwhile,
so it never acts on half-written weights.  No lock: one could not be handed to a worker that
is already running.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def as_state_dict(weights: Any) -> dict[str, torch.Tensor]:
    """Normalise what ``update_policy_weights_`` accepts into a flat ``{name: tensor}`` dict
    with ``nn.Module.state_dict()`` names."""
    if isinstance(weights, torch.nn.Module):
        return {k: v.detach() for k, v in weights.state_dict().items()}
    if hasattr(weights, "flatten_keys"):  # a TensorDict (not imported here: workers stay light)
        return {".".join(k) if isinstance(k, tuple) else k: v.detach()
                for k, v in weights.items(include_nested=True, leaves_only=True)}
    if isinstance(weights, dict):
        return {k: (v.detach() if isinstance(v, torch.Tensor) else torch.as_tensor(v)) for k, v in weights.items()}
    raise TypeError(
        f"weights must be None, an nn.Module, a TensorDict of parameters or a state dict, got {type(weights).__name__}"
    )


class SharedWeights:
    """A shared-memory, versioned copy of a module's state, written by the main process and
    read by workers.

    A sequence counter makes every read consistent without a lock (a lock could not travel to
    an already running worker): the writer makes it odd while it writes and even after; a
    reader that saw it change, or saw it odd, copies again.

    Example:
        >>> import torch
        >>> store = SharedWeights.like({"w": torch.zeros(2)})
        >>> store.write({"w": torch.ones(2)}, version=1)
        >>> module = torch.nn.Module(); module.register_buffer("w", torch.zeros(2))
        >>> store.read_into(module, have=0), module.w.tolist()
        (1, [1.0, 1.0])
    """

    def __init__(self, tensors: dict[str, torch.Tensor], seq: torch.Tensor, version: torch.Tensor):
        self.tensors, self._seq, self._version = tensors, seq, version

    @classmethod
    def like(cls, state: dict[str, torch.Tensor]) -> SharedWeights:
        tensors = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in state.items()}
        return cls(tensors, torch.zeros(1, dtype=torch.int64).share_memory_(),
                   torch.zeros(1, dtype=torch.int64).share_memory_())

    def __reduce__(self):
        return (SharedWeights, (self.tensors, self._seq, self._version))

    @property
    def version(self) -> int:
        return int(self._version[0])

    def write(self, weights: Any, version: int) -> None:
        state = as_state_dict(weights)
        unknown = set(state) - set(self.tensors)
        missing = set(self.tensors) - set(state)
        if unknown or missing:
            raise KeyError(f"weights do not match the policy: unexpected {sorted(unknown)}, missing {sorted(missing)}")
        mismatched = [f"{k}: got {tuple(v.shape)}, the policy has {tuple(self.tensors[k].shape)}"
                      for k, v in state.items() if tuple(v.shape) != tuple(self.tensors[k].shape)]
        if mismatched:
            # Checked before the sequence counter moves: copy_ would broadcast or fail half-way.
            raise RuntimeError(f"weights do not fit the policy (nothing was written): size mismatch for {mismatched}")
        with torch.no_grad():
            self._seq += 1
            try:
                for key, value in state.items():
                    self.tensors[key].copy_(value)
                self._version[0] = version
            finally:
                # An odd counter left behind would make every reader wait forever.
                self._seq += 1

    def read_into(self, module: torch.nn.Module, have: int) -> int:
        """Copy the weights into ``module`` if their version differs from ``have``; return the
        version ``module`` now holds."""
        while True:
            before = int(self._seq[0])
            version = int(self._version[0])
            if version == have and before % 2 == 0:
                return have
            if before % 2:
                time.sleep(0)
                continue
            with torch.no_grad():
                module.load_state_dict(self.tensors)
            if int(self._seq[0]) == before:
                return version
