"""collector_class nesting, and options passed through to the workers' collectors."""

from __future__ import annotations

import pytest
import torch
from mp_helpers import BLOCK, POLICY_VERSION, TRAJ_IDS, WORKER_ID, ValuePolicy, counting5, endless, make_multi  # noqa: F401

from rlcollect import MultiAsyncCollector, MultiSyncCollector

pytestmark = pytest.mark.timeout(120)


def test_sync_inside_sync_stacks_and_keeps_ids_unique(make_multi):
    policy = ValuePolicy(w=1)
    collector = make_multi(MultiSyncCollector, counting5, policy, num_workers=2, frames_per_batch=16,
                           collector_class=MultiSyncCollector, collector_kwargs={"num_workers": 2},
                           track_policy_version=True)
    batch = next(collector)
    assert batch.shape == (2, 2, 4)
    blocks = (batch[TRAJ_IDS][..., 0] // BLOCK).tolist()
    assert blocks == [[0, 1], [2, 3]]  # outer worker i, inner worker j -> block 2 * i + j
    assert batch["action"].unique().tolist() == [1]
    collector.update_policy_weights_({"w": torch.tensor([2.0]), "b": torch.tensor([0.0])})
    batch = next(collector)
    assert batch["action"].unique().tolist() == [2]  # the update cascades to the inner workers
    assert batch[POLICY_VERSION].unique().tolist() == [1]


def test_async_inside_sync_tags_inner_workers(make_multi):
    collector = make_multi(MultiSyncCollector, counting5, num_workers=2, frames_per_batch=16,
                           collector_class="async", collector_kwargs={"num_workers": 2})
    batch = next(collector)
    assert batch.shape == (2, 8)
    assert set(batch[WORKER_ID].unique().tolist()) <= {0, 1}


def test_nesting_without_inner_worker_count_is_refused():
    with pytest.raises(ValueError, match="collector_kwargs"):
        MultiSyncCollector(counting5, num_workers=2, frames_per_batch=8, collector_class=MultiSyncCollector)


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector], ids=lambda c: c.__name__)
def test_options_reach_the_workers_collectors(make_multi, cls):
    collector = make_multi(cls, endless, ValuePolicy(w=1), num_workers=2, frames_per_batch=12,
                           max_frames_per_traj=3, init_random_frames=1, split_trajs=True)
    batch = next(collector)
    # split_trajs: one trajectory per row, each of max_frames_per_traj=3 steps
    assert batch.shape[-1] == 3 and batch["collector", "mask"].all()
    assert (batch["next", "step_count"][..., -1, 0] == 3).all()
    assert batch["next", "truncated"][..., -1, 0].all()
    assert set(batch["action"].unique().tolist()) <= {0, 1}  # first batch random
    # async workers start with two batches in flight each, all started as random ones; they may
    # be delivered after batches started later, so look past all of them
    for _ in range(1 if cls is MultiSyncCollector else 8):
        later = next(collector)
    assert later["action"][later["collector", "mask"]].unique().tolist() == [1]
