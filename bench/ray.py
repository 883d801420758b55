"""``python -m bench --only ray``: ``DistributedCollector(launcher="ray")`` against ``launcher="mp"``
with the same nodes (2 nodes x 1 CartPole-v1, random policy), in the same run, rounds alternating:

- time to first batch: the constructor (nodes started, joined, configured) plus the first batch,
  with Ray already up (a local instance the benchmark starts first; its start is reported apart);
- frames/s, sync (1000 frames per node per batch) and async (1000 per node batch);
- restart-to-rejoin: SIGKILL of node 0's process (``on_node_failure="restart"``, async) until the
  relaunched node delivers a batch again.

Needs Ray (``pip install 'rlcollect[ray]'``); without it the table says so.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from dataclasses import dataclass, field

from bench.config import CARTPOLE

LAUNCHERS = ("mp", "ray")
NODES = 2
FRAMES = 1000  # per node per batch


@dataclass
class RayResult:
    rows: dict[str, dict] = field(default_factory=dict)  # launcher -> best figures
    ray_start_s: float | None = None
    ray_stop_s: float | None = None
    skip: str = ""

    def table(self) -> str:
        lines = [f"Ray: launcher='ray' vs 'mp', {NODES} nodes x 1 {CARTPOLE}, random policy, {FRAMES} frames per node "
                 "per batch (best of the rounds; time to first batch, rejoin and CPU s per 1,000 frames: the "
                 "lowest; CPU: this process and its descendants, the local Ray instance's included)"]
        if self.skip:
            return "\n".join([*lines, f"skipped: {self.skip}"])
        lines.append(f"Ray local instance: ray.init {self.ray_start_s:.1f} s, ray.shutdown {self.ray_stop_s:.1f} s")
        lines += ["| launcher | time to first batch s | sync frames/s | async frames/s | restart-to-rejoin s "
                  "| sync CPU s/1k frames | async CPU s/1k frames |", "|---|---:|---:|---:|---:|---:|---:|"]
        for launcher in LAUNCHERS:
            r = self.rows.get(launcher, {})
            lines.append(f"| {launcher} | {r.get('first_batch_s', float('nan')):.2f} | {r.get('sync_fps', 0):,.0f} | "
                         f"{r.get('async_fps', 0):,.0f} | {r.get('rejoin_s', float('nan')):.2f} | "
                         f"{r.get('sync_cpu_per_kframe', float('nan')):.3f} | "
                         f"{r.get('async_cpu_per_kframe', float('nan')):.3f} |")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"config": RayConfig.name, "rows": self.rows, "ray_start_s": self.ray_start_s,
                "ray_stop_s": self.ray_stop_s, "skip": self.skip}


def _rate(collector, seconds: float) -> tuple[float, float]:
    """Frames/s, and CPU seconds per 1,000 frames of this process and its descendants (with
    ``launcher="ray"`` the local Ray instance started here: its daemons and the node actors)."""
    from bench.workloads import cpu_seconds

    it = iter(collector)
    next(it)  # warm
    frames, cpu, start = 0, cpu_seconds()["total"], time.perf_counter()
    while time.perf_counter() - start < seconds:
        frames += next(it).numel()
    return frames / (time.perf_counter() - start), (cpu_seconds()["total"] - cpu) / frames * 1e3


def _measure(launcher: str, seconds: float) -> dict:
    from rlcollect import DistributedCollector

    out = {}
    started = time.perf_counter()
    with DistributedCollector([CARTPOLE] * NODES, frames_per_batch=FRAMES, total_frames=-1, sync=False,
                              launcher=launcher, on_node_failure="restart") as c:
        it = iter(c)
        next(it)
        out["first_batch_s"] = time.perf_counter() - started
        out["async_fps"], out["async_cpu_per_kframe"] = _rate(c, seconds)
        os.kill(c.stats()["workers"][0]["pid"], signal.SIGKILL)
        killed = time.perf_counter()
        while True:
            batch = next(it)
            if c.stats()["workers"][0]["restarts"] == 1 and int(batch["collector", "node_id"][0]) == 0:
                out["rejoin_s"] = time.perf_counter() - killed
                break
    with DistributedCollector([CARTPOLE] * NODES, frames_per_batch=FRAMES * NODES, total_frames=-1, sync=True,
                              launcher=launcher) as c:
        out["sync_fps"], out["sync_cpu_per_kframe"] = _rate(c, seconds)
    return out


@dataclass
class RayConfig:
    """The ``--only ray`` measurement (bench/suite.py runs ``run`` and prints ``table``)."""

    name = "ray: launcher='ray' vs 'mp', 2 nodes, time to first batch, frames/s, restart-to-rejoin"
    budget: float = 1.0
    torchrl = None  # (no torchrl side)

    def run(self, seconds: float, rounds: int, log, torchrl_python: str | None = None) -> RayResult:
        result = RayResult()
        if importlib.util.find_spec("ray") is None:
            result.skip = "Ray is not installed (pip install 'rlcollect[ray]')"
            return result
        import ray

        started = time.perf_counter()
        ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False,
                 logging_level="WARNING")
        result.ray_start_s = time.perf_counter() - started
        try:
            per_round = max(1.0, seconds * self.budget / rounds)
            for i in range(rounds):
                for launcher in LAUNCHERS if i % 2 == 0 else LAUNCHERS[::-1]:
                    log(f"{self.name}: {launcher}, round {i + 1}/{rounds}")
                    got = _measure(launcher, per_round)
                    best = result.rows.setdefault(launcher, {})
                    for key, value in got.items():
                        better = max if key.endswith("fps") else min
                        best[key] = value if key not in best else better(best[key], value)
        finally:
            stopped = time.perf_counter()
            ray.shutdown()
            result.ray_stop_s = time.perf_counter() - stopped
        return result


def ray_configs() -> list[RayConfig]:
    return [RayConfig()]
