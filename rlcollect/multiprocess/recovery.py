"""Recovery of failed workers (``on_worker_failure``): the multi-process wing's
``recovery.py``, as the distributed wing's is for nodes.

``RestartPolicy`` decides whether a failed worker may be replaced, and builds the
replacement's spec: the same env factory and kwargs, a fresh seed, and a fresh block of
trajectory ids so that the new worker's ids never collide with the old one's.
``WorkerRestarts`` replaces the worker (or re-raises its error).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Callable
from typing import Protocol

import cloudpickle

from rlcollect.data import TRAJ_ID_BLOCK
from rlcollect.errors import WorkerError
from rlcollect.members import replacement_seed

logger = logging.getLogger("rlcollect")

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

    def note_seed(self, index: int, seed: int) -> None:
        """Worker ``index`` was given ``seed`` (``set_seed``): its replacements derive theirs from it."""
        self.seeds[index] = seed

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
        spec["seed"] = int.from_bytes(os.urandom(4), "little") if base is None else replacement_seed(base, generation)
        return cloudpickle.dumps(spec)


class Restarts(Protocol):
    """What ``WorkerRestarts`` asks of the ``WorkerPool`` (pool.py): a worker replaced."""

    def restart(self, index: int, payload: bytes, check: Callable[[dict], None] | None = None) -> None: ...


class WorkerRestarts:
    """Where a failed worker is replaced (``on_worker_failure="restart"``) or its error re-raised.

    Args:
        policy: the ``RestartPolicy`` (counts, seeds, the workers' specs).
        pool: the ``WorkerPool``; its ``restart`` starts the replacement and attaches it to the
            shared slots the old worker had.
        layouts: the batch layout each worker reported; a replacement must report the same.
        single: whether the workers run a ``Collector`` (a replacement then gets a fresh block
            of trajectory ids).
        after: called with the worker's index once the replacement is attached (to send it the
            current weights, say).
        give_up: returns the error that makes any restart pointless (the policy acting for
            the workers raised in the main process: every worker waiting for it failed), or None.
    """

    def __init__(self, policy: RestartPolicy, pool: Restarts, layouts: list, single: bool,
                 after: Callable[[int], None] | None = None,
                 give_up: Callable[[], BaseException | None] | None = None):
        self.policy, self.pool, self.layouts, self.single, self.after = policy, pool, layouts, single, after
        self.give_up = give_up

    @property
    def counts(self) -> list[int]:
        """The restarts of each worker."""
        return self.policy.counts

    def note_seed(self, index: int, seed: int) -> None:
        """Worker ``index`` was given ``seed``: its replacements derive theirs from it."""
        self.policy.note_seed(index, seed)

    def member_of(self, error: BaseException) -> int | None:
        """None: a worker's failure reaches ``Members`` as the gather's ``MemberFailed`` only."""
        return None

    def recover(self, index: int, error: BaseException) -> None:
        """Replace failed worker ``index`` or re-raise ``error``.

        The replacement is built from the same spec with a fresh seed and trajectory-id block,
        gets the same shared slots and the current weights and version before collecting."""
        fatal = self.give_up() if self.give_up is not None else None
        if fatal is not None:
            raise fatal from error
        policy = self.policy
        while True:
            if not policy.allows(index):
                if policy.mode == "restart":
                    raise WorkerError(
                        f"worker {index} failed again after {policy.counts[index]} restarts "
                        f"(max_worker_restarts={policy.max_restarts}): {type(error).__name__}: {error}",
                        index, getattr(error, "exitcode", None), getattr(error, "worker_traceback", None),
                    ) from error
                raise error
            count = policy.record(index)
            logger.warning("restarting worker %d (restart %d of %d) after: %s",
                           index, count, policy.max_restarts, str(error).splitlines()[0])
            try:
                self.pool.restart(index, policy.payload(index, self.single),
                                  check=lambda info: self._check_layout(index, info))
            except WorkerError as err:  # the replacement died (killed, say) or hung while it started
                if err.worker_index != index:
                    raise
                error = err
                continue
            break
        error = None  # (a replacement's error holds this frame in its traceback: no cycle kept)
        if self.after is not None:
            self.after(index)

    def forgive(self, index: int, error: BaseException) -> None:
        """Worker ``index`` failed while the collector shuts down: it is not replaced, but
        ``error`` is re-raised where ``recover`` would have re-raised it (no restart allowed)."""
        fatal = self.give_up() if self.give_up is not None else None
        if fatal is not None:
            raise fatal from error
        if not self.policy.allows(index):
            self.recover(index, error)  # raises
        logger.warning("worker %d failed while the collector shuts down (not restarted): %s",
                       index, str(error).splitlines()[0])

    def _check_layout(self, index: int, info: dict) -> None:
        if info["layout"] != self.layouts[index]:
            raise WorkerError(f"restarted worker {index} reports a different batch layout", index)
