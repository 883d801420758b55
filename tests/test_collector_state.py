"""``Collector.set_seed`` reproducibility and ``state_dict`` / ``load_state_dict`` (SPEC sections
4 and 10): a restored collector continues the saved stream exactly, and a malformed state
raises and leaves the collector as it was."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers_collector import (
    POLICY_VERSION,
    assert_td_equal,
    cat_time,
    make_collector,  # noqa: F401  (fixture)
    take,
)
from tensordict.nn import ProbabilisticTensorDictModule, ProbabilisticTensorDictSequential, TensorDictModule
from torch import nn

from rlcollect import CountingEnv, GymEnv


class ArgmaxMLP(nn.Module):
    """A deterministic nn.Module policy (forward(observation) -> argmax)."""

    def __init__(self, obs_dim: int, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.net = nn.Linear(obs_dim, 2)
        with torch.no_grad():
            self.net.weight.copy_(torch.randn(2, obs_dim, generator=gen))
            self.net.bias.copy_(torch.randn(2, generator=gen))
        self.register_buffer("offset", torch.zeros(2))

    def forward(self, observation):
        return (self.net(observation) + self.offset).argmax(-1)


def categorical_policy(obs_dim: int, seed: int):
    """A TensorDictModule policy that samples with torch's global RNG."""
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(obs_dim, 2)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(2, obs_dim, generator=gen) * 0.1)
        linear.bias.zero_()
    return ProbabilisticTensorDictSequential(
        TensorDictModule(linear, in_keys=["observation"], out_keys=["logits"]),
        ProbabilisticTensorDictModule(in_keys=["logits"], out_keys=["action"],
                                      distribution_class=torch.distributions.Categorical, return_log_prob=True),
    )


ENVS = {
    "counting": (lambda: CountingEnv(max_steps=3, batch_size=[2]), 1),
    "cartpole": (lambda: GymEnv("CartPole-v1"), 4),
    "cartpole2": (lambda: GymEnv("CartPole-v1", num_envs=2), 4),
}
POLICIES = {
    "random": lambda obs_dim, seed: None,
    "module": lambda obs_dim, seed: ArgmaxMLP(obs_dim, seed),
    "categorical": categorical_policy,
}


# -- set_seed ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_envs, expected", [(None, 11), (1, 11), (3, 13)])
def test_set_seed_returns_seed_plus_num_envs(make_collector, num_envs, expected):
    c = make_collector(GymEnv("CartPole-v1", num_envs=num_envs), frames_per_batch=6)
    assert c.set_seed(10) == expected
    assert c.set_seed(10, static_seed=True) == 10


def test_set_seed_counting_env_and_bad_seed(make_collector):
    c = make_collector(CountingEnv(batch_size=[2, 2]), frames_per_batch=4)
    assert c.set_seed(3) == 7
    for bad in ("3", 1.0, True, None):
        with pytest.raises(TypeError, match="seed"):
            c.set_seed(bad)


@pytest.mark.parametrize("policy", ["random", "categorical"])
def test_seeded_collectors_give_identical_data(make_collector, policy):
    streams = []
    for global_seed in (100, 200):
        c = make_collector(GymEnv("CartPole-v1", num_envs=2), POLICIES[policy](4, 0), frames_per_batch=40)
        c.set_seed(1)
        torch.manual_seed(global_seed)  # the user's own randomness differs between the runs ...
        first = next(c)
        torch.rand(7)  # ... and is consumed between batches
        streams.append(cat_time([first, next(c)]))
    assert_td_equal(streams[0], streams[1])
    assert streams[0]["action"].unique().numel() == 2


def test_seeded_collector_keeps_its_own_torch_rng(make_collector):
    c = make_collector(CountingEnv(batch_size=[4]), categorical_policy(1, 0), frames_per_batch=40)
    c.set_seed(0)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    next(c)
    assert torch.equal(torch.get_rng_state(), state)  # sampling did not touch the global stream


def test_different_seeds_give_different_data(make_collector):
    batches = []
    for seed in (0, 1):
        c = make_collector(GymEnv("CartPole-v1"), frames_per_batch=30)
        c.set_seed(seed)
        batches.append(next(c))
    assert not torch.equal(batches[0]["observation"], batches[1]["observation"])


def test_set_seed_restarts_the_episode(make_collector):
    c = make_collector(CountingEnv(max_steps=10), frames_per_batch=3)
    next(c)
    c.set_seed(0)
    batch = next(c)
    assert batch["observation"][..., 0].tolist() == [0, 1, 2]
    assert batch["collector", "traj_ids"].tolist() == [1, 1, 1]


# -- state_dict round trip -----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("env", sorted(ENVS))
def test_state_dict_round_trip(make_collector, env, policy):
    make_env, obs_dim = ENVS[env]
    c = make_collector(make_env(), POLICIES[policy](obs_dim, seed=0), frames_per_batch=20, total_frames=80,
                       track_policy_version=policy != "random")
    c.set_seed(0)
    take(c, 2)
    if policy != "random":
        c.update_policy_weights_()
    state = c.state_dict()
    reference = take(c, 2)
    assert c.frames == 80

    # A fresh collector, with other initial weights and never seeded, picks up the saved stream.
    restored = make_collector(make_env(), POLICIES[policy](obs_dim, seed=1), frames_per_batch=20, total_frames=80,
                              track_policy_version=policy != "random")
    restored.load_state_dict(state)
    assert restored.frames == 40
    got = list(restored)  # exactly the 2 batches left of total_frames
    assert len(got) == 2
    assert_td_equal(cat_time(reference), cat_time(got))
    if policy != "random":
        assert restored.policy_version == 1
        assert (got[0][POLICY_VERSION] == 1).all()


def test_state_dict_is_a_snapshot(make_collector):
    c = make_collector(CountingEnv(max_steps=4, batch_size=[2]), frames_per_batch=6)
    next(c)
    state = c.state_dict()
    saved = copy.deepcopy(state)
    take(c, 2)  # collecting on does not change what was saved
    assert state["frames"] == saved["frames"] == 6
    np.testing.assert_array_equal(state["rollout"]["obs"]["observation"], saved["rollout"]["obs"]["observation"])
    np.testing.assert_array_equal(state["env"]["count"], saved["env"]["count"])


def test_load_state_dict_into_the_same_collector_rewinds(make_collector):
    c = make_collector(CountingEnv(max_steps=4, batch_size=[2]), frames_per_batch=6)
    next(c)
    state = c.state_dict()
    first = next(c)
    next(c)
    c.load_state_dict(state)
    assert_td_equal(first, next(c))


# -- malformed states -------------------------------------------------------------------------------------------
def _corrupt_missing_key(state):
    del state["frames"]


def _corrupt_rollout_key(state):
    del state["rollout"]["traj_ids"]


def _corrupt_obs_shape(state):
    state["rollout"]["obs"]["observation"] = np.zeros((5, 1), np.float32)


def _corrupt_obs_key(state):
    state["rollout"]["obs"] = {"pixels": np.zeros((2, 1), np.float32)}


def _corrupt_step_count_shape(state):
    state["rollout"]["step_count"] = np.zeros(7, np.int64)


def _corrupt_next_traj_id(state):
    state["rollout"]["next_traj_id"] = None


def _corrupt_frames_value(state):
    state["frames"] = "many"


def _corrupt_policy_shape(state):
    # One entry loads fine, the other does not fit: nothing may be half-loaded.
    state["policy"]["net.bias"] = torch.full((2,), 9.0)
    state["policy"]["net.weight"] = torch.zeros(3, 3)


def _corrupt_env_state(state):
    state["env"] = {"count": np.full(2, 3, np.int64)}  # half an env state: no rng


def _corrupt_torch_rng(state):
    state["torch_rng"] = "not a generator state"


CORRUPTIONS = {
    "missing_key": (_corrupt_missing_key, KeyError, "frames"),
    "rollout_key": (_corrupt_rollout_key, KeyError, "traj_ids"),
    "obs_shape": (_corrupt_obs_shape, ValueError, "shape"),
    "obs_key": (_corrupt_obs_key, ValueError, "observation"),
    "step_count_shape": (_corrupt_step_count_shape, ValueError, "step_count"),
    "frames_value": (_corrupt_frames_value, ValueError, "frames"),
    "next_traj_id": (_corrupt_next_traj_id, ValueError, "next_traj_id"),
    "policy_shape": (_corrupt_policy_shape, RuntimeError, "size mismatch"),
    "env_state": (_corrupt_env_state, KeyError, "rng"),
    "torch_rng": (_corrupt_torch_rng, TypeError, "torch_rng"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_malformed_state_raises_and_leaves_collector_usable(make_collector, corruption):
    corrupt, error, match = CORRUPTIONS[corruption]

    def build(seed):
        c = make_collector(CountingEnv(max_steps=3, batch_size=[2]), ArgmaxMLP(1, seed=0), frames_per_batch=10,
                           max_frames_per_traj=5)
        c.set_seed(seed)
        return c

    reference = build(0)
    reference_batches = take(reference, 3)
    c = build(0)
    next(c)
    other = build(1)  # a valid state from elsewhere, to corrupt
    take(other, 2)
    state = other.state_dict()
    state["policy"] = {k: v.clone() for k, v in state["policy"].items()}
    corrupt(state)
    weights = {k: v.clone() for k, v in c.policy.state_dict().items()}
    with pytest.raises(error, match=match):
        c.load_state_dict(state)
    for key, value in c.policy.state_dict().items():
        assert torch.equal(value, weights[key]), f"{key} was changed by the failed load"
    assert c.frames == 10
    # The collector goes on with its own stream as if nothing happened.
    assert_td_equal(cat_time(reference_batches[1:]), cat_time(take(c, 2)))


def test_load_state_dict_rejects_non_dict(make_collector):
    c = make_collector(CountingEnv(), frames_per_batch=4)
    with pytest.raises(TypeError, match="dict"):
        c.load_state_dict([("frames", 0)])


def test_policy_weights_into_collector_without_weights(make_collector):
    with_weights = make_collector(CountingEnv(), ArgmaxMLP(1, 0), frames_per_batch=4)
    state = with_weights.state_dict()
    random = make_collector(CountingEnv(), frames_per_batch=4)
    with pytest.raises(ValueError, match="policy"):
        random.load_state_dict(state)
    assert next(random)["observation"][..., 0].tolist() == [0, 1, 2, 3]
