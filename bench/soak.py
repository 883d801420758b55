"""Soak test: run a multi-process collector for a long time with weight updates every batch and
faults injected at intervals, and watch for hangs, leaks and lost restarts.

    python -m bench.soak --minutes 10 --fault-every 30

Prints, every ``--report-every`` seconds, frames collected, restarts, the main process's RSS,
its open fds and the /dev/shm entries; at the end a summary with the RSS growth after the first
minute. Faults rotate through raise / exit / kill / segfault / hang (the hang is caught by
``worker_timeout``); each is injected into one worker through ``FaultyEnv``'s trigger file.

    python -m bench.soak --nodes 2 --minutes 10 --fault-every 30

runs a ``DistributedCollector`` ("mp" launcher, ``on_node_failure="restart"``) instead, and
faults its nodes from outside, rotating SIGKILL and SIGSTOP (a frozen node, found by its
heartbeat and its watcher's report) through the nodes; the summary adds the lost batches and
checks that the frames delivered equal ``stats()["frames"]``.

    python -m bench.soak --nodes 2 --launcher ray --minutes 10 --fault-every 30

the same with Ray actors as nodes (``launcher="ray"``, on a local Ray instance the soak starts
with ``ray.init``): the faults SIGKILL and SIGSTOP the actors' processes.

    python -m bench.soak --free-running --minutes 10 --fault-every 30

runs the workers free (``start()`` into a shared ``ReplayBuffer``) and SIGKILLs one worker per
fault, rotating through them, then pauses (``pause()``: the dead worker is restarted); the summary
adds the buffer's ``write_count`` and the frames lost (``write_count - stats()["frames"]``: the
batches the killed workers were writing, at most one batch per kill).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time

import torch

from rlcollect import DistributedCollector, FaultyEnv, MultiAsyncCollector, MultiSyncCollector

FAULT_CYCLE = ("raise", "exit", "kill", "segfault", "hang")
NODE_FAULT_CYCLE = ("kill", "stop")


class SoakPolicy(torch.nn.Module):
    """A small MLP from the 1-d count observation to one of two actions."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(1, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return self.net(observation / 100.0).argmax(-1)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_entries() -> int:
    return len(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    parser.add_argument("--fault-every", type=float, default=30.0, help="seconds between injected faults")
    parser.add_argument("--report-every", type=float, default=15.0, help="seconds between progress lines")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mode", choices=("sync", "async"), default="async")
    parser.add_argument("--frames-per-batch", type=int, default=2000)
    parser.add_argument("--nodes", type=int, default=0, help="soak a DistributedCollector with this many nodes")
    parser.add_argument("--start-timeout", type=float, default=300.0,
                        help="with --nodes: the nodes' start_timeout (a soak measures the steady state; Ray's "
                             "actors importing torch at load 8 took more than the collector's default 120 s)")
    parser.add_argument("--launcher", choices=("mp", "ray"), default="mp",
                        help="with --nodes: how the nodes are started (ray: a local Ray instance)")
    parser.add_argument("--free-running", action="store_true",
                        help="workers write a shared ReplayBuffer on their own (start()); faults are SIGKILLs")
    parser.add_argument("--json", metavar="PATH", help="also write the samples and summary as JSON")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="rlcollect-soak-")
    trigger = os.path.join(workdir, "fault")
    env = functools.partial(FaultyEnv, at_step=None, trigger_file=trigger, max_steps=200)
    policy = SoakPolicy()
    cls = MultiSyncCollector if args.mode == "sync" else MultiAsyncCollector
    if args.free_running:
        return _soak_free_running(args, cls, policy, open_fds(), shm_entries())
    ray = None
    if args.nodes and args.launcher == "ray":
        import ray  # (the [ray] extra)

        ray.init(address="local", num_cpus=args.nodes + 2, include_dashboard=False, logging_level="WARNING")
    start_fds, start_shm = open_fds(), shm_entries()
    if args.nodes:
        collector = DistributedCollector(
            [env] * args.nodes, policy,
            frames_per_batch=args.frames_per_batch * (args.nodes if args.mode == "sync" else 1),
            sync=args.mode == "sync",
            on_node_failure="restart", max_node_restarts=10_000, heartbeat_timeout=3.0,
            launcher=args.launcher, start_timeout=args.start_timeout, collector_kwargs={"track_policy_version": True})
    else:
        collector = cls(env, policy, num_workers=args.workers, frames_per_batch=args.frames_per_batch,
                        on_worker_failure="restart", max_worker_restarts=10_000, worker_timeout=5.0,
                        track_policy_version=True)
    began = time.monotonic()
    deadline = began + args.minutes * 60
    next_fault, next_report, faults = began + args.fault_every, began, 0
    samples: list[dict] = []
    frames = 0
    try:
        for batch in collector:
            frames += batch.numel()
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 1e-3)
            collector.update_policy_weights_()
            now = time.monotonic()
            if args.nodes and now >= next_fault:
                _fault_node(collector, NODE_FAULT_CYCLE[faults % len(NODE_FAULT_CYCLE)], faults % args.nodes)
                faults += 1
                next_fault = now + args.fault_every
            elif not args.nodes and now >= next_fault and not os.path.exists(trigger):  # the last fault was claimed
                kind = FAULT_CYCLE[faults % len(FAULT_CYCLE)]
                with open(trigger + ".tmp", "w") as f:
                    f.write(f"{kind} {faults % args.workers}")
                os.rename(trigger + ".tmp", trigger)
                faults += 1
                next_fault = now + args.fault_every
            if now >= next_report or now >= deadline:
                stats = collector.stats()
                sample = {"t_s": round(now - began, 1), "frames": frames, "restarts": stats["restarts"],
                          "faults_injected": faults, "rss_mb": round(rss_mb(), 1), "fds": open_fds(),
                          "shm": shm_entries(), "fps": round(stats["fps"])}
                samples.append(sample)
                print(json.dumps(sample), flush=True)
                next_report = now + args.report_every
            if now >= deadline:
                break
        stats = collector.stats()
    finally:
        collector.shutdown()
        if ray is not None:
            ray.shutdown()
    after_minute = [s for s in samples if s["t_s"] >= 60] or samples
    summary = {
        "frames": frames, "seconds": round(time.monotonic() - began, 1), "faults_injected": faults,
        "restarts": samples[-1]["restarts"] if samples else 0,
        "rss_growth_after_first_minute_mb": round(samples[-1]["rss_mb"] - after_minute[0]["rss_mb"], 1),
        "fds_start": start_fds, "fds_end": open_fds(), "shm_start": start_shm, "shm_end": shm_entries(),
        "frames_equal_stats": frames == stats["frames"], "lost_batches": stats.get("lost_batches", 0),
    }
    if args.nodes:
        summary["launcher"] = args.launcher
    print("summary", json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": samples, "summary": summary}, f, indent=1)
    return 0


def _soak_free_running(args: argparse.Namespace, cls: type, policy: torch.nn.Module, start_fds: int,
                       start_shm: int) -> int:
    """The workers run free into a ReplayBuffer; every ``fault_every`` s one is SIGKILLed, and
    ``pause()`` (each report, or the fault's own) restarts it."""
    import signal

    from rlcollect import CountingEnv, ReplayBuffer

    rb = ReplayBuffer(1_000_000)
    collector = cls(functools.partial(CountingEnv, max_steps=200), policy, num_workers=args.workers,
                    frames_per_batch=args.frames_per_batch, replay_buffer=rb, on_worker_failure="restart",
                    max_worker_restarts=10_000, worker_timeout=30.0)
    began = time.monotonic()
    deadline = began + args.minutes * 60
    next_fault, next_report, faults = began + args.fault_every, began, 0
    samples: list[dict] = []
    try:
        collector.start()
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            if now >= next_fault:
                pid = collector.worker_pids()[faults % args.workers]
                os.kill(pid, signal.SIGKILL)
                faults += 1
                next_fault = now + args.fault_every
                time.sleep(0.5)
                with collector.pause():  # the dead worker is found and restarted here
                    pass
            if now >= next_report or now >= deadline:
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(torch.randn_like(p) * 1e-3)
                collector.update_policy_weights_()
                stats = collector.stats()
                sample = {"t_s": round(now - began, 1), "frames": stats["frames"], "write_count": rb.write_count,
                          "restarts": stats["restarts"], "faults_injected": faults, "rss_mb": round(rss_mb(), 1),
                          "fds": open_fds(), "shm": shm_entries()}
                samples.append(sample)
                print(json.dumps(sample), flush=True)
                next_report = now + args.report_every
            if now >= deadline:
                break
        collector.async_shutdown()
        stats = collector.stats()
        write_count = rb.write_count
    finally:
        collector.shutdown()
        rb.close()
    after_minute = [s for s in samples if s["t_s"] >= 60] or samples
    summary = {
        "mode": "free-running", "frames": stats["frames"], "write_count": write_count,
        "frames_lost": write_count - stats["frames"], "lost_bound": faults * args.frames_per_batch,
        "seconds": round(time.monotonic() - began, 1), "faults_injected": faults, "restarts": stats["restarts"],
        "rss_growth_after_first_minute_mb": round(samples[-1]["rss_mb"] - after_minute[0]["rss_mb"], 1),
        "fds_start": start_fds, "fds_end": open_fds(), "shm_start": start_shm, "shm_end": shm_entries(),
    }
    print("summary", json.dumps(summary), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": samples, "summary": summary}, f, indent=1)
    return 0


def _fault_node(collector: DistributedCollector, kind: str, node: int) -> None:
    """SIGKILL or SIGSTOP node ``node``'s process (a stopped one is killed by its relaunch)."""
    import signal

    pid = collector.stats()["workers"][node]["pid"]
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
