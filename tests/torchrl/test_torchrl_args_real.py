"""torchrl's arguments, values and methods with real torchrl objects (issue 12 items 3 and 5):
torchrl's literal values give the same batches as torchrl's own ``Collector``; a torchrl
``PolicyVersion`` as ``track_policy_version``; state with a torchrl ``TransformedEnv``.

Runs in ``.venv-torchrl`` (``make test-torchrl``); skipped where torchrl is not installed.
"""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("torchrl.collectors")

import torch  # noqa: E402
from tensordict import TensorDictBase  # noqa: E402
from torchrl.collectors import Collector as TorchRLCollector  # noqa: E402
from torchrl.envs import Compose, ObservationNorm, RewardSum, StepCounter, TransformedEnv  # noqa: E402

from rlcollect import Collector  # noqa: E402

from helpers_torchrl import cartpole  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def transformed_cartpole() -> TransformedEnv:
    return TransformedEnv(cartpole(), Compose(
        StepCounter(max_steps=50), RewardSum(),
        ObservationNorm(loc=torch.zeros(4), scale=torch.full((4,), 2.0), in_keys=["observation"])))


class PushRight(torch.nn.Module):
    """A plain module taking the tensordict: torchrl uses it unwrapped."""

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        tensordict["action"] = (tensordict["observation"][..., 2] > 0).long()
        return tensordict


def test_forward_tensordict_module_and_torchrl_values_match_torchrls_collector():
    kwargs = dict(frames_per_batch=20, total_frames=-1, max_frames_per_traj=-1, init_random_frames=-1)
    env_theirs = cartpole()
    env_theirs.set_seed(3)
    theirs = TorchRLCollector(env_theirs, PushRight(), **kwargs)
    ours = Collector(cartpole(), PushRight(), **kwargs)
    ours.set_seed(3)  # seeds the env and resets it before the first batch, as torchrl's does
    try:
        a, b = ours.next(), theirs.next()
        for key in ("observation", "action", ("next", "observation"), ("next", "reward"), ("next", "done")):
            assert torch.equal(a[key].to(b[key].dtype), b[key]), key
    finally:
        ours.shutdown(timeout=None, close_env=True, raise_on_error=True)
        theirs.shutdown()


def test_torchrl_policy_version_object_is_incremented():
    from torchrl.envs.llm.transforms import PolicyVersion

    tracker = PolicyVersion(version_type="int")
    start = tracker.version
    with Collector(cartpole(), PushRight(), frames_per_batch=10, track_policy_version=tracker) as c:
        c.increment_version()
        batch = c.next()
        assert c.get_policy_version() == 1 == c.policy_version
        assert tracker.version == start + 1
        assert batch["collector", "policy_version"].unique().tolist() == [1]


def test_transformed_env_state_keeps_transforms_and_step_count():
    env = transformed_cartpole()
    env.set_seed(0)
    with Collector(env, PushRight(), frames_per_batch=5, total_frames=-1) as c:
        c.next()
        with pytest.warns(UserWarning, match="TransformedEnv does not expose its simulator's state"):
            state = c.state_dict()
        expected = c.next()
        norm = env.transform[2]
        norm.scale.fill_(7.0)  # the transform's state changes after the save ...
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once only
            c.state_dict()
        c.load_state_dict(state)  # ... and comes back with the load
        again = c.next()
    assert torch.equal(norm.scale, torch.full((4,), 2.0))
    # StepCounter's count comes back with the root tensordict
    assert again["step_count"].reshape(-1).tolist() == expected["step_count"].reshape(-1).tolist()
