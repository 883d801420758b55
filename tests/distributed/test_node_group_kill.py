"""Issue 36, item 4: nothing of a run outlives it.  A node and its watcher both SIGSTOPped (a
job suspended, SIGSTOP to the process group): the node is replaced, and its watcher, stopped
too, used to stay in state T after the run.  The "mp" launcher starts each node in a process
group of its own and kills the group when the node is replaced."""

from __future__ import annotations

import os
import signal
import time

import pytest

from dist_helpers import counting5, node_pids, wait_gone
from procs import children as _children
from procs import state as _state
from rlcollect.distributed.collector import DistributedCollector

pytestmark = pytest.mark.timeout(180)


def test_a_stopped_node_and_its_stopped_watcher_are_both_killed_on_replacement():
    c = DistributedCollector([counting5] * 2, None, frames_per_batch=20, total_frames=-1, sync=True,
                             on_node_failure="restart", heartbeat_timeout=2.0, timeout=120.0)
    try:
        it = iter(c)
        next(it)
        pids = node_pids(c)
        watchers = _children(pids[0])
        assert len(watchers) == 1  # the node's watcher (counting5 starts no process)
        for pid in (*watchers, pids[0]):
            os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 90
        while c.stats()["workers"][0]["pid"] == pids[0]:
            next(it)
            assert time.monotonic() < deadline, "the stopped node was not replaced"
        assert not wait_gone([pids[0], *watchers], timeout=5.0)  # killed with its node, not left in state T
        new_pids = node_pids(c)
    finally:
        c.shutdown()
    assert not wait_gone([*pids, *new_pids, *watchers])
    assert [_state(p) for p in watchers] == ["gone"]
