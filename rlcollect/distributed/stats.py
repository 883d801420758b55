"""``DistributedCollector.stats()``: the keys of every collector (rlcollect/metrics.py), a
"worker" being a node, plus what only a distributed collection has."""

from __future__ import annotations

import time
from typing import Any

from rlcollect.distributed.nodes import NodeState
from rlcollect.members import MemberStats
from rlcollect.metrics import stats_keys, worker_keys


def distributed_stats(pool: Any, stats: MemberStats, *, closed: bool, master: str, restarts: list[int],
                      version: int) -> dict[str, Any]:
    """JSON-serialisable statistics of ``pool``'s nodes (each node's state, restarts, lost
    batches, host and pid, the dropped nodes, the launcher and rank 0's address ``master``)
    beside the keys of every collector (``metrics.stats_keys``), counted by ``stats``."""
    dead = pool.dead()
    handles = pool.handles
    dropped = [h.index for h in handles if h.state is NodeState.DROPPED]
    nodes = [{**worker_keys(h.index, frames=stats.worker_frames[h.index], alive=not closed and h.index not in dead
                            and h.state is not NodeState.DROPPED,
                            restarts=restarts[h.index], version=h.version, step=h.step,
                            lag_dropped_frames=stats.lag_dropped[h.index], lost_batches=h.lost_batches),
              "state": h.stats_state(),
              "host": h.info.get("host"), "pid": h.info.get("pid")} for h in handles]
    out = stats_keys(workers=nodes, restarts=sum(restarts), dropped_frames=0,
                     replay_buffer_write_count=None, lag_dropped_frames=sum(stats.lag_dropped),
                     lost_batches=sum(h.lost_batches for h in handles), frames=stats.frames, batches=stats.batches,
                     elapsed=time.perf_counter() - stats.started_at,
                     recent_fps=stats.last_batch_frames / stats.last_batch_s if stats.last_batch_s else 0.0,
                     version=version, lag=stats.lag, wait=stats.wait, first_batch=stats.first_batch)
    out.update({"dropped_nodes": dropped,
                "launcher": pool.config.launcher, "master": master})
    return out
