"""MultiAsyncCollector (SPEC 1 shapes, SPEC 5): one worker's batch per yield, tagged with its
worker id; per-worker continuity; weights reaching running workers; MultiCollector(sync=False);
options async refuses."""

from __future__ import annotations

import collections

import pytest
import torch
from mp_helpers import (
    BLOCK,
    POLICY_VERSION,
    START,
    TRAJ_IDS,
    WORKER_ID,
    ValuePolicy,
    check_counting_stream,
    concat_rows,
    counting5,
    make_multi,  # noqa: F401  (fixture)
    rows_of,
    running,
    weights,
)

from rlcollect import MultiAsyncCollector, MultiCollector, MultiSyncCollector

pytestmark = pytest.mark.timeout(90)

BATCHES, UPDATE_AT = 24, 6


@pytest.fixture(scope="module")
def delivered():
    """2 workers (CountingEnv(max_steps=5), ValuePolicy), 4 frames per batch, 96 frames in all,
    built through MultiCollector(sync=False); the weights are updated after batch 6."""
    with running(MultiCollector, counting5, ValuePolicy(), num_workers=2, frames_per_batch=4,
                 total_frames=4 * BATCHES, sync=False, track_policy_version=True) as collector:
        batches = []
        for batch in collector:
            batches.append(batch)
            if len(batches) == UPDATE_AT:
                collector.update_policy_weights_(weights(5))
        yield collector, batches


def test_multicollector_sync_false_is_async(delivered):
    collector, _ = delivered
    assert isinstance(collector, MultiAsyncCollector)
    assert not isinstance(collector, MultiSyncCollector)


def test_each_batch_is_one_workers_frames_with_its_id(delivered):
    collector, batches = delivered
    assert len(batches) == BATCHES == len(collector)
    for batch in batches:
        assert batch.shape == torch.Size([4])
        assert batch.names == ["time"]
        worker = batch[WORKER_ID]
        assert worker.dtype == torch.int64 and worker.shape == torch.Size([4])
        assert (worker == worker[0]).all()
        w = int(worker[0])
        assert (batch[TRAJ_IDS] >= w * BLOCK).all() and (batch[TRAJ_IDS] < (w + 1) * BLOCK).all()
    counts = collections.Counter(int(b[WORKER_ID][0]) for b in batches)
    assert set(counts) == {0, 1}, counts
    stats = collector.stats()
    assert stats["frames"] == 4 * BATCHES
    assert [w["frames"] for w in stats["workers"]] == [4 * counts[0], 4 * counts[1]]


def test_each_workers_stream_is_continuous_across_its_batches(delivered):
    _, batches = delivered
    for w in (0, 1):
        own = [b for b in batches if int(b[WORKER_ID][0]) == w]
        row = concat_rows([rows_of(b)[0] for b in own])
        assert row["obs"][:7].tolist() == [0, 1, 2, 3, 4, 0, 1]
        check_counting_stream(row, max_steps=5)


def test_an_update_while_running_reaches_later_batches(delivered):
    collector, batches = delivered
    for w in (0, 1):
        own = [b for b in batches if int(b[WORKER_ID][0]) == w]
        versions = [int(b[POLICY_VERSION][0]) for b in own]
        for b in own:
            # Weights are taken between batches: one version, and the action it implies, per batch.
            assert (b[POLICY_VERSION] == b[POLICY_VERSION][0]).all()
            assert (b["action"] == (5 if int(b[POLICY_VERSION][0]) == 1 else 0)).all()
        assert versions == sorted(versions), versions
        assert versions[-1] == 1, f"worker {w} never acted with the update: {versions}"
    # Batches delivered before the update were collected with version 0.
    assert all(int(b[POLICY_VERSION][0]) == 0 for b in batches[:UPDATE_AT])
    assert collector.worker_policy_versions() == [1, 1]


def test_async_refuses_preemption_and_concatenation():
    with pytest.raises(ValueError, match="preemptive_threshold"):
        MultiAsyncCollector(counting5, num_workers=2, frames_per_batch=4, preemptive_threshold=0.5,
                            mp_start_method=START)
    for bad in (0, -1, "bogus"):
        with pytest.raises(ValueError, match="cat_results"):
            MultiAsyncCollector(counting5, num_workers=2, frames_per_batch=4, cat_results=bad, mp_start_method=START)


def test_multicollector_sync_flag_must_be_a_bool():
    with pytest.raises(TypeError, match="sync"):
        MultiCollector(counting5, num_workers=2, frames_per_batch=4, sync="no", mp_start_method=START)


def test_async_endless_collector_has_no_len(make_multi):
    collector = make_multi(MultiAsyncCollector, counting5, num_workers=1, frames_per_batch=3)
    with pytest.raises(TypeError, match="endless"):
        len(collector)
    first, second = next(collector), next(collector)
    assert first["observation"][:, 0].tolist() == [0, 1, 2]
    assert second["observation"][:, 0].tolist() == [3, 4, 0]
    assert collector.stats()["frames"] == 6

