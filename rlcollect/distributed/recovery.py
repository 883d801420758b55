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
import time
from collections.abc import Callable
from typing import Any

from rlcollect.distributed import protocol as P
from rlcollect.distributed.supervisor import node_error
from rlcollect.multiprocess.protocol import WorkerError

logger = logging.getLogger("rlcollect")

#: Seeds of relaunched nodes: incarnation k of a node seeded with s starts from s + k * this.
SEED_STRIDE = 7919


class NodeRecovery:
    """Mixin of ``DistributedCollector``: failed nodes dropped or relaunched, rejoined nodes
    admitted."""

    def _recovering(self, step: Callable[[], Any]) -> Any:
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
        cfg, sup, rank = self.config, self._sup, node + 1
        mode = cfg.on_node_failure
        if mode == "raise" or rank in sup.dropped:
            return False
        if mode == "restart" and self._restarts[node] >= cfg.max_node_restarts:
            raise WorkerError(f"node {node} failed again after {self._restarts[node]} restarts (max_node_restarts="
                              f"{cfg.max_node_restarts}): {type(error).__name__}: {error}", node,
                              getattr(error, "exitcode", None), getattr(error, "worker_traceback", None)) from error
        self._lost_batches[node] += self._outstanding[node]
        self._outstanding[node] = 0
        self._batch_started[node] = None
        self._expected_seq[node] = 0
        sup.drop(rank, for_good=mode == "continue")
        if mode == "continue":
            logger.warning("rlcollect: dropped node %d after: %s", node, _first_line(error))
            if all(r in sup.dropped for r in range(1, self.num_nodes + 1)):
                raise WorkerError(f"every node failed (on_node_failure='continue'); the last, node {node}: "
                                  f"{type(error).__name__}: {error}", node) from error
            return True
        self._restarts[node] += 1
        incarnation = sup.incarnations[rank] + 1
        base = self._seeds[node]
        seed = None if base is None else base + SEED_STRIDE * incarnation
        logger.warning("rlcollect: relaunching node %d (restart %d of %d) after: %s", node, self._restarts[node],
                       cfg.max_node_restarts, _first_line(error))
        sup.relaunch(rank, cfg.relaunch_payload(node, incarnation, seed))
        return True

    def _check_deadlines(self) -> None:
        """Raise for a node that owes a batch it started more than ``node_timeout`` seconds ago
        and has not announced (its heartbeat may be fine: a hung env step)."""
        limit = self.config.node_timeout
        if limit is None:
            return
        now = time.monotonic()
        late = [i for i, started in enumerate(self._batch_started) if started is not None and now - started > limit]
        if late:
            self._channel.pump()  # notices that arrived meanwhile (the trainer was busy) count
        for i in late:
            started = self._batch_started[i]
            announced = sum(1 for msg in self._channel.notices if msg.rank == i + 1)
            if announced >= self._outstanding[i]:
                continue  # done, only not taken yet (the trainer was busy)
            self._sup.failed.add(i + 1)  # hung: killed, not waited for
            raise P.mark_failed(node_error(f"node {i} has not delivered a batch it started {now - started:.1f} s ago "
                                           f"(node_timeout={limit:g}; its heartbeat may be alive: a hung env step?)",
                                           i), i)

    def _admit(self) -> None:
        """Make the relaunched nodes that rejoined serve again: check their layout, give them
        the weights the others act with.  Called from every wait's predicate."""
        sup = self._sup
        while sup.joined:
            rank, info = sup.joined.pop(0)
            i = rank - 1
            if info["layout"] != self.layouts[i]:
                raise WorkerError(f"relaunched node {i} reports another batch layout than before: "
                                  f"{info['layout']} instead of {self.layouts[i]}", i)
            self._nodes[i] = info
            self._since_update[i] = 0
            if i in self._last_packed:
                version, flat = self._last_packed[i]
                self._send_weights(i, version, flat)
            logger.warning("rlcollect: node %d rejoined (pid %s on %s)", i, info["pid"], info["host"])

    def _serving(self, i: int) -> bool:
        """Node ``i`` takes commands now (not dropped, not on its way back)."""
        rank, sup = i + 1, self._sup
        return rank in sup.pgs and rank not in sup.dropped and all(r != rank for r, _ in sup.joined)

    def _serving_nodes(self) -> list[int]:
        return [i for i in range(self.num_nodes) if self._serving(i)]

    def _settle(self) -> None:
        """Wait until no node is on its way back (before a command meant for every node)."""
        sup = self._sup

        def settled() -> bool:
            self._admit()
            return not sup.joining and not sup.joined

        with self._guard():
            self._recovering(lambda: self._channel.wait_for(settled, "waiting for relaunched nodes to rejoin"))


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
