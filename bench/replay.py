"""Free-running fill rate: ``start()`` with 2 workers on CartPole writing into a ReplayBuffer,
against the same ``MultiAsyncCollector`` iterated without a buffer (SPEC 7, SPEC 12).

    python -m bench.replay --seconds 10

Both are measured in the same run, alternating, best of ``--rounds``.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from rlcollect import GymEnv, MultiAsyncCollector, ReplayBuffer


def make_env():
    return GymEnv("CartPole-v1", num_envs=8)


def iterated_rate(seconds: float, workers: int, frames_per_batch: int) -> float:
    collector = MultiAsyncCollector(make_env, num_workers=workers, frames_per_batch=frames_per_batch)
    try:
        batches = iter(collector)
        for _ in range(workers * 2):
            next(batches)
        frames, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            frames += next(batches).numel()
        return frames / (time.perf_counter() - start)
    finally:
        collector.shutdown()


def free_running_rate(seconds: float, workers: int, frames_per_batch: int) -> float:
    rb = ReplayBuffer(5_000_000)
    collector = MultiAsyncCollector(make_env, num_workers=workers, frames_per_batch=frames_per_batch,
                                    replay_buffer=rb)
    try:
        collector.start()
        while rb.write_count < workers * 2 * frames_per_batch:  # warm up like the iterated run
            time.sleep(0.01)
        first, start = rb.write_count, time.perf_counter()
        time.sleep(seconds)
        return (rb.write_count - first) / (time.perf_counter() - start)
    finally:
        collector.async_shutdown()
        rb.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--frames-per-batch", type=int, default=2048)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    iterated = free = 0.0
    for _ in range(args.rounds):
        iterated = max(iterated, iterated_rate(args.seconds, args.workers, args.frames_per_batch))
        free = max(free, free_running_rate(args.seconds, args.workers, args.frames_per_batch))
    print(f"| config | fps | ratio |\n|---|---:|---:|\n"
          f"| MultiAsyncCollector iterated, {args.workers} workers x 8 CartPole envs | {iterated:,.0f} | 1.00 |\n"
          f"| start() into ReplayBuffer, same collector | {free:,.0f} | {free / iterated:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
