"""Restart policy for failed workers (``on_worker_failure="restart"``).

Decides whether a failed worker may be replaced, and builds the replacement's spec: the same
env factory and kwargs, a fresh seed, and a fresh block of trajectory ids so that the new
worker's ids never collide with the old one's.
"""

from __future__ import annotations

import copy
import os

import cloudpickle

from rlcollect.data import TRAJ_ID_BLOCK

FAILURE_POLICIES = ("raise", "restart")
#: Trajectory-id blocks of restarted workers: generation g of worker i uses block
#: ``i + g * _GENERATION_STRIDE`` (stays below 2**63 for i < 2**16 and g < 2**7).
_GENERATION_STRIDE = 1 << 16


class RestartPolicy:
    """Bookkeeping of ``on_worker_failure`` and ``max_worker_restarts``.

    Example:
        >>> policy = RestartPolicy("restart", 1, [{"kwargs": {"worker_idx": 0}}])
        >>> policy.allows(0), policy.record(0), policy.allows(0)
        (True, 1, False)
    """

    def __init__(self, mode: str, max_restarts: int, specs: list[dict]):
        if mode not in FAILURE_POLICIES:
            raise ValueError(f"on_worker_failure must be one of {FAILURE_POLICIES}, got {mode!r}")
        if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
            raise ValueError(f"max_worker_restarts must be an int >= 0, got {max_restarts!r}")
        self.mode = mode
        self.max_restarts = max_restarts
        self.specs = specs
        self.counts = [0] * len(specs)
        self.seeds: list[int | None] = [None] * len(specs)

    def allows(self, index: int) -> bool:
        return self.mode == "restart" and self.counts[index] < self.max_restarts

    def record(self, index: int) -> int:
        self.counts[index] += 1
        return self.counts[index]

    def payload(self, index: int, with_collector_ids: bool) -> bytes:
        """The pickled spec of the replacement of worker ``index`` (after ``record``)."""
        spec = copy.copy(self.specs[index])
        kwargs = dict(spec["kwargs"])
        generation = self.counts[index]
        if with_collector_ids:
            block = kwargs.get("worker_idx", index) + generation * _GENERATION_STRIDE
            kwargs["traj_id_start"] = block * TRAJ_ID_BLOCK
        spec["kwargs"] = kwargs
        base = self.seeds[index]
        spec["seed"] = (base + 7919 * generation) if base is not None else int.from_bytes(os.urandom(4), "little")
        return cloudpickle.dumps(spec)
