"""``rlcollect.AsyncBatchedCollector`` side by side with torchrl 0.14's ``AsyncBatchedCollector``
on the same seeded CartPole envs and policy (issue 28): the same batch layout (flat
``(frames_per_batch,)``, ``"env_index"``, ``"policy_version"``; keys, shapes, dtypes), frames per
batch and ``total_frames``, torchrl's config objects read, what ours cannot honour refused.

Runs in ``.venv-torchrl`` (``make test-torchrl``); skipped where torchrl is not installed.
"""

from __future__ import annotations


import pytest

pytest.importorskip("torchrl.collectors")

import torch  # noqa: E402
from torchrl import collectors as trc  # noqa: E402
from torchrl.modules.inference_server import InferenceDeviceConfig, InferenceServerConfig  # noqa: E402

import rlcollect  # noqa: E402

from helpers_torchrl import cartpole, zero_policy  # noqa: E402

pytestmark = pytest.mark.timeout(180)

#: The entries ours writes besides torchrl's: rlcollect's bookkeeping (trajectory ids, the worker,
#: the version again where our metrics read it) and the version that acted on each step.
OURS_ONLY = {("collector", "traj_ids"), ("collector", "worker_id"), ("collector", "policy_version"),
             ("next", "policy_version")}


def run(collector) -> list:
    try:
        return [None if batch is None else batch.clone() for batch in collector]
    finally:
        collector.shutdown()


def layout(batch) -> dict:
    return {key: (batch.get(key).shape, batch.get(key).dtype) for key in batch.keys(True, True)}


def test_same_layout_frames_and_total_frames_as_torchrl():
    kwargs = {"policy": zero_policy(), "frames_per_batch": 40, "total_frames": 100, "policy_version": 2}
    # torchrl's envs in threads (its default; seconds faster to start than its processes): the
    # layout does not depend on where the envs step.
    theirs = run(trc.AsyncBatchedCollector([cartpole] * 4, env_backend="threading", transport="driver", **kwargs))
    ours = run(rlcollect.AsyncBatchedCollector([cartpole] * 4, envs_per_worker=2, **kwargs))
    assert [b.batch_size for b in ours] == [b.batch_size for b in theirs] == [torch.Size([40])] * 2 + [
        torch.Size([20])]
    for mine, their in zip(ours, theirs):
        mine_layout, their_layout = layout(mine), layout(their)
        assert set(mine_layout) - set(their_layout) == OURS_ONLY
        assert {key: mine_layout[key] for key in their_layout} == their_layout
        assert (mine["action"] == 0).all()
        assert (mine["policy_version"] == 2).all() and (their["policy_version"] == 2).all()
        assert set(mine["env_index"].tolist()) <= {0, 1, 2, 3}
    # Both env pools step each env once per step of the others here: every env's frames come in order.
    for batch in ours:
        for env in batch["env_index"].unique():
            rows = batch[batch["env_index"] == env]
            assert torch.equal(rows["observation"][1:][~rows["next", "done"][:-1, 0]],
                               rows["next", "observation"][:-1][~rows["next", "done"][:-1, 0]])


def test_torchrl_config_objects_are_read():
    server = InferenceServerConfig(max_batch_size=8, min_batch_size=2, timeout=0.001)
    devices = InferenceDeviceConfig(policy_device="cpu", storing_device="cpu")
    from rlcollect.multiprocess.async_batched import async_batched_options

    opts = async_batched_options([cartpole] * 2, policy=zero_policy(), frames_per_batch=10, server_config=server,
                                 device_config=devices)
    cpu = torch.device("cpu")
    assert (opts["max_wait_us"], opts["policy_device"], opts["storing_device"]) == (1000.0, cpu, cpu)


@pytest.mark.parametrize("kwargs, message", [
    ({"server_config": InferenceServerConfig(service_backend="process")},
     "server_config.service_backend='process' is not supported; accepted: 'thread'"),
    ({"server_config": InferenceServerConfig(static_batch_size=64)}, "server_config.static_batch_size=64"),
    ({"worker_affinity": [[0]]}, "worker_affinity=[[0]] is not supported; accepted: None"),
    ({"backend": "ray"}, "backend='ray' is not supported"),
    ({"envs_per_worker": 3}, "envs_per_worker=3 is not supported; accepted: a divisor of len(create_env_fn)=2"),
])
def test_what_ours_cannot_honour_is_refused_before_anything_starts(kwargs, message):
    with pytest.raises(ValueError) as info:
        rlcollect.AsyncBatchedCollector([cartpole] * 2, policy=zero_policy(), frames_per_batch=10, **kwargs)
    assert message in str(info.value)


def test_torchrl_literal_defaults_are_accepted():
    from torchrl.envs.utils import ExplorationType

    collector = rlcollect.AsyncBatchedCollector(
        [cartpole], policy=zero_policy(), frames_per_batch=10, total_frames=10, max_batch_size=None,
        min_batch_size=None, server_timeout=None, transport=None, device=None, backend=None, env_backend=None,
        env_exchange="auto", envs_per_worker=1, transition_chunk_size="auto", policy_backend=None,
        exploration_type=ExplorationType.RANDOM, weight_sync=None, weight_sync_model_id="policy",
        create_env_kwargs=None, worker_affinity=None, driver_affinity=None, server_config=None,
        device_config=None, policy_version=0, policy_version_key="policy_version")
    batches = run(collector)
    assert [b.batch_size for b in batches] == [torch.Size([10])]
    assert isinstance(collector, trc.BaseCollector)


def test_postproc_hook_and_a_torchrl_replay_buffer_see_the_flat_batches():
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    buffer = ReplayBuffer(storage=LazyTensorStorage(100))
    seen = []
    collector = rlcollect.AsyncBatchedCollector(
        [cartpole] * 2, policy=zero_policy(), frames_per_batch=20, total_frames=50, envs_per_worker=2,
        postproc=lambda batch: batch.set("marked", torch.ones(batch.shape)),
        post_collect_hook=lambda batch: seen.append((batch.batch_size, "marked" in batch.keys())),
        replay_buffer=buffer)
    assert run(collector) == [None, None, None]
    assert seen == [(torch.Size([20]), True), (torch.Size([20]), True), (torch.Size([10]), True)]
    assert len(buffer) == 50 and buffer.sample(4)["env_index"].shape == torch.Size([4])


def test_completed_trajectories_as_torchrl_yields_them():
    kwargs = {"policy": zero_policy(), "frames_per_batch": 20, "total_frames": 30,
              "yield_completed_trajectories": True}
    theirs = run(trc.AsyncBatchedCollector([cartpole] * 2, env_backend="threading", transport="driver", **kwargs))
    ours = run(rlcollect.AsyncBatchedCollector([cartpole] * 2, **kwargs))
    for trajectories in (ours, theirs):
        assert sum(t.numel() for t in trajectories) >= 30
        assert sum(t.numel() for t in trajectories[:-1]) < 30  # stopped at the first past total_frames
        for t in trajectories:
            assert t.ndim == 1 and t["next", "done"][-1].all() and not t["next", "done"][:-1].any()
            assert t["env_index"].unique().numel() == 1
            assert torch.equal(t["observation"][1:], t["next", "observation"][:-1])
    their_layout = {key: (shape[1:], dtype) for key, (shape, dtype) in layout(theirs[0]).items()}
    mine_layout = {key: (shape[1:], dtype) for key, (shape, dtype) in layout(ours[0]).items()}
    assert {key: mine_layout[key] for key in their_layout} == their_layout
