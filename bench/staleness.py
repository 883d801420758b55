"""Async throughput with a bound on policy lag, and with the schedule recorded (issue 26):
``MultiAsyncCollector`` with 2 workers x 8 CartPole envs and the MLP policy, a trainer that
pushes new weights after every batch, with ``max_policy_lag`` off, 1 and 4 (``"drop"``), 1
(``"wait"``), and off with ``record=`` on.

    python -m bench.staleness --seconds 8 --rounds 2

The variants are measured in the same run, alternating, best of ``--rounds``. "delivered" is
what the trainer gets per second; "collected" also counts the frames dropped for lag.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time

import torch

from bench.config import CARTPOLE, cartpole_mlp
from rlcollect import GymEnv, MultiAsyncCollector

#: (label, MultiAsyncCollector options); "record" is filled with a temporary path.
VARIANTS = [
    ("lag off (tag)", {}),
    ("max_policy_lag=1, drop", {"max_policy_lag": 1, "lag_policy": "drop"}),
    ("max_policy_lag=4, drop", {"max_policy_lag": 4, "lag_policy": "drop"}),
    ("max_policy_lag=1, wait", {"max_policy_lag": 1, "lag_policy": "wait"}),
    ("lag off, record on", {"record": None}),
]


def rate(options: dict, seconds: float, workers: int, envs: int, frames_per_batch: int) -> tuple[float, float]:
    """``(delivered, collected)`` frames per second over ``seconds``, after two batches per
    worker of warm-up; the weights are pushed after every batch."""
    collector = MultiAsyncCollector(functools.partial(GymEnv, CARTPOLE, num_envs=envs), cartpole_mlp(),
                                    num_workers=workers, frames_per_batch=frames_per_batch, **options)
    try:
        batches = iter(collector)
        for _ in range(workers * 2):
            next(batches)
            collector.update_policy_weights_()
        before = collector.stats()
        frames, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            frames += next(batches).numel()
            collector.update_policy_weights_()
        elapsed = time.perf_counter() - start
        after = collector.stats()
        dropped = after["lag_dropped_frames"] - before["lag_dropped_frames"]
        return frames / elapsed, (frames + dropped) / elapsed
    finally:
        collector.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.staleness", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--frames-per-batch", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    best = {label: (0.0, 0.0) for label, _ in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):
            for label, options in VARIANTS:
                if "record" in options:
                    options = {**options, "record": os.path.join(tmp, "schedule.jsonl")}
                got = rate(options, args.seconds, args.workers, args.envs, args.frames_per_batch)
                best[label] = max(best[label], got)
    base = best[VARIANTS[0][0]][0]
    print(f"| {args.workers} workers x {args.envs} CartPole envs, MLP, weights pushed after every batch "
          "| delivered fps | vs lag off | collected fps |\n|---|---:|---:|---:|")
    for label, (delivered, collected) in best.items():
        print(f"| {label} | {delivered:,.0f} | {delivered / base:.2f} | {collected:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
