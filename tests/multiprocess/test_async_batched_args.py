"""``AsyncBatchedCollector``'s torchrl arguments mapped onto ``MultiAsyncCollector(...,
inference="central")``, the refusals, and the flat torchrl layout of its batches; no process is
started (the collector itself is compared with torchrl's in tests/torchrl/test_torchrl_async_batched.py)."""

from __future__ import annotations

import types

import pytest
import torch
from tensordict import TensorDict

import rlcollect
from rlcollect.multiprocess.async_batched import EnvGroup, FlatTransitions, Trajectories, async_batched_options

pytestmark = pytest.mark.timeout(60)


def act(observation):
    return observation.sum(-1) > 0


def options(**kwargs):
    return async_batched_options(**{"create_env_fn": ["CartPole-v1"] * 4, "policy": act, "frames_per_batch": 40,
                                    **kwargs})


def test_defaults_map_to_one_env_per_worker_and_central_inference():
    opts = options()
    assert len(opts["create_env_fn"]) == 4 and opts["env_splits"] == 1
    assert (opts["inference"], opts["max_wait_us"], opts["policy_device"]) == ("central", 0.0, None)
    assert (opts["total_frames"], opts["track_policy_version"], opts["policy_version"]) == (-1, True, 0)
    assert opts["policy"] is act


def test_arguments_that_map():
    opts = options(envs_per_worker=2, total_frames=100, min_batch_size=2, server_timeout=0.002, device="cpu",
                   policy_version_key=None, create_env_kwargs=[{"max_episode_steps": i + 5} for i in range(4)],
                   backend="multiprocessing", env_exchange="shm", transport="auto", transition_chunk_size=64,
                   max_batch_size=4, policy=None, policy_factory=lambda: act, policy_version=3, verbose=True)
    assert (len(opts["create_env_fn"]), opts["env_splits"], opts["max_wait_us"]) == (2, 2, 2000.0)
    assert (opts["policy_device"], opts["track_policy_version"], opts["policy_version"]) == ("cpu", False, 3)
    assert opts["total_frames"] == 120  # whole batches; the last is cut to 100 where it is delivered
    assert opts["policy"] is act
    assert [group.kwargs for group in opts["create_env_fn"]] == [[{"max_episode_steps": 5}, {"max_episode_steps": 6}],
                                                                 [{"max_episode_steps": 7}, {"max_episode_steps": 8}]]


def test_server_and_device_configs_are_read_by_field_name():
    server = types.SimpleNamespace(service_backend="thread", max_batch_size=64, static_batch_size=None,
                                   min_batch_size=3, timeout=0.005, max_inflight_per_env=None)
    devices = types.SimpleNamespace(policy_device="cpu", output_device=None, env_device="cpu", storing_device="cpu")
    opts = options(server_config=server, device_config=devices)
    assert opts["max_wait_us"] == 5000.0
    assert (opts["policy_device"], opts["env_device"], opts["storing_device"]) == ("cpu", "cpu", "cpu")


@pytest.mark.parametrize("kwargs, message", [
    ({"create_env_fn": "CartPole-v1"}, "create_env_fn must be a non-empty list"),
    ({"policy": None}, "exactly one of policy and policy_factory"),
    ({"policy_factory": lambda: act}, "exactly one of policy and policy_factory"),
    ({"envs_per_worker": 3}, "envs_per_worker=3 is not supported; accepted: a divisor of len(create_env_fn)=4"),
    ({"envs_per_worker": 0}, "envs_per_worker must be a positive int, got 0"),
    ({"envs_per_worker": 2, "frames_per_batch": 41}, "frames_per_batch=41 is not supported; accepted: a multiple"),
    ({"backend": "ray"}, "backend='ray' is not supported; accepted: None, 'threading' or 'multiprocessing'"),
    ({"policy_backend": "monarch"}, "policy_backend='monarch' is not supported"),
    ({"env_exchange": "pipe"}, "env_exchange='pipe' is not supported"),
    ({"transport": object()}, "transport=<object object"),
    ({"transition_chunk_size": 0}, "transition_chunk_size must be a positive int, got 0"),
    ({"yield_completed_trajectories": 1}, "yield_completed_trajectories must be True or False, got 1"),
    ({"weight_sync": "scheme"}, "weight_sync='scheme' is not supported; accepted: None"),
    ({"worker_affinity": [[0]]}, "worker_affinity=[[0]] is not supported; accepted: None"),
    ({"driver_affinity": [0]}, "driver_affinity=[0] is not supported; accepted: None"),
    ({"policy_version_key": "version"}, "policy_version_key='version' is not supported"),
    ({"policy_version": -1}, "policy_version must be an int >= 0, got -1"),
    ({"max_batch_size": 2}, "max_batch_size=2 is not supported; accepted: None or at least len(create_env_fn)=4"),
    ({"min_batch_size": 0}, "min_batch_size must be a positive int, got 0"),
    ({"server_timeout": -1.0}, "server_timeout must be a number of seconds >= 0, got -1.0"),
    ({"server_config": types.SimpleNamespace(service_backend="process")},
     "server_config.service_backend='process' is not supported; accepted: 'thread'"),
    ({"server_config": types.SimpleNamespace(static_batch_size=8)},
     "server_config.static_batch_size=8 is not supported"),
    ({"server_config": types.SimpleNamespace(), "max_batch_size": 8}, "server_config is mutually exclusive"),
    ({"device_config": types.SimpleNamespace(), "device": "cpu"}, "device and device_config are mutually exclusive"),
    ({"device_config": types.SimpleNamespace(output_device="cuda:0")}, "device_config.output_device='cuda:0'"),
    ({"create_env_kwargs": [{}]}, "create_env_kwargs must be None, a dict or a list of 4 dicts"),
])
def test_refused_arguments_name_the_argument_value_and_what_is_accepted(kwargs, message):
    with pytest.raises((TypeError, ValueError)) as info:
        options(**kwargs)
    assert message in str(info.value)


def test_the_collector_refuses_before_starting_anything():
    with pytest.raises(ValueError, match="weight_sync='scheme' is not supported"):
        rlcollect.AsyncBatchedCollector(["CartPole-v1"], policy=act, frames_per_batch=10, weight_sync="scheme")


def test_env_group_builds_its_envs_in_turn_and_each_worker_starts_at_the_first():
    import cloudpickle

    group = EnvGroup([lambda **kw: ("a", kw), lambda **kw: ("b", kw)], [{"x": 1}, {"x": 2}])
    assert [group(), group(), group(y=0)] == [("a", {"x": 1}), ("b", {"x": 2}), ("a", {"x": 1, "y": 0})]
    assert cloudpickle.loads(cloudpickle.dumps(group))()[0] == "a"


def test_flat_transitions_are_in_step_order_with_env_index_and_cut_at_total_frames():
    steps = torch.arange(5).expand(2, 5)
    batch = TensorDict({"step": steps, "row": torch.arange(2)[:, None].expand(2, 5),
                        ("collector", "worker_id"): torch.ones(2, 5, dtype=torch.int64)}, batch_size=[2, 5])
    flat = FlatTransitions(16, postproc=None)
    first = flat(batch)
    assert first.batch_size == torch.Size([10])
    assert first["step"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert first["env_index"].tolist() == [2, 3] * 5  # worker 1's envs are 2 and 3 of create_env_fn
    second = flat(batch)
    assert second["step"].tolist() == [0, 0, 1, 1, 2, 2] and flat.delivered == 16
    one_env = FlatTransitions(-1, postproc=None)(batch[0])  # one unbatched env per worker: (T,)
    assert one_env["env_index"].tolist() == [1] * 5 and one_env["step"].tolist() == [0, 1, 2, 3, 4]
    versions = batch.clone().set("policy_version", torch.zeros(2, 5, dtype=torch.int64))
    versions.set(("next", "policy_version"), torch.full((2, 5), 3))
    assert FlatTransitions(-1, postproc=None)(versions)["policy_version"].tolist() == [3] * 10  # the acting one
    marked = FlatTransitions(-1, postproc=lambda b: b.set("seen", torch.ones(b.shape)))(batch)
    assert marked["seen"].shape == torch.Size([10])


def test_trajectories_are_cut_where_they_end_in_the_order_they_end_and_carried_over():
    def flat(env_index, done, step):
        n = len(env_index)
        return TensorDict({"env_index": torch.tensor(env_index), "step": torch.tensor(step),
                           ("next", "done"): torch.tensor(done)[:, None]}, batch_size=[n])

    cut = Trajectories(total_frames=6, postproc=None, hook=None, replay_buffer=None)
    first = cut.cut(flat([0, 1, 0, 1], [False, True, False, False], [0, 0, 1, 1]))
    assert [t["step"].tolist() for t in first] == [[0]]  # env 1's first trajectory; env 0's waits
    second = cut.cut(flat([0, 1, 0, 1], [False, True, True, False], [2, 2, 3, 3]))
    assert [(t["env_index"][0].item(), t["step"].tolist()) for t in second] == [(1, [1, 2]), (0, [0, 1, 2, 3])]
    for trajectory in first + second:
        cut.deliver(trajectory)
    assert cut.delivered == 7 and cut.done()


def test_yield_completed_trajectories_takes_over_postproc_hook_buffer_and_total_frames():
    opts = options(yield_completed_trajectories=True, total_frames=100, postproc=print, replay_buffer=[])
    assert (opts["total_frames"], opts["postproc"].postproc, opts["replay_buffer"]) == (-1, None, None)
    trajectories = opts["trajectories"]
    assert (trajectories.total_frames, trajectories.postproc, trajectories.replay_buffer) == (100, print, [])
