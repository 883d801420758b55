"""Issue 38, item 5: a killed node's ``WorkerError`` names its fix, ``on_node_failure``, as every
other error names its own."""

from __future__ import annotations

import os
import signal

import pytest

from dist_helpers import counting5, node_pids, wait_gone
from rlcollect import WorkerError
from rlcollect.distributed.collector import DistributedCollector

pytestmark = pytest.mark.timeout(180)


def test_a_killed_nodes_error_names_on_node_failure():
    c = DistributedCollector([counting5], None, frames_per_batch=10, total_frames=-1, sync=True, timeout=60.0)
    try:
        it = iter(c)
        next(it)
        pids = node_pids(c)
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(WorkerError) as info:
            for _ in range(100):
                next(it)
    finally:
        c.shutdown()
    assert not wait_gone(pids)
    message = str(info.value)
    assert message.startswith("node 0 ")
    assert message.endswith("; on_node_failure='restart' relaunches a failed node and 'continue' goes on "
                            "without it (the default, 'raise', ends the run)")
