"""Run by test_mp_ctrl_c.py: a MultiSyncCollector collecting slowly until interrupted. Prints
"building", its processes' pids once built, then "collecting" after the first batch."""

import functools
import sys

from rlcollect import MultiSyncCollector
from rlcollect.envs.testing import SleepEnv

if __name__ == "__main__":
    method = sys.argv[1]
    env = functools.partial(SleepEnv, step_time=0.01, obs_dim=1)
    print("building", flush=True)
    with MultiSyncCollector(env, num_workers=2, frames_per_batch=200, mp_start_method=method) as collector:
        print("pids", *collector.worker_pids(), collector._pool.reaper.pid, flush=True)
        for i, _ in enumerate(collector):
            if i == 0:
                print("collecting", flush=True)
