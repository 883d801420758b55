"""Run by test_mp_shm_full.py inside a private mount namespace whose /dev/shm is a 1 MiB tmpfs.

argv[1]: "precheck" (rlcollect's free-space check must refuse) or "torch" (the check is
disabled, so torch's own allocation fails). Prints the error, then the files left in /dev/shm."""

import functools
import os
import sys

from rlcollect import MultiSyncCollector
from rlcollect.envs.testing import CountingEnv
from rlcollect.multiprocess import shm

if __name__ == "__main__":
    if sys.argv[1] == "torch":
        shm.check_free_space = lambda needed, what: None
        import rlcollect.multiprocess.slots as slots

        slots.check_free_space = shm.check_free_space
    env = functools.partial(CountingEnv, obs_dim=256, max_steps=None)  # 2000 frames: about 4 MiB a slot
    try:
        MultiSyncCollector(env, num_workers=2, frames_per_batch=2000, mp_start_method="fork")
    except OSError as err:
        print("error", err.errno, str(err).replace("\n", " "), flush=True)
    print("left", sorted(os.listdir("/dev/shm")), flush=True)
