"""Run by test_mp_worker_kill.py, with its own TMPDIR: collects with two workers, SIGKILLs worker
0 (restarted), collects on, shuts down, and prints as JSON the ``pymp-*`` folders (multiprocessing's
per-process temp folders) of TMPDIR other than this process's own, which its exit removes.

argv: the start method."""

import functools
import json
import multiprocessing.util
import os
import signal
import sys
import tempfile
from pathlib import Path

from rlcollect import MultiSyncCollector
from rlcollect.envs.testing import CountingEnv

if __name__ == "__main__":
    env = functools.partial(CountingEnv, max_steps=5)
    collector = MultiSyncCollector(env, num_workers=2, frames_per_batch=20, total_frames=-1,
                                   on_worker_failure="restart", mp_start_method=sys.argv[1])
    try:
        batches = iter(collector)
        next(batches)
        victim = collector.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        next(batches)
        next(batches)
        assert collector.stats()["restarts"] == 1 and collector.worker_pids()[0] != victim
    finally:
        collector.shutdown()
    own = Path(multiprocessing.util.get_temp_dir())
    print(json.dumps(sorted(p.name for p in Path(tempfile.gettempdir()).glob("pymp-*") if p != own)))
