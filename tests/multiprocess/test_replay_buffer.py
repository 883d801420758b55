"""Collectors writing into a ReplayBuffer: iteration yields None, workers write directly,
free-running start()/pause()/async_shutdown(), weights while running free (SPEC 7)."""

from __future__ import annotations

import collections
import time

import numpy as np
import pytest
import torch
from mp_helpers import BLOCK, POLICY_VERSION, START, TRAJ_IDS, ListBuffer, ValuePolicy, assert_gone, endless

from rlcollect import Collector, CountingEnv, MultiAsyncCollector, MultiSyncCollector, ReplayBuffer

CLASSES = [MultiSyncCollector, MultiAsyncCollector]


@pytest.fixture
def rb():
    buffer = ReplayBuffer(200_000)
    yield buffer
    buffer.close()


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def check_each_frame_once(rb: ReplayBuffer) -> dict[int, int]:
    """Every env row of an endless CountingEnv counts 0, 1, 2, ...: each (trajectory, count) must be
    in the buffer exactly once, with no gap, and every field of a frame must agree."""
    data = rb[torch.arange(len(rb))]
    ids = data[TRAJ_IDS].numpy()
    obs = data["observation"][:, 0].numpy()
    np.testing.assert_array_equal(data["next", "observation"][:, 0].numpy(), obs + 1)  # no torn frame
    per_traj: dict[int, list] = collections.defaultdict(list)
    for i, o in zip(ids.tolist(), obs.tolist()):
        per_traj[i].append(o)
    for traj, counts in per_traj.items():
        assert sorted(counts) == list(range(len(counts))), f"trajectory {traj}: lost or duplicated frames"
    return {traj: len(counts) for traj, counts in per_traj.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_iterating_writes_every_frame_and_yields_none(cls, rb):
    with cls(endless, num_workers=2, frames_per_batch=40, total_frames=160, replay_buffer=rb,
             mp_start_method=START) as collector:
        out = list(collector)
        assert out == [None] * 4
        assert collector.stats()["frames"] == 160
    assert len(rb) == rb.write_count == 160
    counts = check_each_frame_once(rb)
    assert {t // BLOCK for t in counts} == {0, 1}


@pytest.mark.timeout(120)
def test_postproc_runs_in_the_workers_before_the_write(rb):
    with MultiSyncCollector(endless, num_workers=2, frames_per_batch=20, total_frames=40, replay_buffer=rb,
                            postproc=_double_reward, mp_start_method=START) as collector:
        list(collector)
    assert rb[torch.arange(len(rb))]["next", "reward"].unique().tolist() == [2.0]


def _double_reward(batch):
    batch["next", "reward"] *= 2
    return batch


@pytest.mark.timeout(120)
def test_a_buffer_the_workers_cannot_share_is_written_by_the_main_process():
    buffer = ListBuffer()
    with MultiSyncCollector(endless, num_workers=2, frames_per_batch=20, total_frames=60, replay_buffer=buffer,
                            mp_start_method=START) as collector:
        assert list(collector) == [None] * 3
    # each worker's batch is extended on its own, as torchrl's workers do
    assert buffer.frames == 60 and len(buffer.batches) == 6 and buffer.batches[0].shape == (10,)


def test_start_without_a_buffer_is_refused():
    collector = Collector(CountingEnv(), frames_per_batch=10)
    with pytest.raises(RuntimeError, match="replay_buffer"):
        collector.start()
    with pytest.raises(RuntimeError, match="start"):
        with collector.pause():
            pass
    collector.shutdown()


@pytest.mark.timeout(120)
def test_multi_start_without_a_buffer_is_refused():
    with MultiAsyncCollector(endless, num_workers=1, frames_per_batch=10, mp_start_method=START) as collector:
        with pytest.raises(RuntimeError, match="replay_buffer"):
            collector.start()


@pytest.mark.timeout(120)
def test_four_workers_running_free_write_each_frame_exactly_once():
    rb = ReplayBuffer(1_000_000)
    collector = MultiAsyncCollector(endless, num_workers=4, frames_per_batch=200, replay_buffer=rb,
                                    mp_start_method=START)
    pids = collector.worker_pids()
    try:
        collector.start()
        wait_for(lambda: rb.write_count >= 40_000, timeout=60)
        time.sleep(1.0)
        with pytest.raises(RuntimeError, match="running free"):
            next(iter(collector))
        collector.async_shutdown()
        assert len(rb) == rb.write_count
        counts = check_each_frame_once(rb)
        assert {t // BLOCK for t in counts} == {0, 1, 2, 3}  # every worker wrote
        assert sum(counts.values()) == rb.write_count
    finally:
        collector.shutdown()
        rb.close()
    assert_gone(pids)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_stats_report_live_figures_while_running_free(cls, rb):
    # stats() once read fps 0.0 and per-worker frames [0, 0, ...] while start() ran (issue 38)
    collector = cls(endless, num_workers=2, frames_per_batch=100, replay_buffer=rb, mp_start_method=START)
    try:
        collector.start()
        wait_for(lambda: min(w["frames"] for w in collector.stats()["workers"]) >= 500)
        s = collector.stats()
        assert 1_000 <= s["frames"] <= rb.write_count and s["fps"] > 0
        assert sum(w["frames"] for w in s["workers"]) == s["frames"]
        with collector.pause():  # the batches in progress are written and counted: exact
            s = collector.stats()
            assert s["frames"] == sum(w["frames"] for w in s["workers"]) == rb.write_count
        collector.async_shutdown()
        assert collector.stats()["frames"] == rb.write_count
    finally:
        collector.async_shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("multi", [True, False], ids=["MultiAsyncCollector", "Collector"])
def test_pause_freezes_write_count_and_writing_resumes_after(multi, rb):
    if multi:
        collector = MultiAsyncCollector(endless, num_workers=2, frames_per_batch=100, replay_buffer=rb,
                                        mp_start_method=START)
    else:
        collector = Collector(CountingEnv(max_steps=None), frames_per_batch=100, replay_buffer=rb)
    try:
        collector.start()
        wait_for(lambda: rb.write_count >= 1_000)
        with collector.pause():
            frozen = rb.write_count
            time.sleep(0.6)
            assert rb.write_count == frozen
        wait_for(lambda: rb.write_count > frozen + 1_000)
    finally:
        collector.async_shutdown()


@pytest.mark.timeout(120)
def test_weights_updated_while_running_free_reach_later_frames(rb):
    policy = ValuePolicy(w=0.0)
    collector = MultiAsyncCollector(endless, policy, num_workers=2, frames_per_batch=50, replay_buffer=rb,
                                    track_policy_version=True, mp_start_method=START)
    try:
        collector.start()
        wait_for(lambda: rb.write_count >= 500)
        with torch.no_grad():
            policy.w.fill_(1.0)
        collector.update_policy_weights_()
        mark = rb.write_count
        wait_for(lambda: rb.write_count >= mark + 2_000)
    finally:
        collector.async_shutdown()
    data = rb[torch.arange(len(rb))]
    versions, actions = data[POLICY_VERSION], data["action"]
    assert set(versions.unique().tolist()) == {0, 1}
    assert set(actions[versions == 0].tolist()) == {0} and set(actions[versions == 1].tolist()) == {1}


@pytest.mark.timeout(120)
def test_init_random_frames_is_judged_by_the_write_count(rb):
    policy = ValuePolicy(w=1.0)  # always action 1; random frames mix 0 and 1
    with MultiSyncCollector(endless, policy, num_workers=2, frames_per_batch=200, total_frames=800,
                            replay_buffer=rb, init_random_frames=400, mp_start_method=START) as collector:
        list(collector)
    actions = rb[torch.arange(len(rb))]["action"]
    assert set(actions[:400].tolist()) == {0, 1}
    assert set(actions[400:].tolist()) == {1}
