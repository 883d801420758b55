"""The table of benchmark configurations, the runner and the report.

Each configuration names how to measure its ideal rate and how to build the collector under
test, and optionally the key of the same work on torchrl's collectors (measured by
``bench/torchrl_side.py`` under the interpreter given with ``--torchrl-python``); adding a
configuration is adding an entry to ``CONFIGS``. The multi-process ones are built in
``bench/multi.py``, the real workloads (Pong, HalfCheetah: a row per collector or library, each
measured in a fresh interpreter) in ``bench/real.py``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from bench.config import CARTPOLE, Config, Row, StartupConfig, Target, WorkloadConfig, cartpole_mlp, torchrl_key
from bench.measure import Duration, Rate, collector_rate, cpu_share, gym_loop, run_json
from bench.central import CentralConfig, CentralResult, central_configs
from bench.mainproc import mainproc_configs
from bench.marl import marl_configs
from bench.multi import BUDGET, multi_configs
from bench.ray import ray_configs
from bench.real import real_configs
from bench.startup import startup_configs
from rlcollect import BusyEnv, Collector, GymEnv, SleepEnv

__all__ = ["CARTPOLE", "CONFIGS", "Config", "StartupConfig", "Target", "cartpole_mlp", "main", "run"]

TORCHRL_SIDE = Path(__file__).with_name("torchrl_side.py")
ROOT = Path(__file__).resolve().parent.parent


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
    key = torchrl_key("single", CARTPOLE, "mlp" if mlp else "random", envs=num_envs, frames_per_batch=frames_per_batch)
    return Config(f"{CARTPOLE} {policy_name}, {num_envs} env(s)", ideal, collector, torchrl=key)


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

    kind = env_class.__name__.removesuffix("Env").lower()
    key = torchrl_key("single", kind, frames_per_batch=frames_per_batch, step_time=step_time)
    return Config(f"{env_class.__name__}(step_time={step_time:g}) random, 1 env", ideal, collector, torchrl=key)


CONFIGS: list[Config | StartupConfig | WorkloadConfig] = [
    cartpole_config(num_envs=1, mlp=False),
    cartpole_config(num_envs=8, mlp=False),
    cartpole_config(num_envs=1, mlp=True),
    cartpole_config(num_envs=8, mlp=True),
    timed_env_config(BusyEnv, step_time=1e-4, frames_per_batch=1000),
    # A 1 ms sleep takes a little longer than 1 ms, so even a perfect collector stays under 1.0.
    timed_env_config(SleepEnv, step_time=1e-3, frames_per_batch=200),
    *startup_configs(),  # (listed before the multi-process ones)
    *multi_configs(),
    *mainproc_configs(),  # the main process's CPU per delivered batch, with the hop count (bench/mainproc.py)
    *real_configs(),  # the real workloads: the longest to run (bench/real.py)
    *central_configs(),  # central against worker inference (bench/central.py)
    *ray_configs(),  # launcher="ray" against "mp" (bench/ray.py)
    *marl_configs(),  # VMAS and PettingZoo rows, rlcollect against torchrl (bench/marl.py)
]


# -- running and reporting ---------------------------------------------------------------------
@dataclass
class Result:
    config: str
    ideal_fps: float
    ideal_how: str
    collector_fps: float
    collector_how: str
    torchrl_fps: float | None = None
    torchrl_how: str = ""
    target: Target | None = None
    at_once_fps: float | None = None
    at_once_how: str = ""
    bare_fps: float | None = None
    bare_how: str = ""
    #: CPU seconds per 1,000 frames (process, threads and children) of the ideal's, the
    #: collector's and torchrl's best rounds; the main process's CPU ms per delivered batch.
    ideal_cpu: float | None = None
    collector_cpu: float | None = None
    torchrl_cpu: float | None = None
    main_cpu_ms_per_batch: float | None = None

    @property
    def ratio(self) -> float:
        return self.collector_fps / self.ideal_fps

    @property
    def of_at_once(self) -> float | None:
        """The collector's rate over what bare loops running at once got (multi-process)."""
        return None if not self.at_once_fps else self.collector_fps / self.at_once_fps

    @property
    def of_bare(self) -> float | None:
        """The collector's rate over workers × one bare loop measured alone (multi-process
        configurations whose ideal is defined rather than measured)."""
        return None if not self.bare_fps else self.collector_fps / self.bare_fps

    @property
    def overhead_us(self) -> float:
        """Time the collector adds to each frame, over the ideal loop, in microseconds."""
        return (1.0 / self.collector_fps - 1.0 / self.ideal_fps) * 1e6

    @property
    def vs_torchrl(self) -> float | None:
        """Our frames/s over torchrl's (higher is better)."""
        return None if not self.torchrl_fps else self.collector_fps / self.torchrl_fps

    @property
    def target_met(self) -> bool | None:
        if self.target is None:
            return None
        return self.target.met(getattr(self, self.target.column))  # each target column is a property here

    def as_dict(self) -> dict:
        out = {**asdict(self), "ratio": self.ratio, "overhead_us_per_frame": self.overhead_us,
               "of_at_once": self.of_at_once, "of_bare": self.of_bare, "vs_torchrl": self.vs_torchrl}
        out["target"] = None if self.target is None else self.target.describe()
        out["target_met"] = self.target_met
        return out


@dataclass
class StartupResult:
    config: str
    seconds: float
    how: str
    samples: list[float]
    torchrl_seconds: float | None = None
    torchrl_how: str = ""
    torchrl_samples: list[float] | None = None
    target: Target | None = None

    @property
    def vs_torchrl(self) -> float | None:
        """Our seconds over torchrl's (lower is better)."""
        return None if not self.torchrl_seconds else self.seconds / self.torchrl_seconds

    @property
    def target_met(self) -> bool | None:
        return None if self.target is None else self.target.met(self.vs_torchrl)

    def as_dict(self) -> dict:
        out = {**asdict(self), "vs_torchrl": self.vs_torchrl, "target_met": self.target_met}
        out["target"] = None if self.target is None else self.target.describe()
        return out


def torchrl_measure(python: str, key: str, seconds: float) -> dict:
    """Run ``bench/torchrl_side.py`` under torchrl's interpreter and return its JSON line."""
    return run_json([python, str(TORCHRL_SIDE), key, f"{seconds:g}"], timeout=600 + seconds)


def run(configs: Sequence[Config | StartupConfig | WorkloadConfig], seconds: float, rounds: int,
        log: Callable[[str], None], torchrl_python: str | None = None) -> list[Result | StartupResult | WorkloadResult]:
    """Measure each config in ``rounds`` alternating rounds of ideal, collector (and torchrl)
    runs, keeping the best of each: the machine may be shared, and interleaving exposes all
    measurements to the same load while the best round is the least disturbed."""
    results: list[Result | StartupResult | WorkloadResult] = []
    for config in configs:
        if isinstance(config, StartupConfig):
            results.append(_run_startup(config, rounds, log, torchrl_python))
            continue
        if isinstance(config, WorkloadConfig):
            results.append(_run_workload(config, seconds * config.budget / rounds, rounds, log, torchrl_python))
            continue
        if isinstance(config, CentralConfig) or hasattr(config, "run"):  # (bench/ray.py's too)
            results.append(config.run(seconds, rounds, log, torchrl_python))
            continue
        per_round = seconds * config.budget / rounds
        ideal: Rate | None = None
        bare_at_once: Rate | None = None
        bare: Rate | None = None
        measured: Rate | None = None
        theirs: Rate | None = None
        use_torchrl = torchrl_python is not None and config.torchrl is not None
        for i in range(rounds):
            log(f"{config.name}: round {i + 1}/{rounds}")
            ideal = max(ideal, config.ideal(per_round), key=_fps)
            if config.at_once is not None:
                bare_at_once = max(bare_at_once, config.at_once(per_round), key=_fps)
            if config.bare is not None:
                bare = max(bare, config.bare(per_round), key=_fps)
            measured = max(measured, config.collector(per_round), key=_fps)
            if use_torchrl:
                try:
                    out = torchrl_measure(torchrl_python, config.torchrl, per_round)
                except RuntimeError as err:
                    log(f"{config.name}: torchrl side failed, no torchrl figure: {err}")
                    use_torchrl = False
                else:
                    theirs = max(theirs, Rate(out["fps"], out.get("how", "torchrl"),
                                              cpu_per_kframe=out.get("cpu_per_kframe")), key=_fps)
        results.append(Result(
            config.name, ideal.frames_per_s, ideal.how, measured.frames_per_s, measured.how,
            None if theirs is None else theirs.frames_per_s, "" if theirs is None else theirs.how, config.target,
            None if bare_at_once is None else bare_at_once.frames_per_s,
            "" if bare_at_once is None else bare_at_once.how,
            None if bare is None else bare.frames_per_s, "" if bare is None else bare.how,
            ideal.cpu_per_kframe, measured.cpu_per_kframe, None if theirs is None else theirs.cpu_per_kframe,
            measured.main_cpu_ms_per_batch,
        ))
    return results


def _run_startup(config: StartupConfig, rounds: int, log: Callable[[str], None],
                 torchrl_python: str | None) -> StartupResult:
    ours: list[Duration] = []
    theirs: list[Duration] = []
    use_torchrl = torchrl_python is not None and config.torchrl is not None
    for i in range(rounds):
        log(f"{config.name}: round {i + 1}/{rounds}")
        ours.append(config.measure())
        if use_torchrl:
            try:
                out = torchrl_measure(torchrl_python, config.torchrl, 0)
            except RuntimeError as err:
                log(f"{config.name}: torchrl side failed, no torchrl figure: {err}")
                use_torchrl = False
            else:
                theirs.append(Duration(out["first_batch_s"], out.get("how", "torchrl")))
    best = min(ours, key=lambda d: d.seconds)
    their_best = min(theirs, key=lambda d: d.seconds) if theirs else None
    return StartupResult(
        config.name, best.seconds, best.how, [d.seconds for d in ours],
        None if their_best is None else their_best.seconds, "" if their_best is None else their_best.how,
        [d.seconds for d in theirs] or None, config.target,
    )


# -- real workloads: one row per collector or library, each measured in a fresh interpreter -------
def real_measure(key: str, seconds: float) -> dict:
    """Run ``python -m bench.real KEY SECONDS`` in a fresh interpreter and return its JSON line."""
    return run_json([sys.executable, "-m", "bench.real", key, f"{seconds:g}"], timeout=600 + seconds, cwd=str(ROOT))


@dataclass
class RowResult:
    """The best round of one row: ``steps_per_s`` (None: not measured, ``note`` says why) and
    what that round read of the main process's memory (``bench/workloads.py``'s ``rss`` and
    ``shm_bytes``; ``batch_bytes`` and ``frames_per_delivery``: one delivery, a batch or a step)."""

    row: Row
    steps_per_s: float | None = None
    how: str = ""
    memory: dict | None = None
    note: str = ""

    def mem(self, name: str) -> float | None:
        return None if not self.memory or name not in self.memory else self.memory[name]


@dataclass
class WorkloadResult:
    config: WorkloadConfig
    rows: list[RowResult]

    def _row(self, label: str | None) -> RowResult | None:
        return next((r for r in self.rows if r.row.label == label), None)

    def ratio(self, r: RowResult) -> float | None:
        """Steps/s over the ideal row's (None for an ideal, or when either is missing)."""
        ideal = self._row(r.row.ideal)
        if ideal is None or not ideal.steps_per_s or r.steps_per_s is None:
            return None
        return r.steps_per_s / ideal.steps_per_s

    def overhead_us(self, r: RowResult) -> float | None:
        """Time added to each step over the ideal row, in microseconds."""
        ideal = self._row(r.row.ideal)
        if ideal is None or not ideal.steps_per_s or not r.steps_per_s:
            return None
        return (1.0 / r.steps_per_s - 1.0 / ideal.steps_per_s) * 1e6

    def vs_envpool(self, r: RowResult) -> float | None:
        envpool = next((e for e in self.rows if "runner=envpool" in e.row.key), None)
        if envpool is None or not envpool.steps_per_s or r.steps_per_s is None or r is envpool or r.row.ideal is None:
            return None
        return r.steps_per_s / envpool.steps_per_s

    def cpu_per_kframe(self, r: RowResult) -> float | None:
        """CPU seconds per 1,000 frames (``frames_per_step`` frames a step)."""
        per_kstep = r.mem("cpu_per_kstep")
        return None if per_kstep is None else per_kstep / self.config.frames_per_step

    @staticmethod
    def rss_growth(r: RowResult) -> float | None:
        """Main-process RSS at the end of the window over what it was just before the run was
        built (imports and the policy done)."""
        if r.mem("rss_VmRSS") is None or r.mem("rss_before") is None:
            return None
        return r.mem("rss_VmRSS") - r.mem("rss_before")

    def rss_of_batch(self, r: RowResult) -> float | None:
        """RSS growth over the bytes of the batch the loop holds (collectors only)."""
        growth, held = self.rss_growth(r), r.mem("batch_bytes")
        return None if not r.row.delivers_batches or growth is None or not held else growth / held

    @staticmethod
    def shm_per_frame(r: RowResult) -> float | None:
        """/dev/shm bytes the main process maps, per frame of one delivery (a batch, or a step
        of a vector env)."""
        shm, frames = r.mem("shm_bytes"), r.mem("frames_per_delivery")
        return None if shm is None or not frames else shm / frames

    def figure(self, r: RowResult, column: str) -> float | None:
        return {"ratio": self.ratio, "vs_envpool": self.vs_envpool, "rss_of_batch": self.rss_of_batch}[column](r)

    def targets(self, r: RowResult) -> list[tuple[Target, bool | None]]:
        return [(t, t.met(self.figure(r, t.column))) for t in r.row.targets]

    def as_dict(self) -> dict:
        rows = []
        for r in self.rows:
            rows.append({
                "row": r.row.label, "key": r.row.key, "side": r.row.side, "ideal": r.row.ideal,
                "steps_per_s": r.steps_per_s,
                "frames_per_s": None if r.steps_per_s is None else r.steps_per_s * self.config.frames_per_step,
                "how": r.how, "note": r.note, "memory": r.memory, "ratio": self.ratio(r),
                "overhead_us_per_step": self.overhead_us(r), "vs_envpool": self.vs_envpool(r),
                "cpu_s_per_kframe": self.cpu_per_kframe(r),
                "rss_growth_bytes": self.rss_growth(r), "rss_of_batch": self.rss_of_batch(r),
                "shm_bytes_per_frame": self.shm_per_frame(r),
                "targets": [{"target": t.describe(), "met": met} for t, met in self.targets(r)],
            })
        return {"config": self.config.name, "title": self.config.title, "frames_per_step": self.config.frames_per_step,
                "rows": rows}


def _run_workload(config: WorkloadConfig, per_round: float, rounds: int, log: Callable[[str], None],
                  torchrl_python: str | None) -> WorkloadResult:
    """Each round measures every row once, in a fresh interpreter; the round with the most
    steps/s counts for each row (with the memory it read). A row whose library is missing, or
    whose process fails, is not measured again."""
    results = [RowResult(row) for row in config.rows]
    for result in results:
        if result.row.side == "torchrl" and torchrl_python is None:
            result.note = "no --torchrl-python"
    for i in range(rounds):
        log(f"{config.name}: round {i + 1}/{rounds}")
        for result in results:
            if result.note:
                continue
            row = result.row
            try:
                if row.side == "torchrl":
                    out = torchrl_measure(torchrl_python, row.key, per_round)
                    out["steps_per_s"] = out.pop("fps", None)
                    out["cpu_per_kstep"] = out.pop("cpu_per_kframe", None)  # its frames are the env steps
                else:
                    out = real_measure(row.key, per_round)
            except RuntimeError as err:
                log(f"{config.name}: {row.label} failed, no figure: {err}")
                result.note = f"failed: {str(err).splitlines()[0]}"
                continue
            if "skip" in out:
                log(f"{config.name}: {row.label} skipped: {out['skip']}")
                result.note = out["skip"]
                continue
            if result.steps_per_s is None or out["steps_per_s"] > result.steps_per_s:
                result.steps_per_s, result.how = out.pop("steps_per_s"), out.pop("how", "")
                out.pop("wall_s", None)
                result.memory = out
    return WorkloadResult(config, results)


def _mb(value: float | None) -> str:
    return "" if value is None else f"{value / 2**20:,.1f}"


def format_workload_table(result: WorkloadResult) -> str:
    """A markdown table of one real workload: a row per collector or library. "of ideal": steps/s
    over its ideal row's (``Collector``: the bare loop in one process; the rest: the bare loops
    at once); "overhead": µs each step costs over the ideal; "/envpool": steps/s over envpool's;
    "main RSS": the main process's resident memory at the end of the window, "+RSS" its growth
    since just before the run was built, "+RSS/batch" that over the bytes of the batch it holds;
    "shm": the /dev/shm the main process maps, and that per frame of one delivery (a batch, or
    one step of a vector env); "CPU s/1k frames": CPU seconds per 1,000 frames (the process, its
    threads and its child processes, over the timed window); "main CPU ms/batch": the collector's
    main process's own CPU per delivered batch. Targets: met, MISSED, or n/a when a figure is
    missing."""
    fps = result.config.frames_per_step
    header = ("row", "steps/s", f"frames/s (×{fps})", "of ideal", "overhead µs/step", "/envpool",
              "CPU s/1k frames", "main CPU ms/batch", "main RSS MiB",
              "+RSS MiB", "batch MiB", "+RSS/batch", "shm MiB", "shm B/frame", "targets")
    rows = []
    for r in result.rows:
        if r.steps_per_s is None:
            rows.append((r.row.label, *[""] * (len(header) - 2), f"not measured: {r.note}"))
            continue
        num = _num
        rows.append((
            r.row.label, f"{r.steps_per_s:,.0f}", f"{r.steps_per_s * fps:,.0f}", num(result.ratio(r), ".2f"),
            num(result.overhead_us(r), ".1f"), num(result.vs_envpool(r), ".2f"),
            num(result.cpu_per_kframe(r), ".3f"), num(r.mem("main_cpu_ms_per_batch"), ".3f"), _mb(r.mem("rss_VmRSS")),
            _mb(result.rss_growth(r)), _mb(r.mem("batch_bytes")) if r.row.delivers_batches else "",
            num(result.rss_of_batch(r), ".2f"), _mb(r.mem("shm_bytes")), num(result.shm_per_frame(r), ",.0f"),
            "; ".join(_target_cell(t, met) for t, met in result.targets(r)),
        ))
    return _markdown(header, rows)


def _num(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _fps(rate: Rate | None) -> float:
    return -1.0 if rate is None else rate.frames_per_s


def _target_cell(target: Target | None, met: bool | None) -> str:
    if target is None:
        return ""
    return f"{target.describe()}: " + {True: "met", False: "MISSED", None: "n/a"}[met]


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells) -> str:
        return "| " + " | ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))
        ) + " |"

    separator = "|" + "|".join(("-" * (w + 2)) if i == 0 else ("-" * (w + 1) + ":") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), separator, *(line(row) for row in rows)])


def format_table(results: Sequence[Result]) -> str:
    """A markdown table of throughputs (readable as is in a terminal, and pasteable into the
    README). "bare at once": one bare loop per worker, all running at the same time (multi-process
    configurations; it shows how much of the ideal the machine gives now, when other jobs share
    it). "workers × bare": workers × one bare loop measured alone, where the ideal is defined
    rather than measured (``SleepEnv`` / ``BusyEnv`` workers: a 1 ms sleep takes longer than
    1 ms). "CPU s/1k frames": CPU seconds per 1,000 frames of the ideal loop, the collector and
    torchrl's collector (the process, its threads and its child processes: the workers); "main
    CPU ms/batch": the collector's main process's own CPU per delivered batch. The torchrl
    columns are blank when torchrl was not measured."""
    header = ("config", "ideal fps", "collector fps", "ratio", "overhead µs/frame", "bare at once fps",
              "of at once", "workers × bare fps", "of workers × bare", "torchrl fps", "ours/torchrl",
              "ideal CPU s/1k frames", "ours CPU s/1k frames", "torchrl CPU s/1k frames", "main CPU ms/batch",
              "target")
    rows = [
        (
            r.config, f"{r.ideal_fps:,.0f}", f"{r.collector_fps:,.0f}", f"{r.ratio:.2f}", f"{r.overhead_us:.1f}",
            "" if r.at_once_fps is None else f"{r.at_once_fps:,.0f}",
            "" if r.of_at_once is None else f"{r.of_at_once:.2f}",
            "" if r.bare_fps is None else f"{r.bare_fps:,.0f}",
            "" if r.of_bare is None else f"{r.of_bare:.2f}",
            "" if r.torchrl_fps is None else f"{r.torchrl_fps:,.0f}",
            "" if r.vs_torchrl is None else f"{r.vs_torchrl:.1f}",
            _num(r.ideal_cpu, ".3f"), _num(r.collector_cpu, ".3f"), _num(r.torchrl_cpu, ".3f"),
            _num(r.main_cpu_ms_per_batch, ".3f"),
            _target_cell(r.target, r.target_met),
        )
        for r in results
    ]
    return _markdown(header, rows)


def format_startup_table(results: Sequence[StartupResult]) -> str:
    """A markdown table of start-up times: constructor to first batch, each run in a fresh
    interpreter (best run; every run in the JSON)."""
    header = ("start-up", "rlcollect s", "torchrl s", "ours/torchrl", "target")
    rows = [
        (
            r.config, f"{r.seconds:.2f}", "" if r.torchrl_seconds is None else f"{r.torchrl_seconds:.2f}",
            "" if r.vs_torchrl is None else f"{r.vs_torchrl:.2f}", _target_cell(r.target, r.target_met),
        )
        for r in results
    ]
    return _markdown(header, rows)


def machine() -> dict:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "load_average_1min": os.getloadavg()[0],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=3.0,
        help=f"time budget per measurement, all rounds together (multi-process configurations: {BUDGET:g} "
             "times that; default: 3)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best counts (default: 3)")
    parser.add_argument("--only", default=None, help="run only the configurations whose name contains this")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results to this JSON file")
    parser.add_argument("--list", action="store_true", help="list the configurations and exit")
    parser.add_argument(
        "--torchrl-python", default=None, metavar="PATH",
        help="a python interpreter with torchrl installed: also measure torchrl's collectors on the same "
             "configurations (bench/torchrl_side.py runs under it) and print ours/torchrl",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.seconds <= 0:
        parser.error(f"--seconds must be positive, got {args.seconds}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.torchrl_python is not None and not os.access(args.torchrl_python, os.X_OK):
        parser.error(f"--torchrl-python {args.torchrl_python!r} is not an executable file")
    configs = [c for c in CONFIGS if args.only is None or args.only.lower() in c.name.lower()]
    if args.list:
        print("\n".join(c.name for c in CONFIGS))
        return 0
    if not configs:
        parser.error(f"--only {args.only!r} matches none of: {', '.join(c.name for c in CONFIGS)}")

    # One torch thread for the ideal loops and the collectors alike, so that they compare.
    torch.set_num_threads(1)
    info = machine()
    # Other jobs may share the machine: say how much of each core a spinning process could get.
    info["cpu_share_start"] = cpu_share(info["cpus"] or 1)
    started = time.perf_counter()
    results = run(configs, args.seconds, args.rounds, log=lambda msg: print(msg, file=sys.stderr, flush=True),
                  torchrl_python=args.torchrl_python)
    info["suite_seconds"] = round(time.perf_counter() - started, 1)
    info["load_average_1min_end"] = os.getloadavg()[0]
    info["cpu_share_end"] = cpu_share(info["cpus"] or 1)
    torchrl_note = f", torchrl from {args.torchrl_python}" if args.torchrl_python else ""

    def shares(values: list[float]) -> str:
        return "/".join(f"{v:.2f}" for v in values)

    print(
        f"rlcollect benchmarks, {info['date']}: python {info['python']}, torch {info['torch']} "
        f"({info['torch_threads']} thread), {info['cpus']} cpus, best of {args.rounds} rounds "
        f"in {args.seconds:g} s per measurement (multi-process and real workloads: {args.seconds * BUDGET:g} s)"
        f"{torchrl_note}.\n"
        f"Machine load: load average {info['load_average_1min']:.1f} at start, "
        f"{info['load_average_1min_end']:.1f} at end; {info['cpus']} processes spinning together got "
        f"{shares(info['cpu_share_start'])} of a core at start, {shares(info['cpu_share_end'])} at end. "
        f"The suite took {info['suite_seconds'] / 60:.1f} min."
    )
    rates = [r for r in results if isinstance(r, Result)]
    startups = [r for r in results if isinstance(r, StartupResult)]
    tables = [format_table(rates)] if rates else []
    if startups:
        tables.append(format_startup_table(startups))
    for r in results:
        if isinstance(r, WorkloadResult):
            tables.append(f"{r.config.name}: {r.config.title}, {r.config.frames_per_step} frame(s) per step\n"
                          + format_workload_table(r))
        if isinstance(r, CentralResult) or hasattr(r, "table"):
            tables.append(r.table())
    print("\n\n".join(tables))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "seconds": args.seconds, "rounds": args.rounds,
                       "torchrl_python": args.torchrl_python, "results": [r.as_dict() for r in results]}, f, indent=2)
        print(f"results written to {args.json}")
    return 0
