"""The rest of torchrl 0.14's collector surface (issue 33's "Also" list), side by side with
torchrl 0.14.1's collectors where both can be built: public attributes (``worker_idx``,
``trajs_per_batch``, ``traj_format``, ``trajs_per_write``, ``DistributedCollector``'s),
``stats(workers=...)``, and what is refused with a clear error (``update_policy_weights_(
worker_ids=...)`` with the default shared-memory scheme, ``backend="nccl"``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrl.collectors")

import torch  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.collectors import Collector as TorchRLCollector  # noqa: E402
from torchrl.collectors import MultiSyncCollector as TorchRLMultiSync  # noqa: E402
from torchrl.data import LazyTensorStorage, ReplayBuffer  # noqa: E402

from rlcollect import Collector, DistributedCollector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402
from rlcollect.collector import SingleCollector  # noqa: E402

from helpers_torchrl import cartpole  # noqa: E402

pytestmark = pytest.mark.timeout(240)

TRAJ_ATTRIBUTES = ("worker_idx", "trajs_per_batch", "traj_format", "trajs_per_write")


class Constant(nn.Module):
    """Every action is ``a`` (a weight), so a batch shows which weights acted."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, observation):
        return self.a.long().expand(observation.shape[:-1]).clone()


def constant_policy() -> TensorDictModule:
    return TensorDictModule(Constant(), in_keys=["observation"], out_keys=["action"])


def attributes(cls, env_fn, **kwargs) -> dict:
    c = cls(env_fn, constant_policy(), frames_per_batch=20, total_frames=40, **kwargs)
    try:
        return {name: getattr(c, name) for name in TRAJ_ATTRIBUTES}
    finally:
        c.shutdown()


@pytest.mark.parametrize("kwargs", [{}, {"trajs_per_batch": 2, "traj_format": "cat", "trajs_per_write": 1},
                                    {"worker_idx": 3}, {"trajs_per_batch": 2}],
                         ids=["defaults", "trajs_per_batch", "worker_idx", "traj_format_None"])
def test_the_collectors_trajectory_and_worker_attributes_are_torchrls(kwargs):
    assert attributes(Collector, cartpole(), **kwargs) == attributes(TorchRLCollector, cartpole(), **kwargs)


@pytest.mark.parametrize("buffered", [False, True], ids=["batches", "replay_buffer"])
def test_the_multi_sync_collectors_trajectory_and_worker_attributes_are_torchrls(buffered):
    # (with a replay buffer torchrl hands trajs_per_batch to its workers and shows None here)
    def kwargs():
        rb = {"replay_buffer": ReplayBuffer(storage=LazyTensorStorage(100))} if buffered else {}
        return {"trajs_per_batch": 2, "traj_format": "padded", **rb}

    theirs = attributes(TorchRLMultiSync, [cartpole, cartpole], **kwargs())
    assert attributes(MultiSyncCollector, [cartpole, cartpole], **kwargs()) == theirs
    assert theirs["trajs_per_batch"] == (None if buffered else 2)


def per_worker_stats(cls) -> tuple[dict, dict]:
    c = cls([cartpole, cartpole], constant_policy(), frames_per_batch=20, total_frames=40)
    try:
        next(iter(c))
        with pytest.raises(ValueError, match="workers must be one of 'aggregate', 'per_worker' or 'both', got 'all'"):
            c.stats(workers="all")
        return c.stats(workers="per_worker"), c.stats(workers="both")
    finally:
        c.shutdown()


def test_stats_per_worker_gives_torchrls_keys():
    theirs, theirs_both = per_worker_stats(TorchRLMultiSync)
    ours, ours_both = per_worker_stats(MultiSyncCollector)
    assert ours.keys() == theirs.keys()
    assert {k: type(v) for k, v in ours.items()} == {k: type(v) for k, v in theirs.items()}
    # (torchrl's workers may be a batch ahead when asked: ours count what was delivered)
    assert ours == {"workers": 2, "workers_alive": 2, "worker_0/frames": 10, "worker_0/batches": 1,
                    "worker_0/requested_frames_per_batch": 10, "worker_1/frames": 10, "worker_1/batches": 1,
                    "worker_1/requested_frames_per_batch": 10}
    per_worker = {k for k in theirs_both if k.startswith("worker_")}
    assert per_worker == {k for k in ours_both if k.startswith("worker_")}
    assert len(ours_both["workers"]) == 2  # (ours, as in the aggregate view: a list of dicts)


def test_stats_per_worker_of_an_async_collector_with_versions():
    c = MultiAsyncCollector([cartpole, cartpole], constant_policy(), frames_per_batch=20, total_frames=60,
                            track_policy_version=True)
    try:
        batches = [b["collector", "worker_id"][0].item() for b in c]
        stats = c.stats(workers="per_worker")
    finally:
        c.shutdown()
    for i in range(2):
        assert stats[f"worker_{i}/batches"] == batches.count(i) == stats[f"worker_{i}/frames"] // 20
        assert stats[f"worker_{i}/policy_version"] == 0


def updated_actions(cls) -> list:
    """Each worker's actions after ``update_policy_weights_(worker_ids=[0])`` (the weights now
    act 1), or the error it raised."""
    policy = constant_policy()
    c = cls([cartpole, cartpole], policy, frames_per_batch=20, total_frames=200)
    try:
        it = iter(c)
        next(it)
        policy.module.a.data.fill_(1)
        try:
            c.update_policy_weights_(worker_ids=[0])
        except ValueError as err:
            return [str(err)]
        next(it)
        batch = next(it)
        return [batch[i]["action"].unique().tolist() for i in range(2)]
    finally:
        c.shutdown()


def test_worker_ids_with_the_default_shared_memory_scheme_is_refused_where_torchrl_updates_every_worker():
    # torchrl's default scheme shares one copy of the weights: updating worker 0 updates both
    assert updated_actions(TorchRLMultiSync) == [[1], [1]]
    assert updated_actions(MultiSyncCollector) == [
        "worker_ids needs per_worker_weights=True with shared-memory weights (one copy is shared)"]


def test_nccl_is_refused_before_any_node_starts():
    with pytest.raises(ValueError, match=r"backend.*'nccl'.*batches travel over gloo"):
        DistributedCollector([cartpole, cartpole], None, frames_per_batch=20, backend="nccl")


@pytest.mark.timeout(420)
def test_the_distributed_collector_has_torchrls_public_attributes():
    # what torchrl 0.14.1's DistributedCollector.__init__ sets from the same arguments
    # (torchrl/collectors/distributed/generic.py); its own cannot be built here without
    # submitit or a GPU-less nccl, so its values are written out
    def postproc(td):
        return td

    c = DistributedCollector([cartpole, cartpole], None, frames_per_batch=20, total_frames=40, launcher="mp",
                             collector_class="single", postproc=postproc, split_trajs=False, sync=True,
                             max_weight_update_interval=-1, timeout=240.0)
    try:
        assert c.num_workers == 2
        assert c.collector_class is SingleCollector
        assert (c.launcher, c.backend, c.update_after_each_batch, c.max_weight_update_interval) == ("mp", "gloo",
                                                                                                   False, -1)
        assert (c.num_workers_per_collector, c.split_trajs, c.postproc) == (1, False, postproc)
        assert c.tcp_port == str(c.master_port) and c.tcp_port.isdigit()
        assert c.policy_factory == [None, None] and c.collector_kwargs is None and c.slurm_kwargs is None
    finally:
        c.shutdown()
