"""Real torchrl objects in the collectors test_torchrl_interop.py does not cover:
``MultiAsyncCollector`` and ``DistributedCollector`` with torchrl envs and policies, and weight
updates of an ``LSTMModule`` policy reaching the workers.

Runs in ``.venv-torchrl`` (``make test-torchrl``); skipped where torchrl is not installed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrl.collectors")

import torch  # noqa: E402
from tensordict.nn import TensorDictModule, TensorDictSequential  # noqa: E402
from torch import nn  # noqa: E402
from torchrl.collectors import Collector as TorchRLCollector  # noqa: E402
from torchrl.envs import (  # noqa: E402
    Compose,
    InitTracker,
    RewardSum,
    StepCounter,
    TransformedEnv,
)
from torchrl.modules import LSTMModule  # noqa: E402

from rlcollect import DistributedCollector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402

from helpers_torchrl import Argmax, actor, cartpole, leaves, our_leaves  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def transformed_cartpole() -> TransformedEnv:
    return TransformedEnv(cartpole(), Compose(StepCounter(max_steps=50), RewardSum()))


def lstm_policy() -> TensorDictSequential:
    torch.manual_seed(0)
    lstm = LSTMModule(input_size=4, hidden_size=8, in_key="observation", out_key="embed")
    head = TensorDictModule(nn.Linear(8, 2), in_keys=["embed"], out_keys=["logits"])
    return TensorDictSequential(lstm, head, TensorDictModule(Argmax(), in_keys=["logits"], out_keys=["action"]))


def lstm_env() -> TransformedEnv:
    env = TransformedEnv(cartpole(), Compose(InitTracker(), StepCounter()))
    env.append_transform(lstm_policy()[0].make_tensordict_primer())
    return env


def torchrl_layout(env_fn, policy_fn, frames: int) -> dict:
    env = env_fn()
    c = TorchRLCollector(env, policy_fn(), frames_per_batch=frames, total_frames=frames)
    try:
        return leaves(next(iter(c)))
    finally:
        c.shutdown()
        if not env.is_closed:
            env.close()


@pytest.mark.parametrize("env_fn", [cartpole, transformed_cartpole], ids=["GymEnv", "TransformedEnv"])
def test_multiasync_with_torchrl_env_and_actor_has_torchrls_layout(env_fn):
    theirs = torchrl_layout(env_fn, actor, frames=50)
    c = MultiAsyncCollector([env_fn, env_fn], actor(), frames_per_batch=50, total_frames=200)
    try:
        batches = [b.clone() for b in c]
    finally:
        c.shutdown()
    assert len(batches) == 4
    for batch in batches:
        assert batch.shape == (50,)
        assert our_leaves(batch) == theirs


def test_lstm_carry_in_multiasync_workers():
    c = MultiAsyncCollector([lstm_env, lstm_env], lstm_policy(), frames_per_batch=100, total_frames=400)
    try:
        batches = [b.clone() for b in c]
    finally:
        c.shutdown()
    for batch in batches:
        h, nh = batch["recurrent_state_h"], batch["next", "recurrent_state_h"]
        init = batch["is_init"].squeeze(-1)
        assert h[init].abs().sum() == 0
        assert torch.equal(h[1:][~init[1:]], nh[:-1][~init[1:]])  # root at t+1 = next at t
        assert h.abs().sum() > 0


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_distributed_collector_with_torchrl_env_and_actor(sync):
    theirs = torchrl_layout(transformed_cartpole, actor, frames=50)
    c = DistributedCollector([transformed_cartpole, transformed_cartpole], actor(), frames_per_batch=100,
                             total_frames=200, sync=sync, timeout=120.0)
    try:
        batches = [b.clone() for b in c]
    finally:
        c.shutdown()
    assert sum(b.numel() for b in batches) == 200
    for batch in batches:
        rows = batch.reshape(-1) if batch.ndim > 1 else batch
        assert our_leaves(rows[:50]) == theirs


def test_lstm_module_weight_updates_reach_multisync_workers():
    policy = lstm_policy()
    c = MultiSyncCollector([lstm_env, lstm_env], policy, frames_per_batch=100, total_frames=200,
                           track_policy_version=True)
    try:
        it = iter(c)
        first = next(it).clone()
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.5)
        c.update_policy_weights_()
        second = next(it).clone()
    finally:
        c.shutdown()
    assert int(first["collector", "policy_version"].max()) == 0
    assert int(second["collector", "policy_version"].min()) == 1
    # The workers' logits are the updated policy's, recomputed from each frame's stored input
    # (observation, the carried hidden state and is_init).
    inputs = second.select("observation", "recurrent_state_h", "recurrent_state_c", "is_init").reshape(-1)
    with torch.no_grad():
        want = policy(inputs.clone())["logits"]
    assert torch.allclose(second["logits"].reshape(-1, 2), want, atol=1e-5)
    with torch.no_grad():
        stale = lstm_policy()(inputs.clone())["logits"]
    assert not torch.allclose(second["logits"].reshape(-1, 2), stale, atol=1e-3)
