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
than ``node_timeout`` seconds for one batch, a broken connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rlcollect.distributed.nodes import NodeState
from rlcollect.errors import WorkerError
from rlcollect.members import replacement_seed

logger = logging.getLogger("rlcollect")



class Recovery:
    """The restart policy of a ``DistributedCollector``: its ``config`` (``on_node_failure``,
    ``max_node_restarts``, the relaunch payloads) applied to the nodes of ``pool``.

    Example (needs running nodes)::

        recovery = Recovery(config, pool)
        batch = recovery.run(next_batch)  # next_batch() again after each repaired failure
    """

    def __init__(self, config: Any, pool: Any):
        self.config, self.pool = config, pool

    def run(self, step: Callable[[], Any]) -> Any:
        """``step()``, again after each node failure that ``on_node_failure`` repairs."""
        while True:
            try:
                return step()
            except Exception as err:
                node = getattr(err, "failed_node", None)
                if node is None or not self._recover(node, err):
                    raise

    def _recover(self, node: int, error: BaseException) -> bool:
        """Drop (and relaunch) failed ``node``; False when the failure must be raised."""
        cfg, pool = self.config, self.pool
        handle = pool.handles[node]
        mode = cfg.on_node_failure
        if mode == "raise" or handle.state is NodeState.DROPPED:
            return False
        if mode == "restart" and handle.restarts >= cfg.max_node_restarts:
            raise WorkerError(f"node {node} failed again after {handle.restarts} restarts (max_node_restarts="
                              f"{cfg.max_node_restarts}): {type(error).__name__}: {error}", node,
                              getattr(error, "exitcode", None), getattr(error, "worker_traceback", None)) from error
        pool.drop(node, for_good=mode == "continue")
        if mode == "continue":
            logger.warning("rlcollect: dropped node %d after: %s", node, _first_line(error))
            if pool.all_dropped():
                raise WorkerError(f"every node failed (on_node_failure='continue'); the last, node {node}: "
                                  f"{type(error).__name__}: {error}", node) from error
            return True
        handle.restarts += 1
        incarnation = handle.incarnation + 1
        seed = None if handle.seed is None else replacement_seed(handle.seed, incarnation)
        logger.warning("rlcollect: relaunching node %d (restart %d of %d) after: %s", node, handle.restarts,
                       cfg.max_node_restarts, _first_line(error))
        pool.restart(node, cfg.relaunch_payload(node, incarnation, seed))
        return True


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
