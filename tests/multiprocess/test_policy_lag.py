"""max_policy_lag / lag_policy on MultiAsyncCollector (issue 26): a trainer that updates after
every batch, workers of deliberately different speeds; no delivered frame is more than k
versions behind the trainer's version at delivery; the books add up (collected = delivered +
dropped for lag, per worker and in the batches' metadata); also across a SIGKILLed and
restarted worker, and with central inference."""

from __future__ import annotations

import functools

import pytest
import torch
from mp_helpers import POLICY_VERSION, WORKER_ID, ValuePolicy, running, weights

from rlcollect import MultiAsyncCollector, MultiSyncCollector
from rlcollect.envs.testing import CountingEnv, FaultyEnv, SleepEnv
from rlcollect.multiprocess.gather import LAG_DROPPED

pytestmark = pytest.mark.timeout(180)

FRAMES, BATCHES = 8, 24
#: three workers: steps of 0 ms, 1 ms and 4 ms (the slow one's batches come late)
SPEEDS = [functools.partial(CountingEnv, max_steps=None),
          functools.partial(SleepEnv, step_time=0.001, obs_dim=1),
          functools.partial(SleepEnv, step_time=0.004, obs_dim=1)]


def run_updating_every_batch(envs, **kwargs):
    """Iterate to the end, updating the weights after every batch to ``weights(version + 1)``
    (ValuePolicy acts round(w): each frame's action is the version of the weights that acted).
    Returns the delivered batches (each with the trainer's version when it came) and stats()."""
    delivered = []
    with running(MultiAsyncCollector, envs, ValuePolicy(), frames_per_batch=FRAMES, total_frames=FRAMES * BATCHES,
                 track_policy_version=True, **kwargs) as collector:
        for batch in collector:
            version = collector.policy_version
            delivered.append((version, batch.clone()))
            collector.update_policy_weights_(weights(version + 1))
        stats = collector.stats()
    return delivered, stats


def check_books(delivered, stats, k):
    for version, batch in delivered:
        assert int((version - batch[POLICY_VERSION]).max()) <= k
        # the version a frame is tagged with is the one whose weights acted
        assert torch.equal(batch["action"], batch[POLICY_VERSION])
    frames = sum(batch.numel() for _, batch in delivered)
    assert len(delivered) == BATCHES and frames == FRAMES * BATCHES
    assert stats["delivered_frames"] == stats["frames"] == frames
    assert stats["collected_frames"] - stats["delivered_frames"] == stats["lag_dropped_frames"]
    assert sum(w["lag_dropped_frames"] for w in stats["workers"]) == stats["lag_dropped_frames"]
    # every dropped frame is announced by the next batch delivered
    assert sum(int(batch[LAG_DROPPED].reshape(-1)[0]) for _, batch in delivered) == stats["lag_dropped_frames"]
    assert stats["lag_dropped_frames"] % FRAMES == 0


@pytest.mark.parametrize("inference", ["worker", "central"])
@pytest.mark.parametrize("k", [0, 1])
def test_drop_delivers_nothing_staler_than_k(k, inference):
    delivered, stats = run_updating_every_batch(SPEEDS, max_policy_lag=k, lag_policy="drop", inference=inference)
    check_books(delivered, stats, k)
    if k == 0:  # three workers with three batches each in flight: some must be stale
        assert stats["lag_dropped_frames"] > 0


@pytest.mark.parametrize("inference", ["worker", "central"])
@pytest.mark.parametrize("k", [0, 2])
def test_wait_collects_nothing_stale(k, inference):
    delivered, stats = run_updating_every_batch(SPEEDS, max_policy_lag=k, lag_policy="wait", inference=inference)
    check_books(delivered, stats, k)
    assert stats["lag_dropped_frames"] == 0
    workers = {int(batch[WORKER_ID].reshape(-1)[0]) for _, batch in delivered}
    assert workers == {0, 1, 2}  # the slow worker's batches are waited for, not skipped


def test_tag_delivers_everything():
    delivered, stats = run_updating_every_batch(SPEEDS, max_policy_lag=0, lag_policy="tag")
    assert stats["lag_dropped_frames"] == 0 and stats["collected_frames"] == FRAMES * BATCHES
    assert LAG_DROPPED not in delivered[0][1].keys(True)
    assert max(int((v - b[POLICY_VERSION]).max()) for v, b in delivered) > 0  # stale frames were delivered


@pytest.mark.parametrize("lag_policy", ["drop", "wait"])
@pytest.mark.parametrize("inference", ["worker", "central"])
def test_a_killed_worker_is_replaced_and_nothing_stale_slips_through(tmp_path, lag_policy, inference):
    """Worker 2 (the slow one) SIGKILLs itself at its 20th step; its replacement acts with the
    current weights (each frame's action equals its version), and the bound holds."""
    killer = functools.partial(FaultyEnv, fault="kill", at_step=20, worker_ids=[2], times=1,
                               counter_file=str(tmp_path / "fired"), max_steps=None)
    envs = [SPEEDS[0], SPEEDS[1], killer]
    delivered, stats = run_updating_every_batch(envs, max_policy_lag=1, lag_policy=lag_policy, inference=inference,
                                                on_worker_failure="restart")
    check_books(delivered, stats, 1)
    assert stats["restarts"] == 1 and stats["workers"][2]["restarts"] == 1
    assert stats["lost_batches"] == stats["workers"][2]["lost_batches"] >= 1


@pytest.mark.parametrize("kwargs, message", [
    ({"max_policy_lag": -1}, "max_policy_lag must be None or an int >= 0"),
    ({"max_policy_lag": 1.5}, "max_policy_lag must be None or an int >= 0"),
    ({"max_policy_lag": 1, "lag_policy": "skip"}, "lag_policy must be one of"),
])
def test_bad_lag_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiAsyncCollector(CountingEnv, num_workers=1, frames_per_batch=4, **kwargs)


def test_sync_refuses_a_lag_bound():
    with pytest.raises(ValueError, match="max_policy_lag=1: MultiSyncCollector"):
        MultiSyncCollector(CountingEnv, num_workers=1, frames_per_batch=4, max_policy_lag=1)


class VersionedBuffer:
    """A buffer this process extends (not shared with the workers), noting the collector's
    policy version at each write."""

    def __init__(self):
        self.writes = []
        self.collector = None

    def extend(self, batch) -> None:
        self.writes.append((self.collector.policy_version, batch.clone()))


@pytest.mark.parametrize("lag_policy", ["drop", "wait"])
def test_running_free_writes_nothing_staler_than_k(lag_policy):
    """start(): the trainer updates while the collector writes; no written frame is more
    than 1 version behind the version at its write."""
    import time

    buffer = VersionedBuffer()
    with running(MultiAsyncCollector, SPEEDS, ValuePolicy(), frames_per_batch=FRAMES, replay_buffer=buffer,
                 track_policy_version=True, max_policy_lag=1, lag_policy=lag_policy) as collector:
        buffer.collector = collector
        collector.start()
        deadline = time.monotonic() + 60
        while len(buffer.writes) < BATCHES:
            assert time.monotonic() < deadline
            written = len(buffer.writes)
            while len(buffer.writes) == written:
                time.sleep(0.001)
            collector.update_policy_weights_(weights(collector.policy_version + 1))
        collector.async_shutdown()
        stats = collector.stats()
    for version, batch in buffer.writes:
        assert int((version - batch[POLICY_VERSION]).max()) <= 1
        assert torch.equal(batch["action"], batch[POLICY_VERSION])
    assert stats["delivered_frames"] == sum(batch.numel() for _, batch in buffer.writes)
    assert stats["collected_frames"] - stats["delivered_frames"] == stats["lag_dropped_frames"]
