"""Weight synchronisation with worker processes (SPEC 6): the shared-memory default, weights
through the pipe, no-op updates, per-worker weights, buffers, and what is refused.

``ValuePolicy`` acts ``round(w + 100 * b)``, so a batch's action column shows which weights
acted (``w`` a parameter, ``b`` a buffer)."""

from __future__ import annotations

import pytest
import torch
from mp_helpers import (
    POLICY_VERSION,
    START,
    ValuePolicy,
    counting5,
    make_multi,  # noqa: F401  (fixture)
    make_value_policy,
    weights,
)
from tensordict import TensorDict

from rlcollect import (
    DistributedWeightSyncScheme,
    MultiAsyncCollector,
    MultiProcessWeightSyncScheme,
    MultiSyncCollector,
    NoWeightSyncScheme,
    SharedMemWeightSyncScheme,
    WeightSyncScheme,
)

pytestmark = pytest.mark.timeout(90)


def actions(batch) -> list[int]:
    """The action each worker took (every frame of a worker's share must agree)."""
    out = []
    for w in range(batch.shape[0]):
        acts = batch[w]["action"]
        assert (acts == acts.flatten()[0]).all(), acts
        out.append(int(acts.flatten()[0]))
    return out


def versions(batch) -> list[int]:
    out = []
    for w in range(batch.shape[0]):
        v = batch[w][POLICY_VERSION]
        assert (v == v.flatten()[0]).all(), v
        out.append(int(v.flatten()[0]))
    return out


def sync_collector(make_multi, policy, **kwargs):
    return make_multi(MultiSyncCollector, counting5, policy, num_workers=2, frames_per_batch=4,
                      track_policy_version=True, **kwargs)


def test_from_backend_names():
    assert type(WeightSyncScheme.from_backend("shared")) is SharedMemWeightSyncScheme
    assert type(WeightSyncScheme.from_backend("process")) is MultiProcessWeightSyncScheme
    assert type(WeightSyncScheme.from_backend("distributed")) is DistributedWeightSyncScheme
    assert type(WeightSyncScheme.from_backend("none")) is NoWeightSyncScheme
    with pytest.raises(ValueError, match="'bogus'") as info:
        WeightSyncScheme.from_backend("bogus")
    for name in ("shared", "process", "distributed", "none"):
        assert name in str(info.value)


def test_shared_memory_default_updates_params_and_buffers_and_ignores_unpushed_edits(make_multi):
    policy = ValuePolicy()
    collector = sync_collector(make_multi, policy)
    assert actions(next(collector)) == [0, 0]
    # Editing the main policy changes nothing in the workers until it is pushed.
    with torch.no_grad():
        policy.w.fill_(7.0)
        policy.b.fill_(1.0)
    batch = next(collector)
    assert actions(batch) == [0, 0] and versions(batch) == [0, 0]
    collector.update_policy_weights_()  # from the main policy: w=7, b=1
    batch = next(collector)
    assert actions(batch) == [107, 107] and versions(batch) == [1, 1]
    # Buffers travel: only b changes here.
    collector.update_policy_weights_(weights(7, 2))
    assert actions(next(collector)) == [207, 207]
    # An nn.Module and a TensorDict of parameters are accepted too.
    collector.update_policy_weights_(ValuePolicy(w=3))
    assert actions(next(collector)) == [3, 3]
    collector.update_policy_weights_(TensorDict.from_module(ValuePolicy(w=4, b=1)))
    batch = next(collector)
    assert actions(batch) == [104, 104] and versions(batch) == [4, 4]
    assert collector.worker_policy_versions() == [4, 4]
    # One shared copy: updating only some workers needs per_worker_weights=True.
    with pytest.raises(ValueError, match="per_worker_weights"):
        collector.update_policy_weights_(weights(1), worker_ids=[1])
    with pytest.raises(ValueError, match="per_worker_weights"):
        collector.update_policy_weights_({0: weights(1)})
    assert actions(next(collector)) == [104, 104]


def test_per_worker_weights(make_multi):
    collector = sync_collector(make_multi, ValuePolicy(), per_worker_weights=True)
    collector.update_policy_weights_({0: weights(1)})
    batch = next(collector)
    assert actions(batch) == [1, 0] and versions(batch) == [1, 0]
    assert collector.worker_policy_versions() == [1, 0]
    collector.update_policy_weights_({0: weights(2), 1: weights(3)})
    batch = next(collector)
    assert actions(batch) == [2, 3] and versions(batch) == [2, 2]
    collector.update_policy_weights_(weights(9), worker_ids=[1])
    batch = next(collector)
    assert actions(batch) == [2, 9] and versions(batch) == [2, 3]
    with pytest.raises(ValueError, match="worker_ids"):
        collector.update_policy_weights_(weights(9), worker_ids=[2])
    with pytest.raises(ValueError, match=r"\[2\]"):
        collector.update_policy_weights_({2: weights(9)})
    assert actions(next(collector)) == [2, 9]


@pytest.mark.parametrize("scheme", ["shared", "process"])
def test_weights_that_do_not_fit_are_refused_and_the_collector_goes_on(make_multi, scheme):
    collector = make_multi(MultiSyncCollector, counting5, ValuePolicy(), num_workers=2, frames_per_batch=4,
                           worker_timeout=20, weight_sync_schemes={"policy": scheme})
    with pytest.raises(RuntimeError, match="size mismatch"):
        collector.update_policy_weights_({"w": torch.zeros(2), "b": torch.zeros(1)})
    with pytest.raises((KeyError, RuntimeError), match="unexpected"):
        collector.update_policy_weights_({"w": torch.zeros(1), "b": torch.zeros(1), "extra": torch.zeros(1)})
    assert actions(next(collector)) == [0, 0]  # no worker was left waiting on half-written weights
    collector.update_policy_weights_(weights(3))
    assert actions(next(collector)) == [3, 3]


@pytest.mark.parametrize("scheme", [MultiProcessWeightSyncScheme(), "process"], ids=["instance", "name"])
def test_weights_through_the_pipe(make_multi, scheme):
    policy = ValuePolicy()
    collector = sync_collector(make_multi, policy, weight_sync_schemes={"policy": scheme})
    assert actions(next(collector)) == [0, 0]
    collector.update_policy_weights_(weights(2, 1))
    batch = next(collector)
    assert actions(batch) == [102, 102] and versions(batch) == [1, 1]
    collector.update_policy_weights_(weights(5), worker_ids=[1])
    batch = next(collector)
    assert actions(batch) == [102, 5] and versions(batch) == [1, 2]
    with torch.no_grad():
        policy.w.fill_(6.0)
    assert actions(next(collector)) == [102, 5]
    collector.update_policy_weights_()
    assert actions(next(collector)) == [6, 6]


def test_no_weight_sync_scheme_makes_updates_no_ops(make_multi):
    collector = sync_collector(make_multi, ValuePolicy(w=1), weight_sync_schemes={"policy": NoWeightSyncScheme()})
    collector.update_policy_weights_(weights(8))
    collector.update_policy_weights_()
    batch = next(collector)
    assert actions(batch) == [1, 1] and versions(batch) == [0, 0]
    assert collector.worker_policy_versions() == [0, 0]


def test_async_shared_weights_per_worker(make_multi):
    collector = make_multi(MultiAsyncCollector, counting5, ValuePolicy(), num_workers=2, frames_per_batch=2,
                           per_worker_weights=True, track_policy_version=True)
    next(collector)
    collector.update_policy_weights_({1: weights(4)})
    seen = {0: set(), 1: set()}
    for _ in range(12):
        batch = next(collector)
        seen[int(batch["collector", "worker_id"][0])].add(int(batch["action"][0]))
    assert seen[0] == {0}
    assert 4 in seen[1]


def test_policy_factory_with_a_scheme_takes_the_main_policys_weights(make_multi):
    main = ValuePolicy(w=2)
    collector = make_multi(MultiSyncCollector, counting5, main, policy_factory=make_value_policy, num_workers=2,
                           frames_per_batch=4, track_policy_version=True,
                           weight_sync_schemes={"policy": SharedMemWeightSyncScheme()})
    next(collector)
    with torch.no_grad():
        main.w.fill_(6.0)
    collector.update_policy_weights_()
    batch = next(collector)
    assert actions(batch) == [6, 6] and versions(batch) == [1, 1]


def test_policy_with_policy_factory_and_no_scheme_is_refused():
    with pytest.raises(ValueError, match="policy_factory"):
        MultiSyncCollector(counting5, ValuePolicy(), policy_factory=make_value_policy, num_workers=2,
                           frames_per_batch=4, mp_start_method=START)


def test_unknown_scheme_name_is_refused():
    with pytest.raises(ValueError, match="bogus"):
        MultiSyncCollector(counting5, ValuePolicy(), num_workers=2, frames_per_batch=4,
                           weight_sync_schemes={"policy": "bogus"}, mp_start_method=START)


def test_update_with_a_random_policy_raises(make_multi):
    collector = make_multi(MultiSyncCollector, counting5, None, num_workers=1, frames_per_batch=4)
    with pytest.raises(RuntimeError, match="no parameters"):
        collector.update_policy_weights_()
    with pytest.raises(RuntimeError, match="no parameters"):
        collector.update_policy_weights_(weights(1))
    assert next(collector).shape == torch.Size([1, 4])  # still usable
