"""Shared helpers for the single-process ``Collector`` tests (imported by the test modules)."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rlcollect import Collector

TRAJ_IDS = ("collector", "traj_ids")
POLICY_VERSION = ("collector", "policy_version")
MASK = ("collector", "mask")

#: The leaves every batch has, whatever the options (SPEC section 1).
BASE_KEYS = {
    "observation",
    "action",
    "done",
    "terminated",
    "truncated",
    ("next", "observation"),
    ("next", "reward"),
    ("next", "done"),
    ("next", "terminated"),
    ("next", "truncated"),
    TRAJ_IDS,
}


@pytest.fixture
def make_collector():
    """Build collectors that are shut down at teardown, whatever the test did."""
    made: list[Collector] = []

    def factory(*args, **kwargs) -> Collector:
        collector = Collector(*args, **kwargs)
        made.append(collector)
        return collector

    yield factory
    for collector in made:
        collector.shutdown()


def leaf_keys(td: TensorDict) -> set:
    return set(td.keys(include_nested=True, leaves_only=True))


def assert_td_equal(a: TensorDict, b: TensorDict) -> None:
    """Same batch size, same leaves, bit-identical values."""
    assert a.batch_size == b.batch_size
    assert leaf_keys(a) == leaf_keys(b)
    for key in leaf_keys(a):
        x, y = a.get(key), b.get(key)
        assert x.dtype == y.dtype, key
        assert torch.equal(x, y), f"{key} differs:\n{x}\n{y}"


def take(collector, n: int) -> list[TensorDict]:
    return [next(collector) for _ in range(n)]


def cat_time(batches: list[TensorDict]) -> TensorDict:
    """Concatenate successive batches along time (the last batch dim)."""
    return torch.cat([b.clone() for b in batches], dim=-1)


def obs(td: TensorDict) -> torch.Tensor:
    """The (first feature of the) root observation, batch shape."""
    return td.get("observation")[..., 0]


def next_obs(td: TensorDict) -> torch.Tensor:
    return td.get(("next", "observation"))[..., 0]


def flag(td: TensorDict, key) -> torch.Tensor:
    """A done-family (or reward, step_count) entry without its trailing dim 1."""
    return td.get(key).squeeze(-1)
