"""torchrl's accessors of ``DistributedCollector`` (``iterator()``, per-node device lists,
``frames_per_batch_worker``, ``requested_frames_per_batch``), beside ``next()`` and the policy
version methods every collector has."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rlcollect.torchrl_args import TorchrlMethods


class DistributedAccessors(TorchrlMethods):
    """Mixed into ``DistributedCollector``; reads its ``config`` and ``num_nodes``."""

    config: Any
    num_nodes: int

    def iterator(self) -> Iterator[Any]:
        """``iter(collector)`` (torchrl's name)."""
        return iter(self)

    @property
    def requested_frames_per_batch(self) -> int:
        """``frames_per_batch`` as given: a sync batch's frames, or each async node's."""
        return self.frames_per_batch

    def frames_per_batch_worker(self, worker_idx: int | None = None) -> int:
        """Frames in each batch node ``worker_idx`` collects (every node collects the same)."""
        if worker_idx is not None and (isinstance(worker_idx, bool) or not isinstance(worker_idx, int)
                                       or not 0 <= worker_idx < self.num_nodes):
            raise ValueError(f"worker_idx must be None or an int in 0..{self.num_nodes - 1}, got {worker_idx!r}")
        return self.config.node_frames

    @property
    def device(self) -> list:
        """One device per node, as given (torchrl's distributed device properties are lists)."""
        return list(self.config.devices["device"])

    @property
    def storing_device(self) -> list:
        return list(self.config.devices["storing_device"])

    @property
    def env_device(self) -> list:
        return list(self.config.devices["env_device"])

    @property
    def policy_device(self) -> list:
        return list(self.config.devices["policy_device"])
