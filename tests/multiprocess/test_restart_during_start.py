"""A replacement worker killed while it starts (issue 23, item 6): the restart is tried again
within ``max_worker_restarts``, as a distributed node killed while rejoining is relaunched; and
the start-up hint about ``if __name__ == "__main__"`` is only given where it may apply."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from mp_helpers import START, ValuePolicy, assert_gone

from rlcollect import CountingEnv, MultiSyncCollector, WorkerError

pytestmark = pytest.mark.timeout(180)


def slow_replacement_env(marker: str, pid_dir: str) -> CountingEnv:
    """A CountingEnv; while ``marker`` exists, a worker building it records its pid in
    ``pid_dir`` and blocks (a replacement caught in the middle of its start-up)."""
    if os.path.exists(marker):
        with open(os.path.join(pid_dir, str(os.getpid())), "w"):
            pass
        time.sleep(600)
    return CountingEnv(max_steps=None)


def _kill_starting(pid_dir, count: int, killed: list, marker) -> None:
    """Kill the first ``count`` workers that record themselves starting, then let the next start."""
    deadline = time.monotonic() + 120
    while len(killed) < count and time.monotonic() < deadline:
        for name in os.listdir(pid_dir):
            if int(name) not in killed:
                os.kill(int(name), signal.SIGKILL)
                killed.append(int(name))
        time.sleep(0.02)
    os.unlink(marker)


@pytest.mark.parametrize("kills, restarts, fails", [(2, 3, False), (3, 3, True)])
def test_a_replacement_killed_while_it_starts_is_started_again(tmp_path, kills, restarts, fails):
    marker, pid_dir = tmp_path / "slow", tmp_path / "pids"
    pid_dir.mkdir()
    env = __import__("functools").partial(slow_replacement_env, str(marker), str(pid_dir))
    collector = MultiSyncCollector(env, ValuePolicy(w=1), num_workers=2, frames_per_batch=20,
                                   on_worker_failure="restart", max_worker_restarts=restarts, mp_start_method=START)
    pids, killed = collector.worker_pids(), []
    try:
        shape = next(collector).shape
        marker.touch()
        killer = threading.Thread(target=_kill_starting, args=(pid_dir, kills, killed, marker))
        killer.start()
        os.kill(pids[1], signal.SIGKILL)
        try:
            if fails:
                with pytest.raises(WorkerError, match=r"worker 1 failed again after 3 restarts") as info:
                    next(collector)
                assert "__main__" not in str(info.value)
            else:
                assert next(collector).shape == shape
                assert collector.stats()["restarts"] == kills + 1
                pids += collector.worker_pids()
        finally:
            killer.join()
        assert len(killed) == kills
    finally:
        collector.shutdown()
    assert_gone(pids + killed)
