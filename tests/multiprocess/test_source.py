"""The ``BatchSource`` calls (rlcollect/source.py) that workers and nodes drive a collector
with: every collector implements them, and a nested multi-process collector honours them
exactly (the version it is given, the randomness it is asked for)."""

from __future__ import annotations

import mp_helpers
import pytest
import torch
from mp_helpers import POLICY_VERSION, ValuePolicy, counting5, weights

from rlcollect import Collector, MultiAsyncCollector, MultiSyncCollector
from rlcollect.data import BatchBuffer
from rlcollect.source import BatchSource

pytestmark = pytest.mark.timeout(120)
make_multi = mp_helpers.make_multi
PIPE = {"policy": "process"}


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_every_collector_is_a_batch_source(make_multi, cls):
    single = Collector(counting5(), ValuePolicy(w=1), frames_per_batch=4)
    try:
        assert isinstance(single, BatchSource)
        assert single.weight_spec == {"w": ((1,), torch.float32), "b": ((1,), torch.float32)}
    finally:
        single.shutdown()
    multi = make_multi(cls, counting5, ValuePolicy(w=1), num_workers=2, frames_per_batch=4)
    assert isinstance(multi, BatchSource)
    assert multi.weight_spec == {"w": ((1,), torch.float32), "b": ((1,), torch.float32)}
    assert multi.weights_module() is multi.policy
    with pytest.raises(ValueError, match="updates only 'policy'"):
        multi.weights_module("policy.head")


@pytest.mark.parametrize("schemes", [None, PIPE], ids=["shared", "pipe"])
def test_set_weights_lands_on_the_given_version(make_multi, schemes):
    """An outer worker or node sets the version it was given (no bump on top of it)."""
    collector = make_multi(MultiSyncCollector, counting5, ValuePolicy(w=1), num_workers=2, frames_per_batch=8,
                           track_policy_version=True, weight_sync_schemes=schemes)
    collector.set_weights(weights(3), version=5)
    assert collector.policy_version == 5
    assert collector.worker_policy_versions() == [5, 5]
    batch = next(collector)
    assert batch["action"].unique().tolist() == [3]
    assert batch[POLICY_VERSION].unique().tolist() == [5]
    assert collector.policy.w.item() == 3.0  # the main copy is what the workers act with
    collector.set_weights(None, version=9)  # None: the policy's weights as they are
    assert next(collector)[POLICY_VERSION].unique().tolist() == [9]


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_nested_collect_into_acts_as_asked_and_leaves_init_random_frames(make_multi, cls):
    """Regression: a nested collector was made to act randomly by overwriting its own
    ``init_random_frames`` (``frames + 1``), which stayed changed after the batch."""
    collector = make_multi(cls, counting5, ValuePolicy(w=1), num_workers=2, frames_per_batch=64)
    buf = BatchBuffer(collector.layout)
    assert collector.collect_into(buf, random=True) == buf.layout.frames
    assert collector.init_random_frames == 0
    # CountingEnv's random actions are 0 or 1 with equal chance: the policy's 1 everywhere in
    # 64 frames would be a 2**-64 coincidence.
    assert set(buf.td["action"].unique().tolist()) == {0, 1}
    if cls is MultiSyncCollector:  # (async: the batches already asked for were asked randomly)
        collector.collect_into(buf, random=False)
        assert buf.td["action"].unique().tolist() == [1]
        assert collector.init_random_frames == 0
