"""GymEnv: gymnasium envs given as ids, instances or factories, batched or not."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict import TensorDict

from rlcollect.envs import ArraySpec, GymEnv

pytestmark = pytest.mark.timeout(30)

DONE = ("done", "terminated", "truncated")


class SpaceEnv(gym.Env):
    """A tiny gymnasium env with any spaces: observation ``obs_fn(t)`` at step ``t`` since reset.

    Terminates after ``episode_len`` steps; records every action it receives and close calls.
    """

    def __init__(
        self,
        observation_space: spaces.Space | None = None,
        action_space: spaces.Space | None = None,
        obs_fn: Callable[[int], Any] | None = None,
        episode_len: int = 3,
    ):
        self.observation_space = observation_space or spaces.Box(-np.inf, np.inf, (2,), np.float64)
        self.action_space = action_space or spaces.Discrete(2)
        self.obs_fn = obs_fn or (lambda t: np.array([t, -t], np.float64))
        self.episode_len = episode_len
        self.t = 0
        self.actions: list[Any] = []
        self.close_calls = 0
        self.reset_seeds: list[int | None] = []

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.reset_seeds.append(seed)
        self.t = 0
        return self.obs_fn(0), {}

    def step(self, action):
        self.actions.append(action)
        self.t += 1
        return self.obs_fn(self.t), float(self.t), self.t >= self.episode_len, False, {}

    def close(self):
        self.close_calls += 1


def balance(obs: torch.Tensor) -> torch.Tensor:
    """A linear controller that keeps CartPole up for 500 steps (from the seeds used here)."""
    w = torch.tensor([0.1, 0.5, 1.0, 1.0])
    return ((obs * w).sum(-1) > 0).to(torch.int64)


# -- construction -------------------------------------------------------------------------------
def test_from_id_unbatched():
    env = GymEnv("CartPole-v1")
    assert env.batch_size == torch.Size([])
    assert env.num_rows == 1
    assert env.env_id == "CartPole-v1"
    assert repr(env) == "GymEnv('CartPole-v1', batch_size=[])"
    assert env.obs_layout == {"observation": ArraySpec((4,), np.dtype(np.float32))}
    assert env.action_layout == ArraySpec((), np.dtype(np.int64))
    assert env.has_truncated is True
    env.close()


def test_from_id_batched():
    env = GymEnv("CartPole-v1", num_envs=3)
    assert env.batch_size == torch.Size([3])
    assert env.num_rows == 3
    assert len(env._envs) == 3 and len({id(e) for e in env._envs}) == 3
    td = env.reset()
    assert td["observation"].shape == (3, 4)
    env.close()


def test_make_kwargs_reach_gym_make():
    env = GymEnv("CartPole-v1", num_envs=2, max_episode_steps=5)
    assert all(e.spec.max_episode_steps == 5 for e in env._envs)
    env.close()


def test_from_instance():
    raw = SpaceEnv()
    env = GymEnv(raw)
    assert env.batch_size == torch.Size([])
    assert env._envs == [raw]
    assert env.env_id is None
    env1 = GymEnv(SpaceEnv(), num_envs=1)
    assert env1.batch_size == torch.Size([1])
    assert env1.reset()["observation"].shape == (1, 2)


def test_from_callable():
    built = []

    def factory(episode_len=3):
        built.append(SpaceEnv(episode_len=episode_len))
        return built[-1]

    env = GymEnv(factory)
    assert env.batch_size == torch.Size([]) and len(built) == 1
    env = GymEnv(factory, num_envs=3, episode_len=7)
    assert env.batch_size == torch.Size([3])
    assert env._envs == built[1:] and all(e.episode_len == 7 for e in built[1:])
    env = GymEnv(lambda: gym.make("CartPole-v1"), num_envs=2)
    assert env.env_id == "CartPole-v1"
    env.close()


@pytest.mark.parametrize("num_envs", [0, -1, True, False, 1.5, "2"])
def test_bad_num_envs(num_envs):
    with pytest.raises(ValueError, match="num_envs"):
        GymEnv("CartPole-v1", num_envs=num_envs)


@pytest.mark.parametrize("env", [42, None, b"CartPole-v1", ["CartPole-v1"]])
def test_bad_env_type(env):
    with pytest.raises(TypeError, match="env must be"):
        GymEnv(env)


def test_callable_must_return_a_gym_env():
    with pytest.raises(TypeError, match="must return a gymnasium.Env"):
        GymEnv(lambda: object())


def test_instance_cannot_be_copied():
    with pytest.raises(ValueError, match="num_envs > 1"):
        GymEnv(SpaceEnv(), num_envs=2)
    with pytest.raises(ValueError, match="make kwargs"):
        GymEnv(SpaceEnv(), max_episode_steps=3)


def test_unsupported_spaces():
    with pytest.raises(TypeError, match="observation space"):
        GymEnv(SpaceEnv(observation_space=spaces.Text(5)))
    with pytest.raises(TypeError, match="action space"):
        GymEnv(SpaceEnv(action_space=spaces.Dict({"a": spaces.Discrete(2)})))


# -- observation spaces ---------------------------------------------------------------------------
def test_box_float64_observation_is_stored_as_float32():
    env = GymEnv(SpaceEnv(), num_envs=1)
    assert env.obs_layout == {"observation": ArraySpec((2,), np.dtype(np.float32))}
    td = env.reset()
    assert td["observation"].dtype == torch.float32
    assert td["observation"].tolist() == [[0.0, 0.0]]
    td = env.step(env.rand_action(td))
    assert td["next", "observation"].tolist() == [[1.0, -1.0]]


def test_box_observation_keeps_other_dtypes():
    space = spaces.Box(0, 255, (2, 3), np.uint8)
    env = GymEnv(SpaceEnv(observation_space=space, obs_fn=lambda t: np.full((2, 3), t, np.uint8)))
    assert env.obs_layout == {"observation": ArraySpec((2, 3), np.dtype(np.uint8))}
    td = env.step(env.rand_action(env.reset()))
    assert td["next", "observation"].dtype == torch.uint8
    assert td["next", "observation"].shape == (2, 3)
    assert (td["next", "observation"] == 1).all()


def test_discrete_observation_is_an_int64_scalar():
    space = spaces.Discrete(10, start=3)
    env = GymEnv(lambda: SpaceEnv(observation_space=space, obs_fn=lambda t: 3 + t), num_envs=2)
    assert env.obs_layout == {"observation": ArraySpec((), np.dtype(np.int64))}
    td = env.reset()
    assert td["observation"].dtype == torch.int64 and td["observation"].shape == (2,)
    assert td["observation"].tolist() == [3, 3]
    td = env.step(env.rand_action(td))
    assert td["next", "observation"].tolist() == [4, 4]
    unbatched = GymEnv(SpaceEnv(observation_space=space, obs_fn=lambda t: 3 + t))
    assert unbatched.reset()["observation"].shape == ()


def test_multidiscrete_and_multibinary_observations():
    md = spaces.MultiDiscrete([4, 5, 6])
    env = GymEnv(SpaceEnv(observation_space=md, obs_fn=lambda t: np.array([t, t + 1, t + 2])))
    assert env.obs_layout == {"observation": ArraySpec((3,), np.dtype(np.int64))}
    td = env.step(env.rand_action(env.reset()))
    assert td["next", "observation"].dtype == torch.int64
    assert td["next", "observation"].tolist() == [1, 2, 3]

    mb = spaces.MultiBinary([2, 2])
    env = GymEnv(SpaceEnv(observation_space=mb, obs_fn=lambda t: np.array([[t % 2, 1], [0, 1]], np.int8)))
    assert env.obs_layout == {"observation": ArraySpec((2, 2), np.dtype(np.int8))}
    td = env.step(env.rand_action(env.reset()))
    assert td["next", "observation"].dtype == torch.int8
    assert td["next", "observation"].tolist() == [[1, 1], [0, 1]]


def _dict_space():
    return spaces.Dict(
        {
            "pos": spaces.Box(-10, 10, (2,), np.float64),
            "count": spaces.Discrete(100),
            "nested": spaces.Dict({"flag": spaces.MultiBinary(3)}),
            "pair": spaces.Tuple((spaces.Discrete(4), spaces.Box(0, 100, (1,), np.float32))),
        }
    )


def _dict_obs(t):
    return {
        "pos": np.array([t, 2.0 * t]),
        "count": t,
        "nested": {"flag": np.array([1, 0, t % 2], np.int8)},
        "pair": (t % 4, np.array([10.0 + t], np.float32)),
    }


def test_dict_observation_becomes_nested_keys():
    env = GymEnv(lambda: SpaceEnv(observation_space=_dict_space(), obs_fn=_dict_obs), num_envs=2)
    assert env.obs_layout == {
        "count": ArraySpec((), np.dtype(np.int64)),
        ("nested", "flag"): ArraySpec((3,), np.dtype(np.int8)),
        ("pair", "0"): ArraySpec((), np.dtype(np.int64)),
        ("pair", "1"): ArraySpec((1,), np.dtype(np.float32)),
        "pos": ArraySpec((2,), np.dtype(np.float32)),
    }
    td = env.reset()
    assert set(td.keys(include_nested=True, leaves_only=True)) == {
        "count",
        ("nested", "flag"),
        ("pair", "0"),
        ("pair", "1"),
        "pos",
        *DONE,
    }
    td = env.step(env.rand_action(td))
    nxt = td["next"]
    assert nxt["pos"].dtype == torch.float32 and nxt["pos"].tolist() == [[1.0, 2.0]] * 2
    assert nxt["count"].dtype == torch.int64 and nxt["count"].tolist() == [1, 1]
    assert nxt["nested", "flag"].dtype == torch.int8 and nxt["nested", "flag"].tolist() == [[1, 0, 1]] * 2
    assert nxt["pair", "0"].tolist() == [1, 1]
    assert nxt["pair", "1"].tolist() == [[11.0], [11.0]]
    assert "observation" not in nxt.keys()


def test_tuple_observation_goes_under_observation():
    space = spaces.Tuple((spaces.Box(-5, 5, (2,), np.float64), spaces.Discrete(3),
                          spaces.Dict({"a": spaces.Discrete(9)})))
    env = GymEnv(SpaceEnv(observation_space=space, obs_fn=lambda t: (np.array([t, t + 0.5]), t % 3, {"a": 2 * t})))
    assert env.obs_layout == {
        ("observation", "0"): ArraySpec((2,), np.dtype(np.float32)),
        ("observation", "1"): ArraySpec((), np.dtype(np.int64)),
        ("observation", "2", "a"): ArraySpec((), np.dtype(np.int64)),
    }
    td = env.step(env.rand_action(env.reset()))
    assert td["next", "observation", "0"].tolist() == [1.0, 1.5]
    assert td["next", "observation", "1"].item() == 1
    assert td["next", "observation", "2", "a"].item() == 2


# -- action spaces and rand_action ----------------------------------------------------------------
def _sampled(env: GymEnv, draws: int = 200) -> np.ndarray:
    out = env.action_layout.empty(env.num_rows)
    samples = []
    for _ in range(draws):
        env.sample_actions(out)
        samples.append(out.copy())
    return np.stack(samples)


def test_discrete_action_with_start():
    raw = SpaceEnv(action_space=spaces.Discrete(3, start=-2))
    env = GymEnv(raw)
    assert env.action_layout == ArraySpec((), np.dtype(np.int64))
    samples = _sampled(env)
    assert set(samples.ravel().tolist()) == {-2, -1, 0}
    td = env.rand_action(env.reset())
    assert td["action"].dtype == torch.int64 and td["action"].shape == ()
    env.step(td)
    assert raw.actions == [td["action"].item()]


def test_multidiscrete_action():
    space = spaces.MultiDiscrete([3, 5], start=[1, -1])
    env = GymEnv(lambda: SpaceEnv(action_space=space), num_envs=4)
    assert env.action_layout == ArraySpec((2,), np.dtype(np.int64))
    samples = _sampled(env)
    assert samples.shape == (200, 4, 2)
    assert set(samples[..., 0].ravel().tolist()) == {1, 2, 3}
    assert set(samples[..., 1].ravel().tolist()) == {-1, 0, 1, 2, 3}
    td = env.rand_action(env.reset())
    assert td["action"].shape == (4, 2) and td["action"].dtype == torch.int64
    env.step(td)
    for i, raw in enumerate(env._envs):
        assert raw.actions[0].tolist() == td["action"][i].tolist()


def test_multibinary_action():
    env = GymEnv(lambda: SpaceEnv(action_space=spaces.MultiBinary(5)), num_envs=2)
    assert env.action_layout == ArraySpec((5,), np.dtype(np.int8))
    samples = _sampled(env)
    assert set(np.unique(samples).tolist()) == {0, 1}
    td = env.rand_action()
    assert td["action"].shape == (2, 5) and td["action"].dtype == torch.int8


def test_box_float_action_is_sampled_within_bounds():
    space = spaces.Box(np.array([-1.0, 0.0, 5.0]), np.array([1.0, 0.5, 5.0]), dtype=np.float64)
    env = GymEnv(lambda: SpaceEnv(action_space=space), num_envs=3)
    assert env.action_layout == ArraySpec((3,), np.dtype(np.float32))
    samples = _sampled(env)
    assert samples.dtype == np.float32
    assert (samples >= space.low.astype(np.float32)).all() and (samples <= space.high.astype(np.float32)).all()
    assert samples[..., 0].min() < -0.5 and samples[..., 0].max() > 0.5  # spread, not stuck
    assert (samples[..., 2] == 5.0).all()
    td = env.rand_action(env.reset())
    assert td["action"].dtype == torch.float32 and td["action"].shape == (3, 3)
    env.step(td)


def test_box_action_with_infinite_bounds():
    space = spaces.Box(np.array([-np.inf, 0.0], np.float32), np.array([np.inf, np.inf], np.float32), dtype=np.float32)
    env = GymEnv(SpaceEnv(action_space=space))
    samples = _sampled(env)
    assert np.isfinite(samples).all()
    assert (samples[..., 1] >= 0).all()
    assert samples[..., 0].min() < 0 < samples[..., 0].max()


def test_box_integer_action_is_sampled_inclusively():
    space = spaces.Box(-2, 2, (3,), np.int64)
    env = GymEnv(SpaceEnv(action_space=space))
    assert env.action_layout == ArraySpec((3,), np.dtype(np.int64))
    samples = _sampled(env)
    assert set(np.unique(samples).tolist()) == {-2, -1, 0, 1, 2}


# -- seeding ------------------------------------------------------------------------------------
def test_set_seed_returns_the_next_seed():
    assert GymEnv("CartPole-v1").set_seed(10) == 11
    assert GymEnv("CartPole-v1", num_envs=4).set_seed(10) == 14
    assert GymEnv("CartPole-v1", num_envs=4).set_seed(10, static_seed=True) == 10


def test_set_seed_seeds_each_copy_with_consecutive_seeds():
    env = GymEnv("CartPole-v1", num_envs=3)
    env.set_seed(7)
    obs = env.reset()["observation"]
    for i in range(3):
        expected, _ = gym.make("CartPole-v1").reset(seed=7 + i)
        np.testing.assert_array_equal(obs[i].numpy(), expected)
    assert not torch.equal(obs[0], obs[1])


def test_set_seed_reaches_reset_once():
    raw = SpaceEnv()
    env = GymEnv(raw)
    env.set_seed(5)
    env.reset()
    env.reset()
    assert raw.reset_seeds == [5, None]


def test_same_seed_same_stream():
    def run(seed):
        env = GymEnv("CartPole-v1", num_envs=3)
        env.set_seed(seed)
        td = env.reset()
        observations, actions = [td["observation"]], []
        for _ in range(10):
            td, root = env.step_and_maybe_reset(env.rand_action(td))
            actions.append(td["action"])
            observations.append(root["observation"])
            td = root
        env.close()
        return torch.stack(observations), torch.stack(actions)

    obs_a, act_a = run(123)
    obs_b, act_b = run(123)
    assert torch.equal(obs_a, obs_b) and torch.equal(act_a, act_b)
    obs_c, act_c = run(124)
    assert not torch.equal(obs_a, obs_c)


def test_same_seed_same_rand_action_sequence():
    def actions(seed):
        env = GymEnv(lambda: SpaceEnv(action_space=spaces.Box(-1, 1, (2,))), num_envs=2)
        env.set_seed(seed)
        return torch.stack([env.rand_action()["action"] for _ in range(20)])

    assert torch.equal(actions(3), actions(3))
    assert not torch.equal(actions(3), actions(4))


# -- the TensorDict interface ------------------------------------------------------------------
def test_tensordict_interface_batched():
    env = GymEnv("CartPole-v1", num_envs=2)
    env.set_seed(0)
    td = env.reset()
    assert isinstance(td, TensorDict) and td.batch_size == torch.Size([2])
    assert set(td.keys()) == {"observation", *DONE}
    assert td["observation"].dtype == torch.float32 and td["observation"].shape == (2, 4)
    for key in DONE:
        assert td[key].dtype == torch.bool and td[key].shape == (2, 1) and not td[key].any()

    td = env.rand_action(td)
    assert td["action"].dtype == torch.int64 and td["action"].shape == (2,)
    assert set(td["action"].tolist()) <= {0, 1}
    root_obs = td["observation"].clone()
    td = env.step(td)
    assert set(td.keys()) == {"observation", "action", "next", *DONE}
    assert torch.equal(td["observation"], root_obs)  # step does not touch the root
    nxt = td["next"]
    assert set(nxt.keys()) == {"observation", "reward", *DONE}
    assert nxt["observation"].shape == (2, 4) and nxt["observation"].dtype == torch.float32
    assert nxt["reward"].dtype == torch.float32 and nxt["reward"].shape == (2, 1)
    assert nxt["reward"].tolist() == [[1.0], [1.0]]
    for key in DONE:
        assert nxt[key].dtype == torch.bool and nxt[key].shape == (2, 1)
    assert torch.equal(nxt["done"], nxt["terminated"] | nxt["truncated"])


def test_tensordict_interface_unbatched():
    env = GymEnv("CartPole-v1")
    td = env.reset()
    assert td.batch_size == torch.Size([])
    assert td["observation"].shape == (4,)
    assert td["done"].shape == (1,)
    td = env.rand_action(td)
    assert td["action"].shape == ()
    td = env.step(td)
    assert td["next", "observation"].shape == (4,)
    assert td["next", "reward"].shape == (1,) and td["next", "reward"].dtype == torch.float32
    assert td["next", "done"].shape == (1,) and td["next", "done"].dtype == torch.bool
    assert env.rand_action()["action"].shape == ()


def test_step_matches_gymnasium():
    env = GymEnv("CartPole-v1", num_envs=2)
    env.set_seed(3)
    ref = [gym.make("CartPole-v1") for _ in range(2)]
    ref_obs = [r.reset(seed=3 + i)[0] for i, r in enumerate(ref)]
    td = env.reset()
    np.testing.assert_array_equal(td["observation"].numpy(), np.stack(ref_obs))
    for step in range(5):
        td = env.step(TensorDict({"action": torch.tensor([step % 2, 1 - step % 2])}, batch_size=[2]))
        for i, r in enumerate(ref):
            obs, reward, term, trunc, _ = r.step(td["action"][i].item())
            np.testing.assert_array_equal(td["next", "observation"][i].numpy(), obs)
            assert td["next", "reward"][i].item() == reward
            assert td["next", "terminated"][i].item() == term


def test_step_and_maybe_reset_resets_only_finished_rows():
    lengths = iter([2, 3])
    env = GymEnv(lambda: SpaceEnv(episode_len=next(lengths)), num_envs=2)
    td = env.reset()
    td, root = env.step_and_maybe_reset(env.rand_action(td))
    assert td["next", "observation"][:, 0].tolist() == [1.0, 1.0]
    assert root["observation"][:, 0].tolist() == [1.0, 1.0]
    assert "reward" not in root.keys() and "action" not in root.keys()

    td, root = env.step_and_maybe_reset(env.rand_action(root))
    # Row 0 ended: the true final observation is under "next", the reset one in the new root.
    assert td["next", "observation"][:, 0].tolist() == [2.0, 2.0]
    assert td["next", "done"].tolist() == [[True], [False]]
    assert td["next", "terminated"].tolist() == [[True], [False]]
    assert root["observation"][:, 0].tolist() == [0.0, 2.0]
    assert root["done"].tolist() == [[False], [False]]
    assert root["terminated"].tolist() == [[False], [False]]

    td, root = env.step_and_maybe_reset(env.rand_action(root))
    assert td["next", "observation"][:, 0].tolist() == [1.0, 3.0]
    assert td["next", "done"].tolist() == [[False], [True]]
    assert root["observation"][:, 0].tolist() == [1.0, 0.0]


def test_step_and_maybe_reset_unbatched():
    env = GymEnv(SpaceEnv(episode_len=1))
    td = env.reset()
    td, root = env.step_and_maybe_reset(env.rand_action(td))
    assert td["next", "observation"].tolist() == [1.0, -1.0]
    assert td["next", "done"].tolist() == [True]
    assert root["observation"].tolist() == [0.0, 0.0]
    assert root["done"].tolist() == [False]


def test_partial_reset_with_a_reset_mask():
    env = GymEnv(lambda: SpaceEnv(episode_len=100), num_envs=3)
    td = env.reset()
    for _ in range(2):
        td = env.step(env.rand_action(td))
    out = env.reset(TensorDict({"_reset": torch.tensor([[False], [True], [False]])}, batch_size=[3]))
    assert [e.t for e in env._envs] == [2, 0, 2]
    assert [len(e.reset_seeds) for e in env._envs] == [1, 2, 1]
    # Reset rows carry the reset observation, the others their current one.
    assert out["observation"][:, 0].tolist() == [2.0, 0.0, 2.0]
    assert not out["done"].any()
    # A 1-d mask works too.
    out = env.reset(TensorDict({"_reset": torch.tensor([True, False, False])}, batch_size=[3]))
    assert [e.t for e in env._envs] == [0, 0, 2]
    assert out["observation"][:, 0].tolist() == [0.0, 0.0, 2.0]


def test_partial_reset_draws_the_same_reset_as_a_full_one():
    def make():
        env = GymEnv("CartPole-v1", num_envs=3)
        env.set_seed(11)
        env.reset()
        env.step(TensorDict({"action": torch.tensor([0, 1, 0])}, batch_size=[3]))
        return env

    partial = make().reset(TensorDict({"_reset": torch.tensor([False, True, False])}, batch_size=[3]))
    full = make().reset()
    assert torch.equal(partial["observation"][1], full["observation"][1])


def test_cartpole_truncates_at_500_steps():
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    td = env.reset()
    for t in range(1, 501):
        td["action"] = balance(td["observation"])
        td = env.step(td)
        nxt = td["next"]
        if t < 500:
            assert not nxt["done"].item(), f"CartPole ended at step {t}"
            td = nxt.exclude("reward")
    assert nxt["truncated"].tolist() == [True]
    assert nxt["terminated"].tolist() == [False]
    assert nxt["done"].tolist() == [True]
    env.close()


def test_max_episode_steps_truncates_every_copy():
    env = GymEnv("CartPole-v1", num_envs=2, max_episode_steps=4)
    env.set_seed(0)
    td = env.reset()
    for t in range(1, 5):
        td["action"] = balance(td["observation"])
        td = env.step(td)
        assert td["next", "truncated"].tolist() == [[t == 4], [t == 4]]
        assert not td["next", "terminated"].any()
        td = td["next"].exclude("reward")
    assert td["done"].all()


def test_array_interface_matches_tensordict_interface():
    env = GymEnv("CartPole-v1", num_envs=2)
    env.set_seed(5)
    obs = env.new_obs_buffers()
    env.reset_rows(None, obs)
    reward, term, trunc = np.zeros(2, np.float32), np.zeros(2, np.bool_), np.zeros(2, np.bool_)
    env.step_rows(np.array([1, 0]), obs, reward, term, trunc)

    other = GymEnv("CartPole-v1", num_envs=2)
    other.set_seed(5)
    td = other.reset()
    td["action"] = torch.tensor([1, 0])
    td = other.step(td)
    np.testing.assert_array_equal(obs["observation"], td["next", "observation"].numpy())
    assert reward.tolist() == td["next", "reward"].squeeze(-1).tolist()


# -- state and closing ----------------------------------------------------------------------------
def test_state_dict_round_trip_replays_the_same_future():
    env = GymEnv("CartPole-v1", num_envs=2)
    env.set_seed(21)
    td = env.reset()
    for _ in range(3):
        td["action"] = balance(td["observation"])
        td = env.step(td)["next"].exclude("reward")
    state = env.state_dict()
    assert set(state) == {"envs", "rng", "pending_seeds", "random_block"}

    def future(e, td):
        seq = []
        for _ in range(5):
            td = e.step(e.rand_action(td.clone()))
            seq.append((td["action"].clone(), td["next", "observation"].clone()))
            td = td["next"].exclude("reward")
        return seq

    first = future(env, td)
    env.load_state_dict(state)
    second = future(env, td)
    fresh = GymEnv("CartPole-v1", num_envs=2)
    fresh.load_state_dict(state)
    third = future(fresh, td)
    for (a1, o1), (a2, o2), (a3, o3) in zip(first, second, third):
        assert torch.equal(a1, a2) and torch.equal(a1, a3)
        assert torch.equal(o1, o2) and torch.equal(o1, o3)


def test_load_state_dict_rejects_bad_state():
    env = GymEnv("CartPole-v1", num_envs=2)
    with pytest.raises(KeyError, match="missing keys"):
        env.load_state_dict({"envs": []})
    with pytest.raises(ValueError, match="state has 1 envs"):
        env.load_state_dict(GymEnv("CartPole-v1").state_dict())
    td = env.step(env.rand_action(env.reset()))  # still usable
    assert td["next", "observation"].shape == (2, 4)


def test_close_is_idempotent():
    raws = []
    env = GymEnv(lambda: raws.append(SpaceEnv()) or raws[-1], num_envs=2)
    env.close()
    env.close()
    assert [r.close_calls for r in raws] == [1, 1]
    GymEnv("CartPole-v1").close()
