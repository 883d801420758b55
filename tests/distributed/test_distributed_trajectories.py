"""``DistributedCollector`` with torchrl 0.14's ``trajs_per_batch`` / ``traj_format`` (whole
trajectories assembled on rank 0 from the nodes' batches) and its ``pre_collect_hook``, both
run by ``CollectorBase.__iter__`` as for the other collectors."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from rlcollect import DistributedCollector

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loadscale import scaled  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.processes]

#: The nodes' start-up wait, grown with the machine's load (two nodes import torch at once).
START = scaled(120, cap=480)


def _whole_rows(batch):
    mask = batch["collector", "mask"]
    out = []
    for r in range(batch.shape[0]):
        length = int(mask[r].sum())
        assert length > 0 and mask[r, :length].all() and not mask[r, length:].any()
        ids, done = batch["collector", "traj_ids"][r, :length], batch["next", "done"][r, :length, 0]
        assert (ids == ids[0]).all() and bool(done[-1]) and not done[:-1].any()
        out.append(int(ids[0]))
    return out


@pytest.mark.parametrize("sync", [False, True])
def test_padded_batches_of_whole_trajectories_from_the_nodes(sync):
    calls = []
    with DistributedCollector(["CartPole-v1"] * 2, frames_per_batch=40, total_frames=1200, sync=sync,
                              trajs_per_batch=3, pre_collect_hook=lambda: calls.append(1), start_timeout=START) as c:
        c.set_seed(0)
        seen = []
        for batch in c:
            assert batch.shape[0] == 3
            seen += _whole_rows(batch)
        batches = c.stats()["batches"]
    assert len(seen) == len(set(seen)) >= 6
    assert len({i >> 40 for i in seen}) == 2  # both nodes' trajectory id blocks
    assert len(calls) == batches  # the hook ran before every batch asked of the nodes


def test_cat_format_and_a_reset_that_drops_what_it_cuts():
    with DistributedCollector(["CartPole-v1"] * 2, frames_per_batch=20, total_frames=-1, trajs_per_batch=2,
                              traj_format="cat", start_timeout=START) as c:
        c.set_seed(1)
        it = iter(c)
        next(it)
        c.reset()
        for _ in range(4):
            batch = next(it)
            assert batch.ndim == 1 and "mask" not in batch["collector"].keys()
            ids, done = batch["collector", "traj_ids"], batch["next", "done"][:, 0]
            ends = torch.nonzero(done).flatten().tolist()
            assert len(ends) == 2 and ends[-1] == batch.shape[0] - 1
            first, second = ids[: ends[0] + 1], ids[ends[0] + 1:]
            assert (first == first[0]).all() and (second == second[0]).all() and first[0] != second[0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(trajs_per_write=2), "trajs_per_write=2 needs trajs_per_batch"),
    (dict(trajs_per_batch=2, split_trajs=True), "split_trajs=True cannot be combined with trajs_per_batch"),
    (dict(trajs_per_batch=-1), "trajs_per_batch must be None or a positive int, got -1"),
])
def test_bad_trajectory_arguments_are_refused_before_any_node_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DistributedCollector(["CartPole-v1"] * 2, frames_per_batch=20, **kwargs)
