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
    assert list(s) == [*ours, "dropped_nodes", "lost_batches", "launcher", "master", *torchrl]
    assert list(s["workers"][0]) == [*expected["workers"][0], "state", "lost_batches", "host", "pid"]
