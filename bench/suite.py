"""The table of benchmark configurations, the runner and the report.

Each configuration names how to measure its ideal rate and how to build the collector under
test; adding a configuration (multi-process collectors, distributed nodes, torchrl's collectors
through ``--torchrl-python``) is adding an entry to ``CONFIGS`` (or another column to ``Config``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from bench.measure import Rate, collector_rate, gym_loop
from rlcollect import BusyEnv, Collector, GymEnv, SleepEnv
from rlcollect.cli import ArgmaxMLP

CARTPOLE = "CartPole-v1"


@dataclass(frozen=True)
class Config:
    """One benchmark: ``ideal(seconds)`` and ``collector(seconds)`` each return a ``Rate``."""

    name: str
    ideal: Callable[[float], Rate]
    collector: Callable[[float], Rate]


def cartpole_mlp() -> ArgmaxMLP:
    """The benchmark's MLP policy (2 hidden layers of 64, tanh, argmax), the same every run."""
    torch.manual_seed(0)
    return ArgmaxMLP(obs_dim=4, num_actions=2, hidden=64, depth=2)


def _cartpole(num_envs: int):
    return GymEnv(CARTPOLE, num_envs=num_envs) if num_envs > 1 else CARTPOLE


def cartpole_config(num_envs: int, mlp: bool) -> Config:
    frames_per_batch = 1024 if num_envs > 1 else 1000

    def policy():  # built when measured, identical for both measurements
        return cartpole_mlp() if mlp else None

    def ideal(seconds: float) -> Rate:
        return gym_loop(CARTPOLE, num_envs, policy(), seconds)

    def collector(seconds: float) -> Rate:
        make = functools.partial(
            Collector, _cartpole(num_envs), policy(), frames_per_batch=frames_per_batch, total_frames=-1
        )
        return collector_rate(make, seconds)

    policy_name = "mlp 2x64" if mlp else "random"
    return Config(f"{CARTPOLE} {policy_name}, {num_envs} env(s)", ideal, collector)


def timed_env_config(env_class: type, step_time: float, frames_per_batch: int) -> Config:
    """An env that spends ``step_time`` per step: the ideal is ``1 / step_time`` by definition."""

    def ideal(seconds: float) -> Rate:
        return Rate(1.0 / step_time, "1 / step_time")

    def collector(seconds: float) -> Rate:
        make = functools.partial(
            Collector,
            functools.partial(env_class, step_time=step_time),
            None,
            frames_per_batch=frames_per_batch,
            total_frames=-1,
        )
        return collector_rate(make, seconds)

    return Config(f"{env_class.__name__}(step_time={step_time:g}) random, 1 env", ideal, collector)


CONFIGS: list[Config] = [
    cartpole_config(num_envs=1, mlp=False),
    cartpole_config(num_envs=8, mlp=False),
    cartpole_config(num_envs=1, mlp=True),
    cartpole_config(num_envs=8, mlp=True),
    timed_env_config(BusyEnv, step_time=1e-4, frames_per_batch=1000),
    # A 1 ms sleep takes a little longer than 1 ms, so even a perfect collector stays under 1.0.
    timed_env_config(SleepEnv, step_time=1e-3, frames_per_batch=200),
]


# -- running and reporting ---------------------------------------------------------------------
@dataclass
class Result:
    config: str
    ideal_fps: float
    ideal_how: str
    collector_fps: float
    collector_how: str

    @property
    def ratio(self) -> float:
        return self.collector_fps / self.ideal_fps

    @property
    def overhead_us(self) -> float:
        """Time the collector adds to each frame, over the ideal loop, in microseconds."""
        return (1.0 / self.collector_fps - 1.0 / self.ideal_fps) * 1e6

    def as_dict(self) -> dict:
        return {**asdict(self), "ratio": self.ratio, "overhead_us_per_frame": self.overhead_us}


def run(configs: Sequence[Config], seconds: float, rounds: int, log: Callable[[str], None]) -> list[Result]:
    """Measure each config in ``rounds`` alternating rounds of ideal and collector runs, keeping
    the best rate of each: the machine may be shared, and interleaving exposes both
    measurements to the same load while the best round is the least disturbed."""
    results = []
    for config in configs:
        ideal: Rate | None = None
        measured: Rate | None = None
        for i in range(rounds):
            log(f"{config.name}: round {i + 1}/{rounds}")
            ideal = max(ideal, config.ideal(seconds / rounds), key=_fps)
            measured = max(measured, config.collector(seconds / rounds), key=_fps)
        results.append(Result(config.name, ideal.frames_per_s, ideal.how, measured.frames_per_s, measured.how))
    return results


def _fps(rate: Rate | None) -> float:
    return -1.0 if rate is None else rate.frames_per_s


def format_table(results: Sequence[Result]) -> str:
    """A markdown table (readable as is in a terminal, and pasteable into the README)."""
    header = ("config", "ideal fps", "collector fps", "ratio", "overhead µs/frame")
    rows = [
        (r.config, f"{r.ideal_fps:,.0f}", f"{r.collector_fps:,.0f}", f"{r.ratio:.2f}", f"{r.overhead_us:.1f}")
        for r in results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells) -> str:
        return "| " + " | ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))
        ) + " |"

    separator = "|" + "|".join(("-" * (w + 2)) if i == 0 else ("-" * (w + 1) + ":") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), separator, *(line(row) for row in rows)])


def machine() -> dict:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="time budget per measurement, all rounds together (default: 3)"
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best counts (default: 3)")
    parser.add_argument("--only", default=None, help="run only the configurations whose name contains this")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results to this JSON file")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.seconds <= 0:
        build_parser().error(f"--seconds must be positive, got {args.seconds}")
    if args.rounds < 1:
        build_parser().error(f"--rounds must be at least 1, got {args.rounds}")
    configs = [c for c in CONFIGS if args.only is None or args.only.lower() in c.name.lower()]
    if args.list:
        print("\n".join(c.name for c in CONFIGS))
        return 0
    if not configs:
        build_parser().error(f"--only {args.only!r} matches none of: {', '.join(c.name for c in CONFIGS)}")

    # One torch thread for the ideal loops and the collectors alike, so that they compare.
    torch.set_num_threads(1)
    info = machine()
    results = run(configs, args.seconds, args.rounds, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    print(
        f"rlcollect benchmarks, {info['date']}: python {info['python']}, torch {info['torch']} "
        f"({info['torch_threads']} thread), {info['cpus']} cpus, best of {args.rounds} rounds "
        f"in {args.seconds:g} s per measurement"
    )
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "seconds": args.seconds, "rounds": args.rounds, "results": [r.as_dict() for r in results]}, f, indent=2)
        print(f"results written to {args.json}")
    return 0
