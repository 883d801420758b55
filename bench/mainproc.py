"""The main process's cost per delivered batch (issue 34 item 2): its own CPU time per batch of
``MultiSyncCollector`` and ``MultiAsyncCollector`` (CartPole, random actions, ``WORKERS``
workers started with "fork", small and large batches), beside the number of main-process hops
one batch takes (``bench/hops.py``).

The CPU is ``time.process_time()`` of the main process (all its threads) over the timed window
divided by the batches delivered in it, the loop that iterates the collector included (it only
counts frames): what the trainer's process pays to receive a batch, whatever the workers do. The
target is 0.1 ms per batch, at any batch size.

Run alone: ``python -m bench --only "main process"``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from bench.config import CARTPOLE

WORKERS = 2
#: Frames per batch (sync: all workers' share; async: one worker's batch).
BATCHES = (200, 2000)
WARMUP_S = 0.5
#: Issue 34's target: the main process's CPU per delivered batch, at most this many milliseconds.
TARGET_MS = 0.1


def main_cpu_per_batch(collector_cls: type, frames_per_batch: int, seconds: float) -> dict:
    """Iterate a fresh collector for ``seconds`` (after ``WARMUP_S`` of batches): the main
    process's CPU and wall milliseconds per delivered batch."""
    collector = collector_cls(CARTPOLE, num_workers=WORKERS, frames_per_batch=frames_per_batch, total_frames=-1,
                              mp_start_method="fork")
    try:
        batches = iter(collector)
        warmup_end = time.perf_counter() + WARMUP_S
        next(batches)
        while time.perf_counter() < warmup_end:
            next(batches)
        delivered = frames = 0
        cpu = time.process_time()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            frames += next(batches).numel()
            delivered += 1
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
    finally:
        collector.shutdown()
    return {"cpu_ms": cpu / delivered * 1e3, "wall_ms": wall / delivered * 1e3, "batches": delivered,
            "frames_per_s": frames / wall}


@dataclass
class MainProcessRow:
    collector: str
    frames_per_batch: int
    cpu_ms: list[float] = field(default_factory=list)
    wall_ms: list[float] = field(default_factory=list)
    batches: int = 0
    hops: int | None = None

    @property
    def median_cpu_ms(self) -> float:
        return statistics.median(self.cpu_ms)

    @property
    def met(self) -> bool:
        return self.median_cpu_ms <= TARGET_MS


@dataclass
class MainProcessResult:
    rows: list[MainProcessRow]

    def table(self) -> str:
        header = ("main process per batch", "frames/batch", "main CPU ms/batch (median)", "rounds",
                  "wall ms/batch (median)", "batches (last round)", "hops/batch", "target")
        lines = [
            (f"{r.collector}, CartPole random, {WORKERS} workers (fork)", str(r.frames_per_batch),
             f"{r.median_cpu_ms:.3f}", "/".join(f"{v:.3f}" for v in r.cpu_ms), f"{statistics.median(r.wall_ms):.2f}",
             str(r.batches), "" if r.hops is None else str(r.hops),
             f"≤ {TARGET_MS:g} ms: " + ("met" if r.met else "MISSED"))
            for r in self.rows
        ]
        return "\n".join(["| " + " | ".join(cells) + " |" for cells in (header, ("---",) * len(header), *lines)])

    def as_dict(self) -> dict:
        return {"config": MainProcessConfig.name,
                "rows": [{"collector": r.collector, "frames_per_batch": r.frames_per_batch, "cpu_ms": r.cpu_ms,
                          "median_cpu_ms": r.median_cpu_ms, "wall_ms": r.wall_ms, "hops": r.hops, "met": r.met}
                         for r in self.rows]}


class MainProcessConfig:
    """The suite's entry (a config with ``run``): rounds alternate over every row, the median
    of the rounds counts (one figure per round, each a fresh collector)."""

    torchrl = None  # no torchrl counterpart here
    name = f"main process CPU per batch, {CARTPOLE} random, {WORKERS} workers, MultiSync/MultiAsync"

    def run(self, seconds: float, rounds: int, log, torchrl_python: str | None = None) -> MainProcessResult:
        from bench.hops import count_hops
        from rlcollect import MultiAsyncCollector, MultiSyncCollector

        classes = {"MultiSync": MultiSyncCollector, "MultiAsync": MultiAsyncCollector}
        rows = [MainProcessRow(name, fpb) for name in classes for fpb in BATCHES]
        hops = {name: len(count_hops(cls)) - 1 for name, cls in classes.items()}
        for row in rows:
            row.hops = hops[row.collector] if row.frames_per_batch == 200 else None  # bench/hops.py counts 200
        per_round = seconds / rounds
        for i in range(rounds):
            log(f"{self.name}: round {i + 1}/{rounds}")
            for row in rows:
                out = main_cpu_per_batch(classes[row.collector], row.frames_per_batch, per_round)
                row.cpu_ms.append(out["cpu_ms"])
                row.wall_ms.append(out["wall_ms"])
                row.batches = out["batches"]
        return MainProcessResult(rows)


def mainproc_configs() -> list[MainProcessConfig]:
    return [MainProcessConfig()]
