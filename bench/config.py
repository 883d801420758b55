"""What a benchmark configuration is: how to measure the ideal, rlcollect and (optionally) torchrl
on the same work, and the target the result is held to.

``suite.py`` holds the table of configurations and the runner; ``multi.py`` builds the
multi-process ones. Both build theirs from the types here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from bench.measure import Duration, Rate

if TYPE_CHECKING:
    from rlcollect.nets import ArgmaxMLP

CARTPOLE = "CartPole-v1"


#: What each column a ``Target`` can read compares the collector with.
TARGET_COLUMNS = {
    "ratio": "ideal",  # collector / ideal
    "vs_torchrl": "torchrl",  # ours / torchrl's
    "of_bare": "workers × bare loop",  # collector / (workers × one bare loop measured alone)
    "vs_envpool": "envpool",  # a real-workload row's steps/s / envpool's on the same work
    "rss_of_batch": "the batch it holds",  # main-process RSS growth / bytes of the batch it holds
}


@dataclass(frozen=True)
class Target:
    """An acceptance figure: ``column`` (one of ``TARGET_COLUMNS``) must be at least
    ``at_least`` or at most ``at_most``."""

    column: str
    at_least: float | None = None
    at_most: float | None = None

    def __post_init__(self):
        if self.column not in TARGET_COLUMNS:
            raise ValueError(f"Target.column must be one of {sorted(TARGET_COLUMNS)}, got {self.column!r}")
        if (self.at_least is None) == (self.at_most is None):
            raise ValueError("Target needs exactly one of at_least / at_most")

    def describe(self) -> str:
        what = TARGET_COLUMNS[self.column]
        if self.at_least is not None:
            return f"≥ {self.at_least:g}× {what}"
        return f"≤ {self.at_most:g}× {what}"

    def met(self, value: float | None) -> bool | None:
        """Whether ``value`` (the figure of ``column``) meets the target; None when unknown."""
        if value is None:
            return None
        return value >= self.at_least if self.at_least is not None else value <= self.at_most


@dataclass(frozen=True)
class Config:
    """One throughput benchmark: ``ideal(seconds)`` and ``collector(seconds)`` each return a
    ``Rate``; ``at_once(seconds)`` (multi-process only) runs one bare loop per worker at the same
    time, which tells how much of the ideal this machine can give right now; ``bare(seconds)``
    (multi-process configurations whose ideal is defined rather than measured) is workers × the
    rate of one bare single-env loop measured alone, in this process; ``torchrl`` is the
    key ``bench/torchrl_side.py`` understands for the same work on torchrl's collectors (None:
    no torchrl counterpart); ``budget`` multiplies ``--seconds`` (multi-process collectors take
    seconds to build, so each round measures longer)."""

    name: str
    ideal: Callable[[float], Rate]
    collector: Callable[[float], Rate]
    at_once: Callable[[float], Rate] | None = None
    bare: Callable[[float], Rate] | None = None
    torchrl: str | None = None
    budget: float = 1.0
    target: Target | None = None


@dataclass(frozen=True)
class StartupConfig:
    """One start-up benchmark: ``measure()`` times constructor-to-first-batch in a cold
    interpreter and returns a ``Duration``; lower is better."""

    name: str
    measure: Callable[[], Duration]
    torchrl: str | None = None
    target: Target | None = None


@dataclass(frozen=True)
class Row:
    """One row of a ``WorkloadConfig``: ``key`` is what ``python -m bench.real`` (``side="ours"``)
    or ``bench/torchrl_side.py`` (``side="torchrl"``) measures, each time in a fresh interpreter;
    ``ideal`` names the row it is compared with (None: it is an ideal); ``delivers_batches``:
    a collector, whose main-process memory is compared with the batch it holds."""

    label: str
    key: str
    side: str = "ours"
    ideal: str | None = None
    delivers_batches: bool = False
    targets: tuple[Target, ...] = ()

    def __post_init__(self):
        if self.side not in ("ours", "torchrl"):
            raise ValueError(f"Row.side must be 'ours' or 'torchrl', got {self.side!r}")


@dataclass(frozen=True)
class WorkloadConfig:
    """A real workload (``bench/workloads.py``) with one policy, measured through several
    ``rows`` (the ideals, rlcollect's collectors, other libraries) in alternating rounds:
    steps/s (``frames_per_step`` frames each), the main process's memory and /dev/shm."""

    name: str
    title: str
    frames_per_step: int
    rows: tuple[Row, ...]
    budget: float = 1.0

    def __post_init__(self):
        labels = [row.label for row in self.rows]
        if len(set(labels)) != len(labels):
            raise ValueError(f"WorkloadConfig {self.name!r}: row labels repeat: {labels}")
        for row in self.rows:
            if row.ideal is not None and row.ideal not in labels:
                raise ValueError(f"row {row.label!r} compares with {row.ideal!r}, which is not a row of {self.name!r}")


def cartpole_mlp() -> ArgmaxMLP:
    """The benchmark's MLP policy (2 hidden layers of 64, tanh, argmax), the same every run."""
    from rlcollect.nets import ArgmaxMLP  # here: bench/real.py's rows of other libraries import no rlcollect

    torch.manual_seed(0)
    return ArgmaxMLP(obs_dim=4, num_actions=2, hidden=64, depth=2)


def torchrl_key(collector: str, env: str, policy: str = "random", *, workers: int = 1, envs: int = 1,
                frames_per_batch: int, step_time: float | None = None) -> str:
    """The key naming one configuration for ``bench/torchrl_side.py`` (``name=value`` words),
    built from the same numbers as rlcollect's side so that the two cannot drift apart."""
    words = [f"collector={collector}", f"env={env}", f"policy={policy}", f"workers={workers}", f"envs={envs}",
             f"fpb={frames_per_batch}"]
    if step_time is not None:
        words.append(f"step_time={step_time:g}")
    return " ".join(words)
