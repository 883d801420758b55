"""Shared helpers for the multi-process collector tests: picklable env factories and policies,
process-liveness checks, and fixtures that build collectors and check at teardown that every
worker process is gone.

Why the workers can unpickle what is defined here: cloudpickle pickles this module's classes
and functions by reference (``mp_helpers.ValuePolicy``), and multiprocessing hands the main
process's ``sys.path`` (to which pytest prepended this directory) to every "spawn" and
"forkserver" process, so the worker imports this module like the tests do.

Start methods: the default is "forkserver" (rlcollect/multiprocess/start.py).  Most tests pass
``mp_start_method=START`` ("forkserver" too): workers fork from a server process that has imported
torch, tensordict and rlcollect once (``set_forkserver_preload`` below, to which rlcollect adds its
own list), whereas "spawn" starts a fresh interpreter that imports torch, which costs seconds per
worker on a small machine.  tests/multiprocess/test_startup.py is about the default itself.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os

import numpy as np
import pytest
import torch
from torch import nn

from procs import assert_gone, live_descendants, pid_alive, shm_entries, wait_gone  # noqa: F401  (re-exported)

from rlcollect import Collector
from rlcollect.data import TRAJ_ID_BLOCK
from rlcollect.envs.testing import CountingEnv, FaultyEnv, SleepEnv

START = "forkserver"

# Takes effect when the fork server starts (the first collector built with START): later
# workers fork from a process where these imports are done.
multiprocessing.get_context("forkserver").set_forkserver_preload([
    "__main__", "torch", "numpy", "tensordict", "gymnasium", "rlcollect.collector", "rlcollect.envs.gym",
    "rlcollect.envs.testing", "rlcollect.multiprocess.worker", "mp_helpers",
])

TRAJ_IDS = ("collector", "traj_ids")
POLICY_VERSION = ("collector", "policy_version")
MASK = ("collector", "mask")
WORKER_ID = ("collector", "worker_id")
BLOCK = TRAJ_ID_BLOCK

# -- picklable env factories --------------------------------------------------------------------
counting5 = functools.partial(CountingEnv, max_steps=5)
counting3 = functools.partial(CountingEnv, max_steps=3)
endless = functools.partial(CountingEnv, max_steps=None)


def slow_env(step_time: float = 0.05) -> SleepEnv:
    return SleepEnv(step_time=step_time, obs_dim=1)


def faulty_env(**kwargs) -> FaultyEnv:
    return FaultyEnv(**kwargs)


class TwoArgError(Exception):
    """An exception that cannot be rebuilt from a message alone."""

    def __init__(self, code: int, detail: str):
        super().__init__(f"code {code}: {detail}")
        self.code, self.detail = code, detail


def env_failing_with_two_arg_error():
    raise TwoArgError(7, "env factory failed on purpose")


def policy_factory_failing():
    raise LookupError("policy factory failed on purpose")


# -- picklable policies ------------------------------------------------------------------------
class SubclassedCollector(Collector):
    """A user's subclass of ``Collector``, run in the workers (``collector_class=``): it is a
    single-process collector as ``Collector`` is (a fresh trajectory-id block on restart)."""

    def collect_into(self, buffer, *args, **kwargs):
        return super().collect_into(buffer, *args, **kwargs)


class ValuePolicy(nn.Module):
    """Acts ``round(w + 100 * b)`` whatever the observation: the action column of a batch
    shows exactly which weights acted (``w`` a parameter, ``b`` a buffer)."""

    def __init__(self, w: float = 0.0, b: float = 0.0):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([float(w)]))
        self.register_buffer("b", torch.tensor([float(b)]))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (observation[..., 0] * 0 + self.w[0] + 100 * self.b[0]).round().long()


def make_value_policy() -> ValuePolicy:
    return ValuePolicy()


def weights(w: float, b: float = 0.0) -> dict[str, torch.Tensor]:
    """A state dict for ``ValuePolicy``."""
    return {"w": torch.tensor([float(w)]), "b": torch.tensor([float(b)])}


class ListBuffer:
    """The smallest replay buffer: keeps what ``extend`` got."""

    def __init__(self):
        self.batches = []
        self.frames = 0

    def extend(self, batch) -> None:
        self.batches.append(batch.clone())
        self.frames += batch.numel()


# -- data checks ----------------------------------------------------------------------------------
def rows_of(batch) -> list[dict[str, np.ndarray]]:
    """Each env row of a ``(..., T)`` batch as ``{obs, next_obs, done, ids}`` arrays over time."""
    obs = batch["observation"][..., 0].reshape(-1, batch.shape[-1]).numpy()
    nxt = batch["next", "observation"][..., 0].reshape(-1, batch.shape[-1]).numpy()
    done = batch["next", "done"][..., 0].reshape(-1, batch.shape[-1]).numpy()
    ids = batch[TRAJ_IDS].reshape(-1, batch.shape[-1]).numpy()
    return [{"obs": obs[r], "next_obs": nxt[r], "done": done[r], "ids": ids[r]} for r in range(obs.shape[0])]


def concat_rows(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def check_counting_stream(row: dict[str, np.ndarray], max_steps: int | None) -> None:
    """One env row of a ``CountingEnv`` over time (possibly several batches put end to end):
    every step counts up by one, trajectories end after ``max_steps`` steps and the next one
    starts from 0 with a new id, and an id never comes back."""
    obs, nxt, done, ids = row["obs"], row["next_obs"], row["done"], row["ids"]
    np.testing.assert_array_equal(nxt, obs + 1)
    if max_steps is not None:
        np.testing.assert_array_equal(done, nxt >= max_steps)
    for t in range(len(obs) - 1):
        if done[t]:
            assert obs[t + 1] == 0, f"step {t + 1} should start a new trajectory: {obs}"
            assert ids[t + 1] != ids[t], f"a new trajectory must get a new id at step {t + 1}: {ids}"
        else:
            assert obs[t + 1] == nxt[t], f"broken continuity at step {t}: {obs} / {nxt}"
            assert ids[t + 1] == ids[t], f"the id changed inside a trajectory at step {t + 1}: {ids}"
    starts = [ids[0]] + [ids[t + 1] for t in range(len(ids) - 1) if ids[t + 1] != ids[t]]
    assert len(starts) == len(set(starts)), f"a trajectory id came back: {ids}"


# -- processes ---------------------------------------------------------------------------------------
def descendant_pids() -> set[int]:
    """Live processes below this one, multiprocessing's resource tracker and fork server
    excluded (workers forked by the fork server are included)."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    helpers = {
        getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None),
        getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None),
    }
    return live_descendants() - helpers


def open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))



# -- building collectors ------------------------------------------------------------------------------
DEFAULT = "default"


def build(cls, *args, **kwargs):
    """``cls(*args, **kwargs)`` with ``mp_start_method=START`` unless given;
    ``mp_start_method=DEFAULT`` leaves the argument out (the collector's own default)."""
    kwargs.setdefault("mp_start_method", START)
    if kwargs["mp_start_method"] == DEFAULT:
        del kwargs["mp_start_method"]
    return cls(*args, **kwargs)


@contextlib.contextmanager
def running(cls, *args, **kwargs):
    """A collector that is shut down on exit, after which its workers must be gone."""
    collector = build(cls, *args, **kwargs)
    pids = collector.worker_pids()
    try:
        yield collector
    finally:
        collector.shutdown()
        assert_gone(pids)


@pytest.fixture
def make_multi():
    """``make_multi(cls, *args, **kwargs)`` builds a collector (``mp_start_method=START`` unless
    given); at teardown each is shut down and its workers must be gone."""
    made = []

    def factory(cls, *args, **kwargs):
        collector = build(cls, *args, **kwargs)
        made.append((collector, collector.worker_pids()))
        return collector

    yield factory
    for collector, _ in made:
        collector.shutdown()
    assert_gone([pid for _, pids in made for pid in pids])


def take(collector, n: int) -> list:
    """The next ``n`` batches."""
    return [next(collector) for _ in range(n)]


def assert_td_equal(a, b) -> None:
    """Same batch size, same leaves, bit-identical values."""
    assert a.batch_size == b.batch_size
    keys = set(a.keys(include_nested=True, leaves_only=True))
    assert keys == set(b.keys(include_nested=True, leaves_only=True))
    for key in keys:
        x, y = a.get(key), b.get(key)
        assert x.dtype == y.dtype, key
        assert torch.equal(x, y), f"{key} differs:\n{x}\n{y}"


class TwoKeyEnv(CountingEnv):
    """CountingEnv with two observation entries, ``a`` (the count) and ``b`` (ten times it),
    declared in the order ``keys`` gives: workers whose envs list them in different orders
    report layouts that are equal as dicts but differ in order (as torchrl's composite specs
    can between spawned processes)."""

    def __init__(self, keys: tuple[str, str] = ("a", "b"), **kwargs):
        super().__init__(**kwargs)
        spec = self.obs_layout.pop("observation")
        self.obs_layout = {key: spec for key in keys}

    def reset_rows(self, rows, obs_out) -> None:
        super().reset_rows(rows, {"observation": obs_out["a"]})
        np.multiply(obs_out["a"], 10, out=obs_out["b"])

    def _advance(self, obs_out, reward, terminated, truncated) -> None:
        counts = {"observation": obs_out["a"]}
        super()._advance(counts, reward, terminated, truncated)
        np.multiply(obs_out["a"], 10, out=obs_out["b"])


def two_key_env(order: str) -> TwoKeyEnv:
    return TwoKeyEnv(keys=tuple(order), max_steps=7)
