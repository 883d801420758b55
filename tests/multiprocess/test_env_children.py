"""Processes an env starts (a simulator server, say) end with its worker (issue 23, item 7):
each worker leads its own process group; the pool ends that group when the worker is replaced
or shut down, and the pool's guard process ends it as soon as the worker dies (SIGKILL) or the
main process does. An env whose ``close()`` forgets its child leaves nothing behind either."""

from __future__ import annotations

import functools
import os
import signal
import subprocess

import pytest
from mp_helpers import START, ValuePolicy, assert_gone, wait_gone

from rlcollect import CountingEnv, MultiSyncCollector

pytestmark = pytest.mark.timeout(180)


class ServerEnv(CountingEnv):
    """A CountingEnv that starts a "server": ``sh`` (a child) running ``sleep`` (a grandchild),
    and writes both pids to ``<pid_dir>/<worker pid>``; ``close()`` does not stop them."""

    def __init__(self, pid_dir: str):
        super().__init__(max_steps=None)
        self.server = subprocess.Popen(["sh", "-c", "sleep 1000 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
        grandchild = int(self.server.stdout.readline())
        with open(os.path.join(pid_dir, str(os.getpid())), "w") as f:
            f.write(f"{self.server.pid} {grandchild}")


def _servers(pid_dir) -> dict[int, list[int]]:
    return {int(name): [int(p) for p in (pid_dir / name).read_text().split()] for name in os.listdir(pid_dir)}


def test_an_env_server_ends_with_its_killed_worker(tmp_path):
    env = functools.partial(ServerEnv, str(tmp_path))
    collector = MultiSyncCollector(env, ValuePolicy(w=1), num_workers=2, frames_per_batch=20,
                                   on_worker_failure="restart", mp_start_method=START)
    pids = collector.worker_pids()
    try:
        next(collector)
        servers = _servers(tmp_path)
        assert sorted(servers) == sorted(pids)
        victim = pids[1]
        os.kill(victim, signal.SIGKILL)
        # no call on the collector: the guard notices the death and ends the worker's group
        assert wait_gone(servers[victim], timeout=10) == []
        assert wait_gone(servers[pids[0]], timeout=0.5) == servers[pids[0]]  # the other worker's server runs on
        next(collector)  # the worker is restarted, with a server of its own
        assert len(_servers(tmp_path)) == 3
        pids += collector.worker_pids()
    finally:
        collector.shutdown()
    assert_gone(pids)
    every = [p for server in _servers(tmp_path).values() for p in server]
    assert wait_gone(every, timeout=0) == []  # close() forgot them: shutdown() ended them


def test_an_env_server_ends_with_the_collector_when_close_forgets_it(tmp_path):
    env = functools.partial(ServerEnv, str(tmp_path))
    with MultiSyncCollector(env, ValuePolicy(w=1), num_workers=2, frames_per_batch=20, total_frames=40,
                            mp_start_method=START) as collector:
        list(collector)
        pids = collector.worker_pids()
    assert_gone(pids)
    every = [p for server in _servers(tmp_path).values() for p in server]
    assert len(every) == 4 and wait_gone(every, timeout=0) == []
