"""DistributedCollector accepts torchrl's weight arguments where they make sense and rejects
the rest clearly (issue 12 item 3): update_policy_weights_(policy=, weights=, weights_dict=,
model_id=), get_model, get_cached_weights, weight_updater=."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import ValuePolicy, counting5, node_pids, wait_gone

from rlcollect.distributed.collector import DistributedCollector
from rlcollect.weights.models import UnknownModelError

pytestmark = pytest.mark.timeout(180)


class Updater:
    """torchrl's WeightUpdaterBase interface, duck-typed."""

    def __init__(self):
        self.collector, self.calls = None, 0

    def register_collector(self, collector):
        self.collector = collector

    def __call__(self, policy_or_weights=None, worker_ids=None):
        self.calls += 1
        self.collector.update_policy_weights_(policy_or_weights, worker_ids=worker_ids)


def test_torchrl_weight_forms_on_nodes():
    policy, updater = ValuePolicy(), Updater()
    c = DistributedCollector([counting5], policy, frames_per_batch=10, total_frames=-1, sync=True, timeout=120.0,
                             weight_updater=updater)
    pids = node_pids(c)
    try:
        assert updater.collector is c and c.get_model("policy") is policy and c.get_cached_weights("policy") is None
        c.update_policy_weights_(policy={"w": torch.ones(1)})
        assert updater.calls == 1 and next(iter(c))["action"].unique().tolist() == [1]
        with pytest.raises(ValueError, match="not supported with weight_updater"):
            c.update_policy_weights_(weights_dict={"policy": None})
        c.weight_updater = None  # the built-in path
        c.update_policy_weights_(weights_dict={"policy": {"w": torch.zeros(1)}})
        assert next(iter(c))["action"].unique().tolist() == [0] and c.policy_version == 2
        with pytest.raises(KeyError, match=r"model_id \['value_net'\]: a DistributedCollector has only the 'policy'"):
            c.update_policy_weights_({"w": torch.ones(1)}, model_id="value_net")
        with pytest.raises(UnknownModelError):
            c.get_model("policy.w")
    finally:
        c.shutdown()
        assert not wait_gone(pids)


def test_weight_updater_and_schemes_are_exclusive():
    with pytest.raises(ValueError, match="weight_sync_schemes or weight_updater, not both"):
        DistributedCollector([counting5], ValuePolicy(), frames_per_batch=10, weight_updater=Updater(),
                             weight_sync_schemes={"policy": "distributed"})
    with pytest.raises(TypeError, match="weight_updater must be"):
        DistributedCollector([counting5], ValuePolicy(), frames_per_batch=10, weight_updater=3)
