"""Issue 36, item 4 for the launchers whose nodes rank 0 cannot kill as a process group (a
submitit job, a Ray actor: tests/ray/test_ray_failures.py): a node and its watcher both
SIGSTOPped, the node is replaced, and its watcher, stopped too, used to stay in state T after
the run.  The watcher now asks the kernel for a SIGKILL when its node ends (``PR_SET_PDEATHSIG``,
control/watcher.py), which reaches a stopped process."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from dist_helpers import counting5, node_pids, wait_gone
from rlcollect.distributed.collector import DistributedCollector
from procs import children as _children
from procs import state as _state

pytestmark = pytest.mark.timeout(240)
HELPERS = str(Path(__file__).resolve().parent)


def test_a_stopped_submitit_node_and_its_stopped_watcher_are_both_gone_after_replacement(tmp_path, monkeypatch):
    # The jobs import dist_helpers, as a user's jobs import their code (and rlcollect from where this test does).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")])))
    c = DistributedCollector([counting5] * 2, None, frames_per_batch=20, total_frames=-1, sync=True,
                             launcher="submitit", master_addr="127.0.0.1", timeout=150.0, on_node_failure="restart",
                             heartbeat_timeout=2.0,
                             slurm_kwargs={"executor": "local", "folder": str(tmp_path / "jobs"), "timeout_min": 10})
    watchers: list[int] = []
    try:
        it = iter(c)
        next(it)
        pids = node_pids(c)
        watchers = _children(pids[0])
        assert len(watchers) == 1  # the node's watcher (counting5 starts no process)
        for pid in (*watchers, pids[0]):
            os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 150
        while c.stats()["workers"][0]["pid"] == pids[0]:
            next(it)
            assert time.monotonic() < deadline, "the stopped node was not replaced"
        assert not wait_gone([pids[0], *watchers], timeout=10.0)  # gone with its node, not left in state T
        new_pids = node_pids(c)
    finally:
        c.shutdown()
        for pid in watchers:  # (on the code before the fix: leave nothing behind)
            if _state(pid) not in ("gone", "Z"):
                os.kill(pid, signal.SIGKILL)
    assert not wait_gone([*pids, *new_pids, *watchers])
    assert [_state(p) for p in watchers] == ["gone"]
