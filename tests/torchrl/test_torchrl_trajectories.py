"""``trajs_per_batch`` / ``traj_format`` / ``trajs_per_write`` side by side with torchrl 0.14's own
``Collector`` on the same seeded env and policy (issue 28): the same trajectories, in the same
order, with the same shapes, masks and values; with a replay buffer, the same frames written.

Runs in ``.venv-torchrl`` (``make test-torchrl``); skipped where torchrl is not installed.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("torchrl.collectors")

import torch  # noqa: E402
from tensordict.nn import TensorDictModule  # noqa: E402
from torch import nn  # noqa: E402
from torchrl import collectors as trc  # noqa: E402
from torchrl.data import LazyTensorStorage  # noqa: E402
from torchrl.data import ReplayBuffer as TorchRLReplayBuffer  # noqa: E402
from torchrl.envs import GymEnv  # noqa: E402

import rlcollect  # noqa: E402

pytestmark = pytest.mark.timeout(180)
KEYS = ["observation", "action", ("next", "observation"), ("next", "reward"), ("next", "done"),
        ("next", "terminated"), ("collector", "traj_ids")]


class Lean(nn.Module):
    """Pushes the cart the way the pole leans: episodes of varied length, some past a batch."""

    def forward(self, observation):
        return (observation[..., 2] > 0.05).long()


def make(cls, **kwargs):
    env = GymEnv("CartPole-v1", categorical_action_encoding=True)
    if cls is trc.Collector:
        env.set_seed(0)
    policy = TensorDictModule(Lean(), in_keys=["observation"], out_keys=["action"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torchrl's note on traj_format's default
        collector = cls(env, policy, frames_per_batch=7, total_frames=280, **kwargs)
    if cls is not trc.Collector:
        collector.set_seed(0)  # seeds the env and resets it before the first batch, as torchrl's does
    return collector


def batches(collector):
    out = [b.clone() if b is not None else None for b in collector]
    collector.shutdown()
    return out


@pytest.mark.parametrize("traj_format", [None, "padded", "cat"])
def test_trajectory_batches_equal_torchrls(traj_format):
    theirs = batches(make(trc.Collector, trajs_per_batch=3, traj_format=traj_format))
    ours = batches(make(rlcollect.Collector, trajs_per_batch=3, traj_format=traj_format))
    assert len(ours) == len(theirs) >= 2
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        keys = KEYS + ([("collector", "mask")] if traj_format != "cat" else [])
        for key in keys:
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("per_write", [None, 2])
def test_a_replay_buffer_gets_the_same_whole_trajectories_as_torchrls(per_write):
    stored = {}
    for name, cls in (("torchrl", trc.Collector), ("ours", rlcollect.Collector)):
        rb = TorchRLReplayBuffer(storage=LazyTensorStorage(1000))
        yielded = batches(make(cls, trajs_per_batch=3, replay_buffer=rb, trajs_per_write=per_write))
        assert set(map(type, yielded)) == {type(None)}
        stored[name] = (len(yielded), rb[: len(rb)])
    (n_ours, ours), (n_theirs, theirs) = stored["ours"], stored["torchrl"]
    assert n_ours == n_theirs and ours.shape == theirs.shape and ours.shape[0] > 0
    for key in KEYS:
        assert torch.equal(ours[key], theirs[key]), key
