"""torchrl's own weight objects given to rlcollect's collectors (issue 12 item 3): its scheme
classes in ``weight_sync_schemes`` and a real ``WeightUpdaterBase`` subclass as
``weight_updater``. Runs in ``.venv-torchrl``; skipped where torchrl is not installed."""

from __future__ import annotations

import sys
import warnings

import pytest

pytest.importorskip("torchrl.collectors")

import cloudpickle  # noqa: E402
import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.collectors import WeightUpdaterBase  # noqa: E402
from torchrl.weight_update import (  # noqa: E402
    DistributedWeightSyncScheme,
    MultiProcessWeightSyncScheme,
    NoWeightSyncScheme,
    SharedMemWeightSyncScheme,
)

import rlcollect.weights as ours  # noqa: E402
from rlcollect import Collector, CountingEnv, MultiSyncCollector  # noqa: E402
from rlcollect.weights.schemes import validate_schemes  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.timeout(180)


class Bias(nn.Module):
    """Acts ``round(w)`` whatever the observation."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, observation):
        return (observation[..., :1] * 0 + self.w).round().long().squeeze(-1)


def bias(value: float) -> Bias:
    module = Bias()
    with torch.no_grad():
        module.w.fill_(value)
    return module


def make_policy() -> TensorDictModule:
    return TensorDictModule(Bias(), in_keys=["observation"], out_keys=["action"])


with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # torchrl deprecates subclassing it

    class CallBackUpdater(WeightUpdaterBase):
        """A real torchrl updater: doubles the server weights, then pushes them through the
        collector's built-in path to each worker it names."""

        def __init__(self, workers=None):
            self.workers, self.synced = workers, []

        def all_worker_ids(self):
            return self.workers

        def _get_server_weights(self):
            return TensorDict.from_module(self.collector.get_model("policy")).data

        def _maybe_map_weights(self, server_weights):
            return super()._maybe_map_weights(server_weights) * 2

        def _sync_weights_with_worker(self, *, worker_id=None, server_weights):
            self.synced.append(worker_id)
            self.collector.update_policy_weights_(server_weights, worker_ids=worker_id)


@pytest.mark.parametrize("theirs, mine", [
    (SharedMemWeightSyncScheme(), ours.SharedMemWeightSyncScheme),
    (MultiProcessWeightSyncScheme(), ours.MultiProcessWeightSyncScheme),  # a subclass of theirs SharedMem
    (NoWeightSyncScheme(), ours.NoWeightSyncScheme),
    (DistributedWeightSyncScheme(), ours.DistributedWeightSyncScheme),
])
def test_torchrl_scheme_objects_are_mapped(theirs, mine):
    assert type(validate_schemes({"policy": theirs})["policy"]) is mine


def test_torchrl_schemes_in_multi_sync_with_two_models():
    policy = make_policy()
    c = MultiSyncCollector(CountingEnv, policy, num_workers=2, frames_per_batch=4, mp_start_method="forkserver",
                           weight_sync_schemes={"policy": SharedMemWeightSyncScheme(),
                                                "policy.module": MultiProcessWeightSyncScheme()})
    try:
        c.update_policy_weights_(weights_dict={"policy": TensorDict({"module": {"w": torch.ones(1)}})})
        assert next(c)["action"].unique().tolist() == [1]
        c.update_policy_weights_(policy=bias(2.0), model_id="policy.module")
        assert next(c)["action"].unique().tolist() == [2] and c.worker_policy_versions() == [2, 2]
    finally:
        c.shutdown()


def test_no_weight_sync_scheme_from_torchrl_is_a_no_op():
    c = Collector(CountingEnv, make_policy(), frames_per_batch=4, weight_sync_schemes={"policy": NoWeightSyncScheme()})
    try:
        c.update_policy_weights_(TensorDict({"module": {"w": torch.ones(1)}}))
        assert c.policy_version == 0 and next(iter(c))["action"].unique().tolist() == [0]
    finally:
        c.shutdown()


def test_real_weight_updater_subclass_single_and_multi():
    policy = make_policy()
    with torch.no_grad():
        policy.module.w.fill_(1.0)
    updater = CallBackUpdater()
    c = Collector(CountingEnv, make_policy(), frames_per_batch=4, weight_updater=updater)
    try:
        assert updater.collector is c
        c.update_policy_weights_(policy=policy)  # torchrl's mapping: the module's weights, doubled
        assert updater.synced == [None] and next(iter(c))["action"].unique().tolist() == [2]
    finally:
        c.shutdown()
    updater = CallBackUpdater(workers=[0, 1])
    m = MultiSyncCollector(CountingEnv, policy, num_workers=2, frames_per_batch=4, mp_start_method="forkserver",
                           weight_updater=updater, per_worker_weights=True)
    try:
        assert updater.collector is m
        m.update_policy_weights_()  # _get_server_weights: the main policy's weights (w=1), doubled
        assert updater.synced == [0, 1] and next(m)["action"].unique().tolist() == [2]
        assert m.worker_policy_versions() == [1, 2]  # one built-in update (one version) per worker
    finally:
        m.shutdown()
    with pytest.raises(ValueError, match="weight_sync_schemes or weight_updater, not both"):
        Collector(CountingEnv, make_policy(), frames_per_batch=4, weight_updater=CallBackUpdater(),
                  weight_sync_schemes={"policy": SharedMemWeightSyncScheme()})
