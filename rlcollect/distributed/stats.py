"""``DistributedCollector.stats()``: the keys of every collector, counted by its ``MemberStats``
(rlcollect/members.py, ``summary``: the one summary of both wings), a "worker" being a node, plus
what only a distributed collection has (each node's state, host and pid, the dropped nodes, the
launcher and rank 0's address)."""

from __future__ import annotations

from typing import Any

from rlcollect.distributed.nodes import NodeState
from rlcollect.members import MemberStats


def distributed_stats(pool: Any, stats: MemberStats, *, closed: bool, master: str, restarts: list[int],
                      version: int) -> dict[str, Any]:
    """JSON-serialisable statistics of ``pool``'s nodes counted by ``stats``: each node's
    version, env-step latency and lost batches as its handle knows them, its state, host and
    pid, beside the keys of every collector; the dropped nodes, the launcher and rank 0's
    address ``master``."""
    handles = pool.handles
    nodes = [{"version": h.version, "step": h.step, "lost_batches": h.lost_batches, "state": h.stats_state(),
              "host": h.info.get("host"), "pid": h.info.get("pid")} for h in handles]
    out = stats.summary(frames=stats.frames, batches=stats.batches, version=version,
                        alive=[False] * len(handles) if closed else pool.alive(), restarts=restarts,
                        replay_buffer=None, members=nodes)
    out.update({"dropped_nodes": [h.index for h in handles if h.state is NodeState.DROPPED],
                "launcher": pool.config.launcher, "master": master})
    return out
