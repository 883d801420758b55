"""torchrl's front door, ``Collector(..., backend=..., num_collectors=N, backend_options={...},
sync=...)`` (rlcollect/backends.py), for the backends that need no Ray (tests/ray has "ray")."""

from __future__ import annotations

import pytest

from rlcollect import Collector, DistributedCollector, MultiAsyncCollector, MultiSyncCollector
from rlcollect.backends import DirectCollector
from rlcollect.envs.testing import CountingEnv


def test_no_selector_builds_a_plain_collector():
    c = Collector(CountingEnv, frames_per_batch=10, total_frames=20)
    try:
        assert type(c) is Collector
    finally:
        c.shutdown()


@pytest.mark.parametrize("create_env_fn", [CountingEnv, [CountingEnv]], ids=["one", "list-of-one"])
def test_direct_is_a_collector_in_this_process(create_env_fn):
    c = Collector(create_env_fn, frames_per_batch=10, total_frames=20, backend="direct")
    try:
        assert isinstance(c, Collector) and type(c) is DirectCollector
        assert [b.shape for b in c] == [(10,), (10,)]
    finally:
        c.shutdown()


@pytest.mark.parametrize("sync, expected", [(None, MultiAsyncCollector), (False, MultiAsyncCollector),
                                            (True, MultiSyncCollector)])
def test_num_collectors_infers_process_and_async_by_default(sync, expected):
    c = Collector(CountingEnv, num_collectors=2, frames_per_batch=20, total_frames=40, sync=sync)
    try:
        assert type(c) is expected and c.num_workers == 2
        assert sum(b.numel() for b in c) == 40
    finally:
        c.shutdown()


def test_backend_options_are_merged():
    c = Collector([CountingEnv, CountingEnv], frames_per_batch=20, total_frames=40, backend="process", sync=True,
                  backend_options={"cat_results": 0})
    try:
        assert [b.shape for b in c] == [(20,), (20,)]
    finally:
        c.shutdown()


def test_distributed_builds_a_distributed_collector():
    c = Collector(CountingEnv, num_collectors=2, frames_per_batch=20, total_frames=40, backend="distributed",
                  sync=True)
    try:
        assert type(c) is DistributedCollector and c.num_nodes == 2 and c.config.launcher == "mp"
        assert [b.shape for b in c] == [(2, 10), (2, 10)]
    finally:
        c.shutdown()


@pytest.mark.parametrize("kwargs, error, message", [
    ({"backend": "rpc"}, ValueError, "backend must be one of ('direct', 'process', 'distributed', 'submitit', 'ray'), "
                                     "got 'rpc'"),
    ({"backend": "direct", "sync": True}, ValueError, "backend='direct' takes none"),
    ({"backend": "direct", "num_collectors": 2}, ValueError, "num_collectors must be 1 or None, got 2"),
    ({"backend": "direct", "backend_options": {"x": 1}}, ValueError, "backend='direct' got ['x']"),
    ({"num_collectors": 0}, ValueError, "num_collectors must be a positive int or None, got 0"),
    ({"num_collectors": True}, ValueError, "num_collectors must be a positive int or None, got True"),
    ({"backend": "process", "sync": "yes"}, TypeError, "sync must be True, False or None, got 'yes'"),
    ({"backend": "process", "backend_options": {"num_workers": 2}}, ValueError,
     "backend_options must not hold ['num_workers']"),
    ({"backend": "process", "backend_options": {"frames_per_batch": 5}}, ValueError,
     "backend_options repeat top-level arguments: ['frames_per_batch']"),
    ({"backend": "process", "backend_options": []}, TypeError, "backend_options must be a dict or None, got list"),
    ({"backend": "submitit", "backend_options": {"launcher": "mp"}}, ValueError,
     "backend='submitit' runs launcher='submitit', got launcher='mp'"),
])
def test_bad_selectors_name_argument_value_and_accepted(kwargs, error, message):
    with pytest.raises(error) as info:
        Collector(CountingEnv, frames_per_batch=10, **kwargs)
    assert message in str(info.value)


def test_num_collectors_must_match_an_env_list():
    with pytest.raises(ValueError, match="num_collectors=3 does not match the 2 env constructors"):
        Collector([CountingEnv, CountingEnv], frames_per_batch=10, num_collectors=3)


