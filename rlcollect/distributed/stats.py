"""``DistributedCollector.stats()``: the keys of every collector (rlcollect/metrics.py), a
"worker" being a node, plus what only a distributed collection has."""

from __future__ import annotations

from typing import Any

from rlcollect.distributed.nodes import NodeState
from rlcollect.metrics import stats_keys, worker_keys


def distributed_stats(pool: Any, *, closed: bool, master: str, **totals: Any) -> dict[str, Any]:
    """JSON-serialisable statistics of ``pool``'s nodes (each node's state, lost batches, host
    and pid, the dropped nodes, the launcher and rank 0's address ``master``) beside the keys
    of every collector, whose collector-wide values are ``totals`` (``frames``, ``batches``,
    ``elapsed``, ``recent_fps``, ``version``, ``lag``, ``wait``: see ``metrics.stats_keys``)."""
    dead = pool.dead()
    handles = pool.handles
    dropped = [h.index for h in handles if h.state is NodeState.DROPPED]
    nodes = [{**worker_keys(h.index, frames=h.frames, alive=not closed and h.index not in dead
                            and h.state is not NodeState.DROPPED,
                            restarts=h.restarts, version=h.version, step=h.step,
                            lag_dropped_frames=h.lag_dropped, lost_batches=h.lost_batches),
              "state": h.stats_state(),
              "host": h.info.get("host"), "pid": h.info.get("pid")} for h in handles]
    out = stats_keys(workers=nodes, restarts=sum(h.restarts for h in handles), dropped_frames=0,
                     replay_buffer_write_count=None, lag_dropped_frames=sum(h.lag_dropped for h in handles),
                     lost_batches=sum(h.lost_batches for h in handles), **totals)
    out.update({"dropped_nodes": dropped,
                "launcher": pool.config.launcher, "master": master})
    return out
