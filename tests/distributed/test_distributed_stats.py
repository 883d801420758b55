"""DistributedCollector.stats(): each node's env-step latency (measured on the node, sent with
its batch notice), the policy lag of each batch over its frames' versions, time blocked
waiting, and the keys every collector has."""

from __future__ import annotations

import functools

import pytest
import torch

from dist_helpers import POLICY_VERSION, ValuePolicy, node_pids, wait_gone
from rlcollect import Collector, CountingEnv
from rlcollect.distributed.collector import DistributedCollector
from rlcollect.envs.testing import SleepEnv

pytestmark = pytest.mark.timeout(180)

STEP_S = 0.005
sleepy = functools.partial(SleepEnv, step_time=STEP_S, obs_dim=1)


def frame_lag(trainer_version: int, batch) -> tuple[float, int]:
    lag = trainer_version - batch[POLICY_VERSION]
    return float(lag.double().mean()), int(lag.max())


@pytest.fixture(scope="module")
def collector():
    c = DistributedCollector([sleepy] * 2, ValuePolicy(), frames_per_batch=10, total_frames=-1, sync=False,
                             timeout=120.0, collector_kwargs={"track_policy_version": True})
    yield c
    pids = node_pids(c)
    c.shutdown()
    assert not wait_gone(pids)


def test_node_latency_lag_and_wait(collector):
    c = collector
    assert [w["env_step_mean_s"] for w in c.stats()["workers"]] == [None, None]
    seen = set()
    for i, batch in zip(range(8), c):
        s = c.stats()
        assert (s["policy_lag_mean"], s["policy_lag_max"]) == frame_lag(s["policy_version"], batch)
        seen.add(int(batch[("collector", "node_id")][0]))
        c.update_policy_weights_({"w": torch.tensor([float(i)])})
    s = c.stats()
    assert s["batch_wait_s"] >= 0 and s["wait_s"] > 0
    for node in s["workers"]:
        if node["index"] in seen:  # measured on the node: every step sleeps STEP_S
            assert node["env_step_mean_s"] >= STEP_S and node["env_step_p95_s"] >= STEP_S


def test_keys_are_every_collectors_plus_the_nodes(collector):
    single = Collector(CountingEnv, frames_per_batch=4)
    expected = single.stats()
    single.shutdown()
    s = collector.stats()
    torchrl = ["total_frames", "completed", "requested_frames_per_batch", "workers_alive"]  # torchrl 0.14's, last
    ours = [k for k in expected if k not in torchrl]
    assert list(s) == [*ours, "dropped_nodes", "launcher", "master", *torchrl]
    assert list(s["workers"][0]) == [*expected["workers"][0], "state", "host", "pid"]


@pytest.mark.parametrize("k", [0, 1])
def test_max_policy_lag_drops_stale_batches_and_counts_them(k):
    """Async, three nodes of different speeds, weights updated after every batch: no delivered
    frame is more than k versions behind; what was taken and not delivered is counted dropped,
    per node and in the batches' metadata."""
    envs = [functools.partial(CountingEnv, max_steps=None), functools.partial(SleepEnv, step_time=0.001, obs_dim=1),
            functools.partial(SleepEnv, step_time=0.004, obs_dim=1)]
    c = DistributedCollector(envs, ValuePolicy(), frames_per_batch=8, total_frames=8 * 16, sync=False, timeout=120.0,
                             collector_kwargs={"track_policy_version": True}, max_policy_lag=k)
    pids = node_pids(c)
    try:
        delivered = announced = 0
        for batch in c:
            assert int((c.policy_version - batch[POLICY_VERSION]).max()) <= k
            delivered += batch.numel()
            announced += int(batch[("collector", "lag_dropped_frames")][0])
            c.update_policy_weights_({"w": torch.tensor([float(c.policy_version + 1)])})
        s = c.stats()
    finally:
        c.shutdown()
    assert not wait_gone(pids)
    assert s["delivered_frames"] == delivered == 8 * 16
    assert s["collected_frames"] - s["delivered_frames"] == s["lag_dropped_frames"] == announced
    assert sum(w["lag_dropped_frames"] for w in s["workers"]) == s["lag_dropped_frames"]
    assert sum(w["frames"] for w in s["workers"]) == delivered


def test_wait_and_sync_are_refused_with_a_lag_bound():
    with pytest.raises(ValueError, match="lag_policy='wait' is not supported"):
        DistributedCollector([sleepy], ValuePolicy(), frames_per_batch=8, max_policy_lag=1, lag_policy="wait")
    with pytest.raises(ValueError, match="max_policy_lag=1: sync=True"):
        DistributedCollector([sleepy], ValuePolicy(), frames_per_batch=8, sync=True, max_policy_lag=1)
