"""How loaded the machine is now, for tests whose bound is a product claim measured on a quiet
machine ("the nodes are gone within 2 s of a Ctrl-C"): on a machine running other jobs, a process
gets a share of a core, and what it does in 2 s of CPU takes longer on the clock.

``slowdown()`` is that factor: the runnable threads per core (the larger of the 1-minute load
average and the count of runnable threads sampled now, over the cores), at least 1. ``scaled(s)``
is a bound of ``s`` seconds on a quiet machine, stretched by it and capped (a cap keeps the test
telling apart the paths it checks, e.g. a 1-s interrupted shutdown from the 10-s ordinary one).
"""

from __future__ import annotations

import os
import time


def _running_now() -> int:
    with open("/proc/loadavg") as f:
        running = int(f.read().split()[3].split("/")[0])
    return max(running - 1, 0)  # the reading process itself is running


def slowdown(samples: int = 5, interval: float = 0.04) -> float:
    cores = os.cpu_count() or 1
    running = []
    for _ in range(samples):
        running.append(_running_now())
        time.sleep(interval)
    load = max(os.getloadavg()[0], sum(running) / len(running))
    return max(1.0, load / cores)


def scaled(seconds: float, cap: float | None = None) -> float:
    bound = seconds * slowdown()
    return bound if cap is None else min(bound, cap)
