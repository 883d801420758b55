"""torchrl's device arguments (issue 12 item 3): ``env_device`` honoured, the policy acting on
``policy_device`` in each worker, per-worker ``storing_device`` lists. CPU paths always; CUDA
paths where a GPU is present (``-m gpu``)."""

from __future__ import annotations

import sys
import os

import cloudpickle
import pytest
import torch
from mp_helpers import START, ValuePolicy, weights

from rlcollect import Collector, CountingEnv, MultiAsyncCollector, MultiSyncCollector

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from helpers_torchrl_env import DuckCountingEnv  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class MovableEnv(DuckCountingEnv):
    """A TensorDict env that records ``to()`` (and claims another device until moved)."""

    def __init__(self, claimed: str = "cuda"):
        super().__init__()
        self.device = torch.device(claimed)
        self.moved_to: list[torch.device] = []

    def to(self, device):
        self.moved_to.append(torch.device(device))
        self.device = torch.device(device)
        return self


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_env_device_moves_a_tensordict_env(device):
    env = MovableEnv()
    c = Collector(env, None, frames_per_batch=4, env_device=device)
    try:
        assert env.moved_to == [torch.device("cpu")] and c.env.device == torch.device("cpu")
        assert next(iter(c)).shape == (4,)
    finally:
        c.shutdown()


def test_env_device_already_there_is_not_moved():
    env = MovableEnv("cpu")
    c = Collector(env, None, frames_per_batch=4, env_device="cpu")
    try:
        assert env.moved_to == []
    finally:
        c.shutdown()


def test_env_device_off_cpu_rejected_for_a_numpy_env():
    with pytest.raises(ValueError, match=r"env_device='cuda': CountingEnv steps in numpy on the CPU, so env_device "
                                         r"can only be 'cpu' for it"):
        Collector(CountingEnv, None, frames_per_batch=4, env_device="cuda")
    c = Collector(CountingEnv, None, frames_per_batch=4, env_device=torch.device("cpu"))
    c.shutdown()


@pytest.mark.parametrize("name", ["device", "storing_device", "env_device", "policy_device"])
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_per_worker_device_list_of_wrong_length_rejected(cls, name):
    with pytest.raises(ValueError, match=f"{name} is a per-worker list of length 3, but there are 2 workers"):
        cls(CountingEnv, None, num_workers=2, frames_per_batch=4, **{name: ["cpu"] * 3})


def test_sync_rejects_different_storing_devices():
    with pytest.raises(ValueError, match=r"storing_device: MultiSyncCollector joins the workers' batches into one, "
                                         r"so every worker must store on the same device; got \['cpu', 'cuda'\]"):
        MultiSyncCollector(CountingEnv, None, num_workers=2, frames_per_batch=4, storing_device=["cpu", "cuda"])


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_cpu_device_lists_strings_and_device_objects(cls):
    c = cls(CountingEnv, ValuePolicy(), num_workers=2, frames_per_batch=4, mp_start_method=START,
            policy_device=["cpu", torch.device("cpu")], storing_device=[torch.device("cpu"), "cpu"],
            env_device="cpu")
    try:
        c.update_policy_weights_(weights(2))
        batch = next(c)
        assert batch.device in (None, torch.device("cpu")) and batch["action"].unique().tolist() == [2]
    finally:
        c.shutdown()


def test_single_collector_policy_on_its_device_is_used_as_is():
    policy = ValuePolicy()
    c = Collector(CountingEnv, policy, frames_per_batch=4, policy_device="cpu")
    try:
        assert c.get_model("policy") is policy
    finally:
        c.shutdown()


# -- CUDA -----------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
def test_single_collector_moves_a_copy_to_policy_device():
    policy = ValuePolicy()
    c = Collector(CountingEnv, policy, frames_per_batch=4, policy_device="cuda")
    try:
        acting = c.get_model("policy")
        assert acting is not policy and acting.w.device.type == "cuda" and policy.w.device.type == "cpu"
        with torch.no_grad():
            policy.w.fill_(3.0)
        c.update_policy_weights_()  # copies from the user's module
        assert acting.w.item() == 3.0 and next(iter(c))["action"].unique().tolist() == [3]
    finally:
        c.shutdown()


def _worker_policy_device(policy):
    return str(policy.w.device)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_workers_act_on_policy_device_and_store_per_worker(cls):
    storing = ["cuda:0", "cuda:0"] if cls is MultiSyncCollector else ["cpu", "cuda:0"]
    c = cls(CountingEnv, ValuePolicy(), num_workers=2, frames_per_batch=4, mp_start_method=START,
            policy_device=["cuda:0", "cpu"], storing_device=storing)
    try:
        assert str(c.getattr_policy("w").device) == "cuda:0"
        c.update_policy_weights_(weights(4))
        devices = set()
        for _ in range(4):
            batch = next(c)
            assert batch["action"].unique().tolist() == [4]
            devices.add(str(batch["action"].device))
        assert devices == set(storing)
    finally:
        c.shutdown()
