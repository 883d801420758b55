"""A replay buffer's owner (and its writers) for tests/buffers/test_rb_death.py, run as
``python rb_owner.py PHASE STORAGE``: prints one JSON line ``{"path", "pids"}`` once it has
reached PHASE, then stays in that phase until killed.

PHASE: ``constructed`` (sleeps), ``writing`` (two spawned writer processes extend the buffer in
a loop while the owner samples), ``state_dict`` (the owner takes state_dict() in a loop).
Writers exit when their parent is gone (so a killed owner leaves no process behind either).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time

import torch
from tensordict import TensorDict

from rlcollect.buffers import ReplayBuffer


def batch(n: int = 1000) -> TensorDict:
    return TensorDict({"obs": torch.ones(n, 64), ("next", "reward"): torch.zeros(n, 1)}, [n])


def writer(rb: ReplayBuffer, parent: int) -> None:
    frames = batch()
    while os.getppid() == parent:
        try:
            rb.extend(frames)
        except RuntimeError:  # the storage is gone: the owner died and its reaper removed it
            time.sleep(0.01)


def main(phase: str, storage: str) -> None:
    rb = ReplayBuffer(20_000, storage=storage)
    writers = []
    if phase in ("writing", "state_dict"):
        rb.extend(batch())
    if phase == "writing":
        ctx = multiprocessing.get_context("spawn")
        writers = [ctx.Process(target=writer, args=(rb.share(), os.getpid()), daemon=True) for _ in range(2)]
        for w in writers:
            w.start()
        start = rb.write_count
        while rb.write_count < start + 20_000:  # both writers are in their loop
            time.sleep(0.01)
    reaper = rb._reaper.process.pid if getattr(rb, "_reaper", None) else None
    info = {"path": rb.path, "reaper": reaper, "writers": [w.pid for w in writers]}
    print(json.dumps(info), flush=True)
    while True:
        if phase == "writing":
            rb.sample(256)
        elif phase == "state_dict":
            rb.state_dict()
        else:
            time.sleep(1)


if __name__ == "__main__":
    main(*sys.argv[1:])
