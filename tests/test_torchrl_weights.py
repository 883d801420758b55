"""torchrl's weight arguments and methods (issue 12 item 3), with torchrl's literal values and
duck-typed stand-ins for torchrl's objects (the real ones: tests/torchrl/test_torchrl_weights_real.py).

``TwoPart`` acts ``round(actor.w + 10 * extra.w)``: the action column shows which weights of
both sub-modules acted."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch
from tensordict import TensorDict

from rlcollect import Collector, CountingEnv, MultiAsyncCollector, MultiSyncCollector
from rlcollect.weights import MultiProcessWeightSyncScheme, NoWeightSyncScheme, SharedMemWeightSyncScheme
from rlcollect.weights.models import UnknownModelError, resolve_model, update_targets
from rlcollect.weights.schemes import DistributedWeightSyncScheme, validate_schemes

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers need not import this module
START = "forkserver"


class Scalar(torch.nn.Module):
    def __init__(self, w: float = 0.0):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([float(w)]))


class TwoPart(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.actor = Scalar()
        self.extra = Scalar()
        self.parts = torch.nn.ModuleList([Scalar(), Scalar()])

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return (observation[..., 0] * 0 + self.actor.w[0] + 10 * self.extra.w[0]).round().long()


def w(value: float) -> dict:
    return {"w": torch.tensor([float(value)])}


def actions(batch) -> list:
    return batch["action"].unique().tolist()


# -- model ids ------------------------------------------------------------------------------------------
def test_resolve_model_paths_as_torchrl_writes_them():
    class Holder:
        policy = TwoPart()
        table = {"k": Scalar(3.0)}

    h = Holder()
    assert resolve_model(h, "policy") is h.policy
    assert resolve_model(h, "policy.extra") is h.policy.extra
    assert resolve_model(h, "policy.parts[1]") is h.policy.parts[1]
    assert resolve_model(h, "table['k']") is h.table["k"]
    assert resolve_model(h, 'table["k"]') is h.table["k"]
    with pytest.raises(UnknownModelError, match="'policy.nothing' names nothing"):
        resolve_model(h, "policy.nothing")
    with pytest.raises(KeyError):  # torchrl raises KeyError for an unknown model
        resolve_model(h, "policy.parts[5]")
    with pytest.raises(ValueError, match="subscript"):
        resolve_model(h, "policy.parts[__import__('os')]")
    with pytest.raises(ValueError, match="non-empty attribute path"):
        resolve_model(h, "")


def test_update_targets_forms_and_conflicts():
    td = TensorDict({"w": torch.ones(1)})
    assert update_targets() == {"policy": None}
    assert update_targets(td)["policy"] is td
    assert update_targets(weights=td)["policy"] is td
    assert update_targets(policy=td, model_id="policy.extra") == {"policy.extra": td}
    assert update_targets(weights_dict={"policy": td, "value_net": None}) == {"policy": td, "value_net": None}
    for kwargs, message in [
        (dict(policy_or_weights=td, weights=td), "positionally or as weights="),
        (dict(weights=td, policy=td), "weights= or policy="),
        (dict(policy_or_weights=td, policy=td), "positionally or as policy="),
        (dict(weights_dict={"policy": td}, model_id="policy"), "model_id= or weights_dict="),
        (dict(weights_dict={"policy": td}, weights=td), "or weights_dict="),
        (dict(weights_dict={}), "non-empty dict"),
    ]:
        with pytest.raises(ValueError, match=message):
            update_targets(**kwargs)


# -- torchrl's scheme objects ------------------------------------------------------------------------------
def _torchrl_class(name: str) -> type:
    return type(name, (), {"__module__": "torchrl.weight_update._stand_in"})


@pytest.mark.parametrize("name, ours", [
    ("SharedMemWeightSyncScheme", SharedMemWeightSyncScheme),
    ("MultiProcessWeightSyncScheme", MultiProcessWeightSyncScheme),
    ("NoWeightSyncScheme", NoWeightSyncScheme),
    ("DistributedWeightSyncScheme", DistributedWeightSyncScheme),
])
def test_torchrl_scheme_objects_are_mapped(name, ours):
    schemes = validate_schemes({"policy": _torchrl_class(name)(), "policy.extra": _torchrl_class(name)()})
    assert [type(s) for s in schemes.values()] == [ours, ours]


def test_torchrl_scheme_subclass_is_mapped_and_unknown_torchrl_scheme_rejected():
    base = _torchrl_class("SharedMemWeightSyncScheme")
    sub = type("MyScheme", (base,), {"__module__": "torchrl.custom"})
    assert type(validate_schemes({"policy": sub()})["policy"]) is SharedMemWeightSyncScheme
    with pytest.raises(TypeError, match=r"weight_sync_schemes\['policy'\]: torchrl's RayWeightSyncScheme has no "
                                        r"counterpart here; accepted torchrl schemes: SharedMemWeightSyncScheme"):
        validate_schemes({"policy": _torchrl_class("RayWeightSyncScheme")()})
    with pytest.raises(TypeError, match="must be a WeightSyncScheme"):
        validate_schemes({"policy": object()})


# -- single-process Collector ----------------------------------------------------------------------------
def test_collector_several_models_one_version():
    policy = TwoPart()
    c = Collector(CountingEnv, policy, frames_per_batch=4,
                  weight_sync_schemes={"policy": SharedMemWeightSyncScheme(),
                                       "policy.extra": SharedMemWeightSyncScheme()})
    try:
        c.update_policy_weights_(weights_dict={"policy.extra": w(2)})
        assert c.policy_version == 1 and actions(next(iter(c))) == [20]
        c.update_policy_weights_(policy=Scalar(3.0), model_id="policy.extra")
        assert c.policy_version == 2 and actions(next(iter(c))) == [30]
        c.update_policy_weights_(weights=TensorDict(w(1)), model_id="policy.extra")
        assert c.get_model("policy.extra").w.item() == 1.0
        assert c.get_model("policy") is policy and c.get_cached_weights("policy") is None
        with pytest.raises(KeyError, match=r"model_id 'value_net' is not in weight_sync_schemes; registered: "
                                           r"\['policy', 'policy.extra'\]"):
            c.update_policy_weights_(w(1), model_id="value_net")
        assert c.policy_version == 3
    finally:
        c.shutdown()


def test_collector_model_id_must_name_a_module_at_construction():
    with pytest.raises(UnknownModelError, match="'policy.missing' names nothing"):
        Collector(CountingEnv, TwoPart(), frames_per_batch=4, weight_sync_schemes={"policy.missing": "shared"})


def test_collector_no_scheme_model_is_a_no_op():
    c = Collector(CountingEnv, TwoPart(), frames_per_batch=4,
                  weight_sync_schemes={"policy.extra": NoWeightSyncScheme()})
    try:
        c.update_policy_weights_(w(5), model_id="policy.extra")
        assert c.policy_version == 0 and c.get_model("policy.extra").w.item() == 0.0
    finally:
        c.shutdown()


# -- weight_updater ------------------------------------------------------------------------------------------
class DuckUpdater:
    """What torchrl's WeightUpdaterBase offers a collector: register_collector, collector, __call__."""

    def __init__(self):
        self.calls, self._collector = [], None

    def register_collector(self, collector):
        self._collector = collector

    @property
    def collector(self):
        return self._collector

    def __call__(self, policy_or_weights=None, worker_ids=None):
        self.calls.append((policy_or_weights, worker_ids))
        doubled = {k: v * 2 for k, v in policy_or_weights.items()}
        self.collector.update_policy_weights_(doubled, worker_ids=worker_ids)  # the built-in path


def test_collector_weight_updater_instance_constructor_and_function():
    updater = DuckUpdater()
    c = Collector(CountingEnv, Scalar_policy(), frames_per_batch=4, weight_updater=updater)
    try:
        assert c.weight_updater is updater and updater.collector is c
        c.update_policy_weights_(policy=w(2))
        assert updater.calls[0][1] is None and c.get_model("policy").w.item() == 4.0 and c.policy_version == 1
        with pytest.raises(ValueError, match="not supported with weight_updater"):
            c.update_policy_weights_(w(1), model_id="policy")
    finally:
        c.shutdown()
    c = Collector(CountingEnv, Scalar_policy(), frames_per_batch=4, weight_updater=DuckUpdater)  # a constructor
    try:
        assert isinstance(c.weight_updater, DuckUpdater) and c.weight_updater.collector is c
    finally:
        c.shutdown()
    seen = []
    c = Collector(CountingEnv, Scalar_policy(), frames_per_batch=4,
                  weight_updater=lambda policy_or_weights, worker_ids: seen.append(policy_or_weights))
    try:
        c.update_policy_weights_(w(7))
        assert seen[0]["w"].item() == 7.0 and c.policy_version == 0  # the function did not call back
    finally:
        c.shutdown()
    with pytest.raises(ValueError, match="weight_sync_schemes or weight_updater, not both"):
        Collector(CountingEnv, Scalar_policy(), frames_per_batch=4, weight_updater=DuckUpdater(),
                  weight_sync_schemes={"policy": "shared"})
    with pytest.raises(TypeError, match="weight_updater must be"):
        Collector(CountingEnv, Scalar_policy(), frames_per_batch=4, weight_updater=3)


class ScalarPolicy(Scalar):
    def forward(self, observation):
        return (observation[..., 0] * 0 + self.w[0]).round().long()


def Scalar_policy() -> ScalarPolicy:  # noqa: N802
    return ScalarPolicy()


# -- multi-process collectors ------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_multi_several_models_reach_the_workers(cls):
    policy = TwoPart()
    c = cls(CountingEnv, policy, num_workers=2, frames_per_batch=4, mp_start_method=START,
            weight_sync_schemes={"policy": SharedMemWeightSyncScheme(), "policy.extra": MultiProcessWeightSyncScheme()})
    try:
        c.update_policy_weights_(weights_dict={"policy": {"actor.w": torch.ones(1), "extra.w": torch.zeros(1),
                                                          "parts.0.w": torch.zeros(1), "parts.1.w": torch.zeros(1)}})
        c.update_policy_weights_(w(2), model_id="policy.extra")  # after: the pipe is read before the next batch
        seen = {tuple(actions(next(c))) for _ in range(4)}
        assert seen == {(21,)}
        assert c.worker_policy_versions() == [2, 2]
        assert c.get_model("policy") is policy and c.get_model("policy.parts[0]") is policy.parts[0]
        cached = c.get_cached_weights("policy")
        assert sorted(cached) == ["actor.w", "extra.w", "parts.0.w", "parts.1.w"] and cached["actor.w"].item() == 1.0
        assert c.get_cached_weights("policy.extra") is None
        with pytest.raises(KeyError, match="'value_net' is not in weight_sync_schemes"):
            c.update_policy_weights_(w(1), model_id="value_net")
    finally:
        c.shutdown()


def test_multi_extra_model_per_worker_ids():
    c = MultiSyncCollector(CountingEnv, TwoPart(), num_workers=2, frames_per_batch=4, mp_start_method=START,
                           weight_sync_schemes={"policy.extra": "process"})
    try:
        c.update_policy_weights_(w(3), model_id="policy.extra", worker_ids=[1])
        batch = next(c)
        per_worker = {i: actions(batch[i]) for i in (0, 1)}  # stacked: one row per worker
        assert per_worker == {0: [0], 1: [30]}
        assert c.worker_policy_versions() == [0, 1]
        with pytest.raises(ValueError, match=r"worker_ids must be indices in \[0, 2\), got \[2\]"):
            c.update_policy_weights_(w(3), model_id="policy.extra", worker_ids=2)
    finally:
        c.shutdown()


def test_multi_model_id_checked_in_the_workers_at_construction():
    with pytest.raises(Exception, match="'policy.missing' names nothing"):
        MultiSyncCollector(CountingEnv, TwoPart(), num_workers=1, frames_per_batch=4, mp_start_method=START,
                           weight_sync_schemes={"policy.missing": "process"})


def test_multi_weight_updater_calls_back_into_the_built_in_path():
    updater = DuckUpdater()
    c = MultiSyncCollector(CountingEnv, Scalar_policy(), num_workers=2, frames_per_batch=4, mp_start_method=START,
                           weight_updater=updater)
    try:
        assert updater.collector is c
        c.update_policy_weights_(weights=w(3))
        assert actions(next(c)) == [6] and c.worker_policy_versions() == [1, 1]
        with pytest.raises(ValueError, match="not supported with weight_updater"):
            c.update_policy_weights_(weights_dict={"policy": w(1)})
    finally:
        c.shutdown()
    with pytest.raises(ValueError, match="weight_sync_schemes or weight_updater, not both"):
        MultiSyncCollector(CountingEnv, Scalar_policy(), num_workers=1, frames_per_batch=4, mp_start_method=START,
                           weight_updater=DuckUpdater(), weight_sync_schemes={})


class WithLambda(ScalarPolicy):
    def __init__(self):
        super().__init__()
        self.fn = None

    def forward(self, observation):
        self.fn = lambda: None  # unpicklable by the pipe's pickler
        return super().forward(observation)


def test_unpicklable_getattr_policy_reply_is_an_error_not_a_dead_worker():
    # Regression: the worker died (PicklingError while sending) and the call raised WorkerError.
    c = MultiSyncCollector(CountingEnv, WithLambda(), num_workers=1, frames_per_batch=4, mp_start_method=START)
    try:
        next(c)
        with pytest.raises(TypeError, match="the reply to 'getattr_policy' \\(function\\) cannot be pickled back"):
            c.getattr_policy("fn")
        assert c.getattr_policy("training") is True and next(c).shape == (1, 4)
    finally:
        c.shutdown()
