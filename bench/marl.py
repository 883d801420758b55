"""Multi-agent rows: VMAS ``navigation`` (4 agents) with 1,024 and 4,096 instances, rlcollect's
``Collector`` + ``rlcollect.envs.VmasEnv`` against torchrl 0.14's ``Collector`` + torchrl's
``VmasEnv``; and PettingZoo's ``simple_spread_v3`` (mpe2, 3 agents, one env), rlcollect's
``Collector`` on the raw ``ParallelEnv`` against torchrl's ``Collector`` +
``PettingZooWrapper(use_mask=True)``. The same scenario, seed and random policy, in one process
each, alternated.

Run it where both are installed (the torchrl venv with ``vmas``)::

    python -m bench.marl [--seconds 5] [--rounds 2]

prints one line per row and run: frames/s (env instances x steps) and CPU-seconds per 1,000
agent-steps (the process's user + system time, one torch thread); the figures it gave are in
docs/multi-agent.md with the date, machine load and command.

In ``python -m bench`` (``--only marl``) the same rows are one configuration (``MarlConfig``):
rlcollect measured in the suite's process, torchrl in its own interpreter
(``--torchrl-python``, which runs ``python -m bench.marl --side torchrl --row NAME``), rounds
alternating; without vmas, pettingzoo or mpe2 installed the table says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

AGENTS = 4
ROOT = str(Path(__file__).resolve().parent.parent)


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


#: (row name, instances, steps per batch, agents, rlcollect's maker, torchrl's maker)
ROWS = {
    "pettingzoo-simple_spread": (1, 250, 3, _ours_spread, _torchrl_spread),
    "vmas-navigation-1024": (1024, 25, AGENTS, _ours, _torchrl),
    "vmas-navigation-4096": (4096, 25, AGENTS, _ours, _torchrl),
}
SIDES = ("rlcollect", "torchrl")


def measure_row(row: str, side: str, seconds: float) -> tuple[float, float]:
    instances, steps, agents, ours, theirs = ROWS[row]
    return measure(ours if side == "rlcollect" else theirs, instances, seconds, steps=steps, agents=agents)


@dataclass
class MarlResult:
    best: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)  # row -> side -> (fps, cpu)
    skip: str = ""
    torchrl_note: str = ""

    def table(self) -> str:
        lines = ["marl: rlcollect's Collector vs torchrl 0.14's, same env, seed and random policy, one torch thread "
                 "(best of the rounds: frames/s the highest, CPU-s per 1,000 agent-steps the lowest; a frame is one "
                 "env instance stepped once)"]
        if self.skip:
            return "\n".join([*lines, f"skipped: {self.skip}"])
        if self.torchrl_note:
            lines.append(self.torchrl_note)
        lines += ["| row | rlcollect frames/s | torchrl frames/s | ours/torchrl | rlcollect CPU-s/1k agent-steps | "
                  "torchrl CPU-s/1k agent-steps |", "|---|---:|---:|---:|---:|---:|"]
        for row in ROWS:
            got = self.best.get(row, {})
            ours, theirs = got.get("rlcollect"), got.get("torchrl")
            ratio = f"{ours[0] / theirs[0]:.2f}x" if ours and theirs else "-"
            lines.append(f"| {row} | {ours[0] if ours else 0:,.0f} | {theirs[0] if theirs else 0:,.0f} | {ratio} | "
                         f"{ours[1] if ours else float('nan'):.4f} | {theirs[1] if theirs else float('nan'):.4f} |")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"config": MarlConfig.name, "best": self.best, "skip": self.skip}


@dataclass
class MarlConfig:
    """The ``--only marl`` measurement (bench/suite.py runs ``run`` and prints ``table``)."""

    name = "marl: VMAS navigation 1,024 / 4,096 instances, PettingZoo simple_spread, rlcollect vs torchrl"
    budget: float = 2.0
    torchrl = None  # (its own torchrl side: ``run`` starts it)

    def run(self, seconds: float, rounds: int, log, torchrl_python: str | None = None) -> MarlResult:
        from bench.measure import run_json

        result = MarlResult()
        missing = [m for m in ("vmas", "pettingzoo", "mpe2") if importlib.util.find_spec(m) is None]
        if missing:
            result.skip = f"{', '.join(missing)} not installed (pip install 'rlcollect[marl]')"
            return result
        if torchrl_python is None:
            result.torchrl_note = "torchrl not measured (no --torchrl-python)"
        per_round = max(1.0, seconds * self.budget / rounds / len(ROWS))
        for i in range(rounds):
            for row in ROWS:
                for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                    if side == "torchrl" and torchrl_python is None:
                        continue
                    log(f"{self.name}: {row} {side}, round {i + 1}/{rounds}")
                    if side == "rlcollect":
                        fps, cpu = measure_row(row, side, per_round)
                    else:
                        try:
                            out = run_json([torchrl_python, "-m", "bench.marl", "--side", "torchrl", "--row", row,
                                            "--seconds", f"{per_round:g}"], timeout=600 + per_round, cwd=ROOT)
                        except RuntimeError as err:
                            log(f"{self.name}: torchrl side failed, no torchrl figure: {err}")
                            torchrl_python = None
                            result.torchrl_note = f"torchrl side failed: {str(err).splitlines()[0]}"
                            continue
                        fps, cpu = out["fps"], out["cpu_per_k_agent_steps"]
                    best = result.best.setdefault(row, {})
                    old = best.get(side)
                    best[side] = (fps, cpu) if old is None else (max(old[0], fps), min(old[1], cpu))
        return result


def marl_configs() -> list[MarlConfig]:
    return [MarlConfig()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--instances", type=int, nargs="*", default=[1024, 4096],
                        help="VMAS rows (none: only PettingZoo)")
    parser.add_argument("--side", choices=SIDES, default=None,
                        help="measure one side of one --row and print it as JSON (what MarlConfig runs)")
    parser.add_argument("--row", choices=list(ROWS), default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.side is not None:
        if args.row is None:
            parser.error("--side needs --row")
        fps, cpu = measure_row(args.row, args.side, args.seconds)
        print(json.dumps({"row": args.row, "side": args.side, "fps": fps, "cpu_per_k_agent_steps": cpu}), flush=True)
        return
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
