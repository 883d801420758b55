"""What a ``DistributedCollector`` does when a node fails (``on_node_failure``; see
docs/fault-tolerance.md, "Distributed nodes").

- ``"raise"`` (default): the failure is raised and every node is shut down.
- ``"continue"`` (async only): the failed node is stopped and dropped; the others go on.  The
  batches it had in flight are lost (never delivered, never counted: ``stats()["lost_batches"]``).
- ``"restart"`` (the "mp" and "submitit" launchers): the failed node is stopped and launched
  again from the same configuration, with a fresh seed (derived from the last ``set_seed``) and a
  fresh block of trajectory ids; it rejoins over a new pair group, is given the weights the
  others act with, and collects again.  In sync mode the parts of the current batch the other
  nodes delivered are kept and the failed node's part is collected again by its replacement, so
  a batch never mixes frames of two weights versions.  After ``max_node_restarts`` restarts of
  one node its next failure is raised.

A failure is an exception marked with ``failed_node`` (``protocol.mark_failed``): a node process
that died, a node that stopped beating, a node whose collection raised, a node that took more
than ``node_timeout`` seconds for one batch, a broken connection. The collector's ``Members``
(rlcollect/members.py) runs each step that may meet one under recovery: ``member_of(error)``
tells a node's failure, ``recover(node, error)`` repairs it or re-raises it, and the step runs
again. ``Recovery`` owns each node's restart count and the seed its replacement derives from.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from rlcollect.distributed.nodes import NodeState
from rlcollect.errors import WorkerError
from rlcollect.members import replacement_seed

logger = logging.getLogger("rlcollect")



class Policy(Protocol):
    """What the recovery reads of the collector's ``DistributedConfig`` (config.py)."""

    num_nodes: int
    on_node_failure: str  # "raise", "continue" or "restart"
    max_node_restarts: int

    def relaunch_payload(self, node: int, incarnation: int, seed: int | None) -> bytes:
        """The configuration node ``node``'s incarnation ``incarnation`` starts from."""


class Handle(Protocol):
    """What the recovery reads of a node's ``NodeHandle`` (nodes.py)."""

    state: NodeState
    incarnation: int


class Nodes(Protocol):
    """What the recovery asks of the ``NodePool`` (pool.py): it drops and relaunches nodes through
    it only."""

    @property
    def handles(self) -> Sequence[Handle]: ...

    def drop(self, i: int, for_good: bool) -> None: ...

    def all_dropped(self) -> bool: ...

    def restart(self, i: int, payload: bytes) -> None: ...


class Recovery:
    """The restart policy of a ``DistributedCollector``: its ``config`` (``on_node_failure``,
    ``max_node_restarts``, the relaunch payloads) applied to the nodes of ``pool``, with each
    node's restart count (``counts``) and last seed (``seeds``).

    Example (needs running nodes)::

        recovery = Recovery(config, pool)
        members = Members(pool, gather, recovery, stats)
        batch = members.run(next_batch)  # next_batch() again after each repaired failure
    """

    def __init__(self, config: Policy, pool: Nodes):
        self.config, self.pool = config, pool
        self.counts = [0] * config.num_nodes  # restarts of each node
        self.seeds: list[int | None] = [None] * config.num_nodes  # the seed each node was last given

    def note_seed(self, node: int, seed: int) -> None:
        """``node`` was given ``seed`` (``set_seed``): its replacements derive theirs from it."""
        self.seeds[node] = seed

    def member_of(self, error: BaseException) -> int | None:
        """The node ``error`` is the failure of (marked ``failed_node``; None: not a node's)."""
        return getattr(error, "failed_node", None)

    def recover(self, node: int, error: BaseException) -> None:
        """Drop (and relaunch) failed ``node``, or re-raise ``error`` when ``on_node_failure``
        does not repair it."""
        cfg, pool = self.config, self.pool
        handle = pool.handles[node]
        mode = cfg.on_node_failure
        if mode == "raise" or handle.state is NodeState.DROPPED:
            raise error
        restarts = self.counts[node]
        if mode == "restart" and restarts >= cfg.max_node_restarts:
            raise WorkerError(f"node {node} failed again after {restarts} restarts (max_node_restarts="
                              f"{cfg.max_node_restarts}): {type(error).__name__}: {error}", node,
                              getattr(error, "exitcode", None), getattr(error, "worker_traceback", None)) from error
        pool.drop(node, for_good=mode == "continue")
        if mode == "continue":
            logger.warning("rlcollect: dropped node %d after: %s", node, _first_line(error))
            if pool.all_dropped():
                raise WorkerError(f"every node failed (on_node_failure='continue'); the last, node {node}: "
                                  f"{type(error).__name__}: {error}", node) from error
            return
        self.counts[node] += 1
        incarnation = handle.incarnation + 1
        seed = None if self.seeds[node] is None else replacement_seed(self.seeds[node], incarnation)
        logger.warning("rlcollect: relaunching node %d (restart %d of %d) after: %s", node, self.counts[node],
                       cfg.max_node_restarts, _first_line(error))
        pool.restart(node, cfg.relaunch_payload(node, incarnation, seed))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
