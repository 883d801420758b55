"""Multi-agent rows: VMAS ``navigation`` (4 agents) with 1,024 and 4,096 instances, rlcollect's
``Collector`` + ``rlcollect.envs.VmasEnv`` against torchrl 0.14's ``Collector`` + torchrl's
``VmasEnv``; and PettingZoo's ``simple_spread_v3`` (mpe2, 3 agents, one env), rlcollect's
``Collector`` on the raw ``ParallelEnv`` against torchrl's ``Collector`` +
``PettingZooWrapper(use_mask=True)``. The same scenario, seed and random policy, in one process
each, alternated.

Run it where both are installed (the torchrl venv with ``vmas``)::

    python -m bench.marl [--seconds 5] [--rounds 2]

prints one line per row and run: frames/s (env instances x steps) and CPU-seconds per 1,000
agent-steps (the process's user + system time, one torch thread). Not part of ``python -m bench``
(whose suite runs torchrl in a separate interpreter); the figures it gave are in
docs/multi-agent.md with the date, machine load and command.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

AGENTS = 4


def _ours(instances: int, steps: int):
    from rlcollect import Collector
    from rlcollect.envs import VmasEnv

    env = VmasEnv(scenario="navigation", num_envs=instances, max_steps=100, seed=0)
    return Collector(env, None, frames_per_batch=instances * steps)


def _torchrl(instances: int, steps: int):
    from torchrl.collectors import Collector
    from torchrl.envs.libs.vmas import VmasEnv

    env = VmasEnv("navigation", num_envs=instances, max_steps=100, seed=0, device="cpu")
    return Collector(env, None, frames_per_batch=instances * steps)


def _spread():
    from mpe2 import simple_spread_v3

    return simple_spread_v3.parallel_env(N=3, max_cycles=25)


def _ours_spread(instances: int, steps: int):
    from rlcollect import Collector

    return Collector(_spread(), None, frames_per_batch=steps)


def _torchrl_spread(instances: int, steps: int):
    from torchrl.collectors import Collector
    from torchrl.envs.libs.pettingzoo import PettingZooWrapper

    return Collector(PettingZooWrapper(_spread(), use_mask=True), None, frames_per_batch=steps)


def measure(make, instances: int, seconds: float, steps: int = 25, agents: int = AGENTS) -> tuple[float, float]:
    """(frames/s, CPU-seconds per 1,000 agent-steps) over batches of ``steps`` steps, after one
    warm-up batch, until ``seconds`` have passed."""
    collector = make(instances, steps)
    try:
        batches = iter(collector)
        next(batches)
        frames, wall0, cpu0 = 0, time.perf_counter(), os.times()
        while time.perf_counter() - wall0 < seconds:
            frames += next(batches).numel()
        wall, cpu1 = time.perf_counter() - wall0, os.times()
    finally:
        collector.shutdown()
    cpu = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    return frames / wall, cpu / (frames * agents / 1000)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--instances", type=int, nargs="*", default=[1024, 4096],
                        help="VMAS rows (none: only PettingZoo)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for r in range(args.rounds):
        for name, make in (("rlcollect", _ours_spread), ("torchrl", _torchrl_spread)):
            fps, cpu = measure(make, 1, args.seconds, steps=250, agents=3)
            print(f"pettingzoo-simple_spread round={r} {name}: {fps:,.0f} frames/s, "
                  f"{cpu:.4f} CPU-s per 1,000 agent-steps", flush=True)
    for instances in args.instances:
        for r in range(args.rounds):
            for name, make in (("rlcollect", _ours), ("torchrl", _torchrl)):
                fps, cpu = measure(make, instances, args.seconds)
                print(f"vmas-navigation instances={instances} round={r} {name}: {fps:,.0f} frames/s, "
                      f"{cpu:.4f} CPU-s per 1,000 agent-steps", flush=True)


if __name__ == "__main__":
    main()
