"""Forked workers (the default start methods fork, from the main process or from the fork server)
start with their parent's random generators. Each worker must draw its own numbers: otherwise a
stochastic policy explores identically in every worker. Before the fix, both workers below drew
the same torch, numpy and Python random streams under "fork" and "forkserver" (under "spawn"
each interpreter seeds itself)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from mp_helpers import make_multi  # noqa: F401

from rlcollect import MultiSyncCollector

pytestmark = pytest.mark.timeout(120)


class CoinPolicy(torch.nn.Module):
    """One coin flip per env and step, drawn from the global generator of ``source``."""

    def __init__(self, source: str):
        super().__init__()
        self.source = source

    def forward(self, obs):
        shape = obs.shape[:-1]
        if self.source == "torch":
            draws = torch.rand(shape)
        elif self.source == "numpy":
            draws = torch.from_numpy(np.random.random(shape))
        else:
            draws = torch.tensor([random.random() for _ in range(shape.numel())]).reshape(shape)
        return (draws > 0.5).long()


def flips(collector) -> torch.Tensor:
    return next(collector)["action"].reshape(2, -1)  # (workers, 64 steps)


@pytest.mark.parametrize("source", ["torch", "numpy", "python"])
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_each_forked_worker_draws_its_own_random_numbers(make_multi, method, source):
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    collector = make_multi(MultiSyncCollector, "CartPole-v1", CoinPolicy(source), num_workers=2, frames_per_batch=128,
                           mp_start_method=method)
    actions = flips(collector)
    assert not torch.equal(actions[0], actions[1])  # 64 flips each: equal by chance with p = 2**-64
    # The parent's own streams are left as they were.
    assert (torch.rand(()).item(), np.random.random(), random.random()) == \
        (torch.manual_seed(0) and torch.rand(()).item(), np.random.seed(0) or np.random.random(),
         random.seed(0) or random.random())


def test_set_seed_makes_the_workers_torch_streams_reproducible_and_distinct(make_multi):
    runs = []
    for _ in range(2):
        collector = make_multi(MultiSyncCollector, "CartPole-v1", CoinPolicy("torch"), num_workers=2,
                               frames_per_batch=128, mp_start_method="fork")
        collector.set_seed(7)
        runs.append(flips(collector))
        collector.shutdown()
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0][0], runs[0][1])
