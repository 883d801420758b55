"""Where a MultiSync round's time goes on Pong with random actions (issue 34 item 3, findings
only): for the main process and each worker, the share of the timed window it spent on a CPU,
waiting on the run queue (ready, but another process had the core) and asleep (a worker: waiting
for the next round once its share is collected; the main process: waiting for the workers),
from the kernel's ``/proc/PID/schedstat``; beside it the same for the bare loops at once
(``bench/real.py``'s ideal: 2 processes × 4 envs, no collector).

Run: ``python -m bench.synctrace [SECONDS]`` (needs ale-py).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import time
import warnings


def _schedstat(pid: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds waiting on the run queue) of ``pid`` (all its threads' sum for
    the process's main thread only: ``/proc/PID/schedstat``); None if it is gone."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            on_cpu, waiting, _ = f.read().split()
    except OSError:
        return None
    return int(on_cpu) / 1e9, int(waiting) / 1e9


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            if int(text[text.rindex(")") + 2:].split()[1]) == pid:
                found.append(int(entry))
    return found


def shares(pids: dict[str, int], window) -> dict[str, tuple[float, float, float]]:
    """Run ``window()`` (which returns its wall seconds) and return, per named pid, the shares
    of that wall time on a CPU, on the run queue, and asleep."""
    before = {name: _schedstat(pid) for name, pid in pids.items()}
    wall = window()
    out = {}
    for name, pid in pids.items():
        after = _schedstat(pid)
        if before[name] is None or after is None:
            continue
        cpu, queued = after[0] - before[name][0], after[1] - before[name][1]
        out[name] = (cpu / wall, queued / wall, max(0.0, 1 - (cpu + queued) / wall))
    return out


def multisync(seconds: float) -> dict:
    import torch

    from bench.workloads import WORKLOADS
    from rlcollect import GymEnv, MultiSyncCollector

    torch.set_num_threads(1)
    workload = WORKLOADS["Pong"]
    collector = MultiSyncCollector(functools.partial(GymEnv, workload.make_env, num_envs=4), None, num_workers=2,
                                   frames_per_batch=2 * 4 * workload.steps_per_worker_batch, total_frames=-1)
    try:
        batches = iter(collector)
        next(batches)
        warm = time.perf_counter() + 1.0
        while time.perf_counter() < warm:
            next(batches)
        workers = [pid for pid in _children(os.getpid()) if _schedstat(pid) is not None]
        # (the children include the start method's helpers, e.g. the fork server: asleep throughout)
        pids = {"main": os.getpid(), **{f"child {i}": pid for i, pid in enumerate(sorted(workers))}}
        counted = {"frames": 0, "batches": 0}

        def window() -> float:
            start = time.perf_counter()
            while time.perf_counter() - start < seconds:
                counted["frames"] += next(batches).numel()
                counted["batches"] += 1
            return time.perf_counter() - start

        before = collector.stats()
        out = shares(pids, window)
        after = collector.stats()
        steps = {w["index"]: (w["env_step_mean_s"], w["env_step_p95_s"]) for w in after["workers"]}
        wall = after["elapsed_s"] - before["elapsed_s"]
        waited = after["wait_s"] - before["wait_s"]
        return {"shares": out, "steps_per_s": counted["frames"] / wall, "batches": counted["batches"],
                "main_wait_share": waited / wall, "env_step_mean_p95_s": steps}
    finally:
        collector.shutdown()


def _bare(seconds: float, conn) -> None:
    from bench.real import bare_loop

    conn.send(bare_loop("Pong", 4, False, seconds).frames_per_s)


def bare_at_once(seconds: float) -> dict:
    context = multiprocessing.get_context("fork")
    pipes = [context.Pipe(duplex=False) for _ in range(2)]
    procs = [context.Process(target=_bare, args=(seconds + 2.0, send)) for _, send in pipes]
    for proc in procs:
        proc.start()
    time.sleep(1.5)  # the envs built and the loops warm
    pids = {f"process {i}": proc.pid for i, proc in enumerate(procs)}
    out = shares(pids, lambda: (time.sleep(seconds), seconds)[1])
    rate = sum(receive.recv() for receive, _ in pipes)
    for proc in procs:
        proc.join()
    return {"shares": out, "steps_per_s": rate}


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    seconds = float(argv[0]) if argv else 6.0
    load = os.getloadavg()[0]
    for name, measure in (("bare loops at once", bare_at_once), ("MultiSync", multisync),
                          ("bare loops at once", bare_at_once), ("MultiSync", multisync)):
        got = measure(seconds)
        print(f"{name}: {got['steps_per_s']:,.0f} steps/s", {k: v for k, v in got.items()
                                                             if k not in ("shares", "steps_per_s")})
        for who, (cpu, queued, asleep) in got["shares"].items():
            print(f"  {who:10s} on CPU {cpu:5.1%}  run queue {queued:5.1%}  asleep {asleep:5.1%}")
    print(f"load average {load:.1f} at start, {os.getloadavg()[0]:.1f} at end; {seconds:g}-s windows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
