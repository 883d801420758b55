"""stats() of the multi-process collectors: policy lag per batch over the frames' real versions
(mean and max, exact for known version schedules), time blocked waiting for the workers,
per-worker env-step latency measured in the workers, and the same keys as ``Collector``."""

from __future__ import annotations

import functools
import json
import time

import pytest
from mp_helpers import (
    POLICY_VERSION,
    ValuePolicy,
    endless,
    make_multi,  # noqa: F401  (fixture)
    slow_env,
    take,
    weights,
)

from rlcollect import Collector, MultiAsyncCollector, MultiProcessWeightSyncScheme, MultiSyncCollector
from rlcollect.envs.testing import SleepEnv

pytestmark = pytest.mark.timeout(120)

STEP_S = 0.002  # SkewedSleepEnv's short step
SLOW = 20  # every 10th step sleeps this many short steps


class SkewedSleepEnv(SleepEnv):
    """Sleeps ``STEP_S`` per step, and ``SLOW * STEP_S`` every 10th step: more than 5% of the
    steps are slow, so the p95 is a slow step whatever the machine's load, well above the mean."""

    def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
        self._calls = getattr(self, "_calls", 0) + 1
        time.sleep(self.step_time * (SLOW if self._calls % 10 == 0 else 1))
        self._advance(obs_out, reward, terminated, truncated)


skewed = functools.partial(SkewedSleepEnv, step_time=STEP_S, obs_dim=1)
PIPE = {"policy": MultiProcessWeightSyncScheme()}  # updates queue behind the collect commands: a known order


def frame_lag(trainer_version: int, batch) -> tuple[float, int]:
    """The lag computed from the batch's own per-frame versions."""
    lag = trainer_version - batch[POLICY_VERSION]
    return float(lag.double().mean()), int(lag.max())


def test_sync_lag_is_over_the_frames_of_each_worker(make_multi):
    """Worker 0 (4 frames per batch) gets new weights, worker 1 (12 frames) does not: the lag
    of the next batch is 12/16 on average (the old per-worker average said 0.5), 1 at most."""
    c = make_multi(MultiSyncCollector, [endless] * 2, ValuePolicy(), frames_per_batch=[4, 12], cat_results=-1,
                   weight_sync_schemes=PIPE, track_policy_version=True)
    first = next(c)
    s = c.stats()
    assert (s["policy_lag_mean"], s["policy_lag_max"]) == (0.0, 0) == frame_lag(0, first)
    c.update_policy_weights_(weights(1.0), worker_ids=[0])
    batch = next(c)
    s = c.stats()
    assert batch[POLICY_VERSION].tolist() == [1] * 4 + [0] * 12
    assert (s["policy_lag_mean"], s["policy_lag_max"]) == (0.75, 1) == frame_lag(1, batch)
    assert s["mean_policy_lag"] == 0.75  # the older name
    assert [w["policy_version"] for w in s["workers"]] == [1, 0]


def test_async_lag_follows_the_known_version_schedule(make_multi):
    """One worker with two batches in flight, weights through its pipe after every batch: the
    update queues behind the two collects already sent, so the frames' versions lag the
    trainer's by 0, 1, then 2 for good."""
    c = make_multi(MultiAsyncCollector, [endless], ValuePolicy(), frames_per_batch=5, weight_sync_schemes=PIPE,
                   track_policy_version=True)
    lags, versions = [], []
    for i in range(6):
        batch = next(c)
        s = c.stats()
        lags.append((s["policy_lag_mean"], s["policy_lag_max"]))
        versions.append(int(batch[POLICY_VERSION][0]))
        assert lags[-1] == frame_lag(s["policy_version"], batch) and s["policy_version"] == i
        c.update_policy_weights_(weights(i + 1))
    assert versions == [0, 0, 0, 1, 2, 3]
    assert lags == [(0.0, 0), (1.0, 1), (2.0, 2), (2.0, 2), (2.0, 2), (2.0, 2)]


def test_sync_blocked_time_covers_the_slow_workers_steps(make_multi):
    """The main process sends "collect" and then blocks until both workers have stepped their
    5 sleeping steps: each batch's wait is at least those 5 sleeps; wait_s is their sum."""
    step_time = 0.02
    c = make_multi(MultiSyncCollector, [functools.partial(slow_env, step_time)] * 2, frames_per_batch=10)
    assert c.stats()["batch_wait_s"] == c.stats()["wait_s"] == 0.0
    waits = []
    for _ in range(3):
        next(c)
        waits.append(c.stats()["batch_wait_s"])
    assert all(w >= 5 * step_time for w in waits)
    total = 0.0
    for w in waits:
        total += w
    assert c.stats()["wait_s"] == total


def test_async_blocked_time_is_counted(make_multi):
    c = make_multi(MultiAsyncCollector, [functools.partial(slow_env, 0.02)], frames_per_batch=5)
    next(c)
    s = c.stats()
    assert s["batch_wait_s"] > 0 and s["wait_s"] == s["batch_wait_s"]


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_env_step_latency_is_measured_in_each_worker(make_multi, cls):
    c = make_multi(cls, [skewed] * 2, frames_per_batch=40)
    assert [w["env_step_mean_s"] for w in c.stats()["workers"]] == [None, None]  # nothing stepped yet
    for _ in range(2 if cls is MultiSyncCollector else 4):
        next(c)
    for worker in c.stats()["workers"]:
        if worker["frames"] == 0:  # async: a worker may not have delivered yet
            continue
        mean, p95 = worker["env_step_mean_s"], worker["env_step_p95_s"]
        # every step sleeps at least STEP_S and one in ten SLOW times that (batches of whole tens)
        assert mean >= (0.9 + 0.1 * SLOW) * STEP_S
        assert p95 >= SLOW * STEP_S
        assert p95 >= mean


def test_every_collector_has_the_same_keys(make_multi):
    single = Collector(endless, frames_per_batch=4, total_frames=4)
    list(single)
    expected = single.stats()
    single.shutdown()
    for cls in (MultiSyncCollector, MultiAsyncCollector):
        c = make_multi(cls, [endless] * 2, frames_per_batch=4)
        next(c)
        s = json.loads(json.dumps(c.stats()))  # JSON-serialisable
        assert list(s) == list(expected)
        assert [list(w) for w in s["workers"]] == [list(expected["workers"][0])] * 2


def test_nested_collector_reports_its_workers_latency_and_frame_versions(make_multi):
    """A MultiSyncCollector running inside each worker of another: the outer worker sends the
    versions of the frames its inner collector delivered and the inner workers' latency."""
    c = make_multi(MultiSyncCollector, [skewed], frames_per_batch=20, collector_class="sync",
                   collector_kwargs={"num_workers": 2, "mp_start_method": "fork"})
    take(c, 2)
    worker = c.stats()["workers"][0]
    assert worker["env_step_p95_s"] >= SLOW * STEP_S and worker["env_step_mean_s"] >= STEP_S
    assert c.stats()["policy_lag_max"] == 0


def test_nested_async_lag_counts_the_versions_its_frames_were_collected_with(make_multi):
    """An async collector inside a worker may deliver a batch it started before the last update
    reached it: the lag counts the versions in the frames, not the inner collector's version."""
    c = make_multi(MultiSyncCollector, [endless], ValuePolicy(), frames_per_batch=5, collector_class="async",
                   collector_kwargs={"num_workers": 1, "mp_start_method": "fork"}, track_policy_version=True)
    for i in range(4):
        batch = next(c)
        s = c.stats()
        assert (s["policy_lag_mean"], s["policy_lag_max"]) == frame_lag(s["policy_version"], batch)
        c.update_policy_weights_(weights(i + 1))
