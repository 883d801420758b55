"""Run by test_mp_parent_death.py: builds a MultiSyncCollector and collects until killed.

argv: start method ("default": the argument left out), phase ("imports", "construct" or "collect"), marker folder. With
"construct" each worker's env constructor touches ``<folder>/ctor.<pid>`` and then blocks; with
"collect" the script prints "collecting" once the collector is built."""

import functools
import os
import sys
import time

from rlcollect import MultiSyncCollector
from rlcollect.envs.testing import SleepEnv


def blocking_env(folder):
    open(os.path.join(folder, f"ctor.{os.getpid()}"), "w").close()
    time.sleep(120)


if __name__ == "__main__":
    method, phase, folder = sys.argv[1:4]
    if phase == "construct":
        env = functools.partial(blocking_env, folder)
    else:
        env = functools.partial(SleepEnv, step_time=0.01, obs_dim=1)
    print("building", flush=True)
    options = {} if method == "default" else {"mp_start_method": method}
    collector = MultiSyncCollector(env, num_workers=2, frames_per_batch=200, **options)
    print("collecting", flush=True)
    for _ in collector:
        pass
