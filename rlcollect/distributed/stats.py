"""``DistributedCollector.stats()``: the keys of every collector (rlcollect/metrics.py), a
"worker" being a node, plus what only a distributed collection has."""

from __future__ import annotations

import time
from typing import Any

from rlcollect.metrics import stats_keys, worker_keys


class NodeStats:
    """Mixin of ``DistributedCollector``: ``stats()`` and each node's state."""

    def stats(self) -> dict[str, Any]:
        """JSON-serialisable statistics: the keys of every collector (docs/observability.md; a
        "worker" is a node here, its env-step latency measured on the node), and each node's
        state, lost batches, host and pid, the dropped nodes, the launcher and rank 0's address."""
        elapsed = time.perf_counter() - self._started_at
        sup = self._sup
        dead = set() if sup is None or sup.launcher is None else set(sup.launcher.dead())
        dropped = set() if sup is None else sup.dropped
        nodes = [{**worker_keys(i, frames=self._node_frames[i],
                                alive=not self._closed and i + 1 not in dead and i + 1 not in dropped,
                                restarts=self._restarts[i], version=self._node_versions[i], step=self._node_steps[i]),
                  "state": self._node_state(i), "lost_batches": self._lost_batches[i],
                  "host": self._nodes[i].get("host"), "pid": self._nodes[i].get("pid")} for i in range(self.num_nodes)]
        out = stats_keys(
            frames=self._frames, batches=self._iter, elapsed=elapsed,
            recent_fps=self._last_batch_frames / self._last_batch_s if self._last_batch_s else 0.0,
            version=self._version, workers=nodes, restarts=sum(self._restarts), dropped_frames=0,
            replay_buffer_write_count=None, lag=self._lag, wait=self._wait)
        out.update({"dropped_nodes": sorted(r - 1 for r in dropped), "lost_batches": sum(self._lost_batches),
                    "launcher": self.config.launcher, "master": f"{self.master_addr}:{self.master_port}"})
        return out

    def _node_state(self, i: int) -> str:
        """"collecting", "rejoining" (relaunched, not back yet), "dropped" or "closed"."""
        sup = self._sup
        if sup is None:
            return "closed"
        if i + 1 in sup.dropped:
            return "dropped"
        return "collecting" if self._serving(i) else "rejoining"
