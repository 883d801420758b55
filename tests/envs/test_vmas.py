"""VMAS collected as tensors end to end, without torchrl (rlcollect/envs/vmas.py)."""

from __future__ import annotations

import functools

import pytest
import torch

vmas = pytest.importorskip("vmas")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from rlcollect import Collector, MultiSyncCollector  # noqa: E402
from rlcollect.envs import VmasEnv  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def navigation(num_envs: int = 1024, max_steps: int = 4) -> VmasEnv:
    return VmasEnv(scenario="navigation", num_envs=num_envs, max_steps=max_steps, seed=0)


def test_thousand_instances_per_call_in_torchrls_grouped_layout():
    c = Collector(navigation(), frames_per_batch=1024 * 6, total_frames=1024 * 6)
    try:
        (batch,) = list(c)
    finally:
        c.shutdown()
    assert batch.batch_size == (1024, 6) and batch["agents"].batch_size == (1024, 6, 4)
    assert batch["agents", "observation"].shape == (1024, 6, 4, 18)
    assert batch["agents", "action"].shape == (1024, 6, 4, 2)
    assert batch["next", "agents", "reward"].shape == (1024, 6, 4, 1)
    # max_steps=4: every instance's episode ends at step 3, then all restart
    assert batch["next", "done"][..., 0].all(0).tolist() == [False, False, False, True, False, False]
    assert batch["collector", "traj_ids"][:3, :].tolist() == [[0] * 4 + [1024] * 2, [1] * 4 + [1025] * 2,
                                                             [2] * 4 + [1026] * 2]


def test_the_batch_is_what_stepping_vmas_by_hand_gives():
    c = Collector(navigation(64, max_steps=100), frames_per_batch=64 * 5)
    try:
        batch = next(iter(c))
    finally:
        c.shutdown()
    env = vmas.make_env("navigation", num_envs=64, max_steps=100, seed=0, terminated_truncated=True)
    obs = env.reset(seed=None)
    for t in range(5):
        assert torch.equal(batch["agents", "observation"][:, t], torch.stack(obs, 1))
        obs, rewards, *_ = env.step(list(batch["agents", "action"][:, t].unbind(1)))
        assert torch.equal(batch["next", "agents", "observation"][:, t], torch.stack(obs, 1))
        assert torch.equal(batch["next", "agents", "reward"][:, t, :, 0], torch.stack(rewards, 1))


class ObservationCopies(TorchDispatchMode):
    """Counts the ops outside VMAS that make or write an observation-sized tensor."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops, self.paused = numel, {}, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        target = args[0] if "copy_" in str(func) else out
        if not self.paused and isinstance(target, torch.Tensor) and target.numel() == self.numel:
            self.ops[str(func)] = self.ops.get(str(func), 0) + 1
        return out

    def outside(self, fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            self.paused = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.paused = False
        return call


def test_the_path_from_vmas_to_the_batch_copies_each_observation_three_times_and_never_through_numpy(monkeypatch):
    env = navigation(256, max_steps=100)
    c = Collector(env, frames_per_batch=256 * 10, return_same_td=True)  # (the batch is allocated once)
    try:
        next(iter(c))
        counter = ObservationCopies(256 * 4 * 18)
        for name in ("step", "reset", "reset_at"):  # (VMAS's own work is not the path's)
            monkeypatch.setattr(env.env, name, counter.outside(getattr(env.env, name)))

        def no_numpy(*args, **kwargs):
            raise AssertionError("a numpy round trip")

        monkeypatch.setattr(torch.Tensor, "numpy", no_numpy)
        monkeypatch.setattr(torch, "from_numpy", no_numpy)
        with counter:
            next(iter(c))
    finally:
        monkeypatch.undo()
        c.shutdown()
    # per step: the agents' observations stacked into one tensor (1), then written into the
    # batch as the step's ("agents", "observation") and ("next", "agents", "observation") (2);
    # select/view are views
    assert {k: v for k, v in counter.ops.items() if k not in ("aten.select.int", "aten.view.default")} == {
        "aten.stack.default": 10, "aten.copy_.default": 20}


@pytest.mark.processes
def test_multi_sync_collector_splits_the_instances_across_workers():
    make = functools.partial(navigation, 128)
    c = MultiSyncCollector([make, make], frames_per_batch=2 * 128 * 4, total_frames=2 * 128 * 4)
    try:
        (batch,) = list(c)
    finally:
        c.shutdown()
    assert batch.batch_size == (2, 128, 4) and batch["agents"].batch_size == (2, 128, 4, 4)
    assert bool(batch["next", "done"][:, :, 3].all())
