"""Start-up rows: seconds from ``MultiSyncCollector(...)`` to its first batch, 4 CartPole workers
with a random policy, for each start method, **cold** (the first collector of a fresh
interpreter: for "forkserver" that includes launching the fork server and its imports) and
**warm** (a second collector built right after the first was shut down, in the same
interpreter: the fork server is running). The clock starts after the script's imports, so what is
timed is the collector's own start-up. Each row says the 1-minute load average when it ran.

One script measures both rows of a method; the warm figure of a cold run is kept for the warm
row's next round, so each round runs one interpreter per method.
"""

from __future__ import annotations

import os
import sys

from bench.config import CARTPOLE, StartupConfig, torchrl_key
from bench.measure import Duration, run_json

WORKERS = 4
FRAMES_PER_BATCH = 1000
#: (name in the row, ``mp_start_method`` passed; None: the argument is left out). The benchmark's
#: script runs no other thread and no CUDA, so the default picks "fork" there (which the row's
#: note confirms); "forkserver" is what the default picks in a program that does run threads.
METHODS = (("the default", None), ("forkserver", "forkserver"), ("spawn", "spawn"))

_SCRIPT = """
import json, os, sys, time
from rlcollect import MultiSyncCollector
MultiSyncCollector  # resolve the lazy import (and tensordict) before the clock starts
if __name__ == "__main__":
    options = {{}} if {method!r} is None else {{"mp_start_method": {method!r}}}
    out = {{"load": os.getloadavg()[0]}}
    for run in ("cold", "warm"):
        start = time.perf_counter()
        collector = MultiSyncCollector([{env!r}] * {workers}, None, frames_per_batch={fpb}, total_frames=-1,
                                       **options)
        built = time.perf_counter()
        next(iter(collector))
        out[run] = time.perf_counter() - start
        out[run + "_construct"] = built - start
        out["method"] = collector.mp_start_method
        collector.shutdown()
    print(json.dumps(out))
"""


def _measure(method: str | None) -> dict:
    script = _SCRIPT.format(method=method, env=CARTPOLE, workers=WORKERS, fpb=FRAMES_PER_BATCH)
    return run_json([sys.executable, "-c", script], timeout=300)


def startup_configs() -> list[StartupConfig]:
    configs = []
    for name, method in METHODS:
        pending: list[dict] = []  # warm figures of cold runs, not yet reported

        def cold(method=method, pending=pending) -> Duration:
            out = _measure(method)
            pending.append(out)
            return Duration(out["cold"], f"fresh interpreter; {out.get('method', method)!r}; construction "
                                         f"{out['cold_construct']:.2f} s; load {out['load']:.1f}")

        def warm(method=method, pending=pending) -> Duration:
            out = pending.pop(0) if pending else _measure(method)
            return Duration(out["warm"], f"second collector of the interpreter; {out.get('method', method)!r}; "
                                         f"construction {out['warm_construct']:.2f} s; load {out['load']:.1f}")

        label = f"start-up: first batch, {CARTPOLE} random, {WORKERS} workers, MultiSync, {name}"
        # torchrl has no fork server to keep warm: its figure (a cold start) goes beside the default's.
        key = torchrl_key("first-batch", CARTPOLE, workers=WORKERS, frames_per_batch=FRAMES_PER_BATCH) \
            if method is None else None
        configs.append(StartupConfig(f"{label}, cold", cold, torchrl=key))
        configs.append(StartupConfig(f"{label}, warm", warm))
    return configs


if __name__ == "__main__":  # a quick look without the suite: python -m bench.startup
    for config in startup_configs():
        result = config.measure()
        print(f"{config.name}: {result.seconds:.2f} s ({result.how}); cpus {os.cpu_count()}")
