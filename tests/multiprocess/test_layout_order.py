"""Workers whose batch layouts hold the same entries in a different order (torchrl's composite
specs are ordered by a set, which differs between spawned processes) still deliver every entry
where it belongs: each worker writes its slots in the layout the main process allocated them
with, not in its own order."""

from __future__ import annotations

import functools

import pytest
import torch

from mp_helpers import START, two_key_env

from rlcollect import MultiAsyncCollector, MultiSyncCollector


@pytest.mark.parametrize("cls,cat_results", [(MultiSyncCollector, "stack"), (MultiSyncCollector, 0),
                                             (MultiAsyncCollector, None)])
def test_workers_listing_entries_in_another_order_deliver_them_in_place(cls, cat_results):
    envs = [functools.partial(two_key_env, "ab"), functools.partial(two_key_env, "ba")]
    kwargs = {} if cat_results is None else {"cat_results": cat_results}
    collector = cls(envs, None, frames_per_batch=40, total_frames=160, mp_start_method=START, **kwargs)
    try:
        batches = list(collector)
    finally:
        collector.shutdown()
    assert sum(b.numel() for b in batches) == 160
    for batch in batches:
        a, b = batch["a"], batch["b"]
        assert torch.equal(b, a * 10), (a.flatten()[:8], b.flatten()[:8])
        assert torch.equal(batch["next", "b"], batch["next", "a"] * 10)
        assert a.max() > 0
