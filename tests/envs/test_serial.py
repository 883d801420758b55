"""SerialEnv: unbatched envs of any supported kind, batched in-process."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl_like import TorchRLLikeEnv

from rlcollect.envs import ArraySpec, CountingEnv, GymEnv, SerialEnv, TensorDictEnvAdapter

pytestmark = pytest.mark.timeout(30)

DONE = ("done", "terminated", "truncated")


# -- of CountingEnv ------------------------------------------------------------------------------
def test_serial_counting_layout_and_batch_size():
    env = SerialEnv(3, lambda: CountingEnv(max_steps=4))
    assert env.batch_size == torch.Size([3])
    assert env.num_rows == 3
    assert len(env.envs) == 3 and len({id(e) for e in env.envs}) == 3
    assert env.obs_layout == {"observation": ArraySpec((1,), np.dtype(np.float32))}
    assert env.action_layout == ArraySpec((), np.dtype(np.int64))
    assert env.has_truncated is True
    assert repr(env) == "SerialEnv(batch_size=[3])"


def test_serial_counting_steps_and_terminates():
    env = SerialEnv(3, lambda: CountingEnv(max_steps=4))
    td = env.reset()
    assert td["observation"].shape == (3, 1) and td["observation"].dtype == torch.float32
    assert set(td.keys()) == {"observation", *DONE}
    for t in range(1, 5):
        td = env.step(env.rand_action(td))
        nxt = td["next"]
        assert nxt["observation"].tolist() == [[float(t)]] * 3
        assert nxt["reward"].tolist() == [[1.0]] * 3 and nxt["reward"].dtype == torch.float32
        assert nxt["terminated"].tolist() == [[t == 4]] * 3
        assert nxt["truncated"].tolist() == [[False]] * 3
        assert nxt["done"].tolist() == [[t == 4]] * 3
        td = nxt.exclude("reward")
    assert [e.total_steps for e in env.envs] == [4, 4, 4]


def test_serial_accepts_an_env_class_as_factory():
    env = SerialEnv(2, CountingEnv)
    assert env.batch_size == torch.Size([2])
    assert all(e.max_steps == 5 for e in env.envs)


def test_serial_with_different_episode_lengths_resets_only_finished_rows():
    lengths = iter([1, 2, 3])
    env = SerialEnv(3, lambda: CountingEnv(max_steps=next(lengths)))
    td = env.reset()
    td, root = env.step_and_maybe_reset(env.rand_action(td))
    assert td["next", "done"].tolist() == [[True], [False], [False]]
    assert root["observation"].tolist() == [[0.0], [1.0], [1.0]]
    td, root = env.step_and_maybe_reset(env.rand_action(root))
    assert td["next", "observation"].tolist() == [[1.0], [2.0], [2.0]]
    assert td["next", "done"].tolist() == [[True], [True], [False]]
    assert root["observation"].tolist() == [[0.0], [0.0], [2.0]]


def test_serial_array_interface_partial_reset():
    env = SerialEnv(3, lambda: CountingEnv(max_steps=None))
    obs = {"observation": np.full((3, 1), -1, np.float32)}
    reward, term, trunc = np.zeros(3, np.float32), np.ones(3, np.bool_), np.ones(3, np.bool_)
    env.reset_rows(None, obs)
    assert obs["observation"].ravel().tolist() == [0, 0, 0]
    env.step_rows(np.zeros(3, np.int64), obs, reward, term, trunc)
    env.step_rows(np.zeros(3, np.int64), obs, reward, term, trunc)
    assert obs["observation"].ravel().tolist() == [2, 2, 2]
    assert reward.tolist() == [1, 1, 1] and not term.any() and not trunc.any()
    obs["observation"][:] = 99
    env.reset_rows(np.array([2]), obs)
    assert obs["observation"].ravel().tolist() == [99, 99, 0]  # only row 2 written
    env.step_rows(np.zeros(3, np.int64), obs, reward, term, trunc)
    assert obs["observation"].ravel().tolist() == [3, 3, 1]


def test_serial_counting_seeding():
    env = SerialEnv(3, CountingEnv)
    assert env.set_seed(5) == 8
    out = env.action_layout.empty(3)
    rows = []
    for _ in range(20):
        env.sample_actions(out)
        rows.append(out.copy())
    rows = np.stack(rows)
    for i in range(3):
        ref = CountingEnv()
        ref.set_seed(5 + i)
        ref_out = ref.action_layout.empty(1)
        expected = []
        for _ in range(20):
            ref.sample_actions(ref_out)
            expected.append(ref_out[0])
        assert rows[:, i].tolist() == expected
    assert env.set_seed(5, static_seed=True) == 5


def test_serial_state_dict_round_trip():
    env = SerialEnv(2, lambda: CountingEnv(max_steps=None))
    td = env.reset()
    td = env.step(env.rand_action(td))["next"].exclude("reward")
    state = env.state_dict()
    assert len(state["envs"]) == 2
    first = [env.step(env.rand_action(td.clone()))["next", "observation"].clone() for _ in range(3)]
    env.load_state_dict(state)
    second = [env.step(env.rand_action(td.clone()))["next", "observation"].clone() for _ in range(3)]
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="expected 2 env states"):
        env.load_state_dict({"envs": [state["envs"][0]]})
    with pytest.raises(ValueError, match="expected 2 env states"):
        env.load_state_dict({})


# -- of GymEnv -------------------------------------------------------------------------------------
def test_serial_gym_matches_batched_gym():
    serial = SerialEnv(3, lambda: GymEnv("CartPole-v1"))
    batched = GymEnv("CartPole-v1", num_envs=3)
    assert serial.batch_size == batched.batch_size == torch.Size([3])
    assert serial.obs_layout == batched.obs_layout
    assert serial.action_layout == batched.action_layout
    assert serial.set_seed(10) == 13
    assert batched.set_seed(10) == 13
    td_s, td_b = serial.reset(), batched.reset()
    assert torch.equal(td_s["observation"], td_b["observation"])
    for i in range(3):
        expected, _ = gym.make("CartPole-v1").reset(seed=10 + i)
        np.testing.assert_array_equal(td_s["observation"][i].numpy(), expected)
    for step in range(6):
        action = torch.tensor([step % 2, 1, 0])
        td_s["action"] = action
        td_b["action"] = action.clone()
        td_s, td_b = serial.step(td_s), batched.step(td_b)
        assert torch.equal(td_s["next"]["observation"], td_b["next"]["observation"])
        for key in ("reward", *DONE):
            assert torch.equal(td_s["next", key], td_b["next", key])
        td_s, td_b = td_s["next"].exclude("reward"), td_b["next"].exclude("reward")
    serial.close()
    serial.close()
    batched.close()


def test_serial_of_gym_ids_and_instances():
    env = SerialEnv(2, lambda: "CartPole-v1")
    assert all(isinstance(e, GymEnv) for e in env.envs)
    env = SerialEnv(2, lambda: gym.make("CartPole-v1"))
    assert all(isinstance(e, GymEnv) for e in env.envs)
    td = env.step(env.rand_action(env.reset()))
    assert td["next", "observation"].shape == (2, 4)
    assert td["action"].shape == (2,) and set(td["action"].tolist()) <= {0, 1}
    env.close()


# -- of a torchrl-style env --------------------------------------------------------------------------
def test_serial_of_torchrl_like_envs():
    env = SerialEnv(3, lambda: TorchRLLikeEnv(max_steps=2, truncate_at=None))
    assert all(isinstance(e, TensorDictEnvAdapter) for e in env.envs)
    assert env.batch_size == torch.Size([3])
    assert env.obs_layout == {"observation": ArraySpec((3,), np.dtype(np.float32))}
    assert env.action_layout == ArraySpec((), np.dtype(np.int64))
    td = env.reset()
    assert td["observation"].shape == (3, 3)
    td["action"] = torch.tensor([0, 1, 1])
    td = env.step(td)
    assert td["next", "observation"][:, 0].tolist() == [1.0, 1.0, 1.0]
    assert td["next", "observation"][:, 1].tolist() == [0.0, 1.0, 1.0]
    assert td["next", "reward"].tolist() == [[1.0]] * 3
    assert not td["next", "done"].any()
    td, root = env.step_and_maybe_reset(env.rand_action(td["next"].exclude("reward")))
    assert td["next", "terminated"].all() and td["next", "done"].all()
    assert not td["next", "truncated"].any()
    assert root["observation"][:, 0].tolist() == [0.0, 0.0, 0.0]
    assert [e.env.reset_calls for e in env.envs] == [2, 2, 2]  # the probe (the first reset() is it), autoreset


def test_serial_of_torchrl_like_seeding():
    env = SerialEnv(3, TorchRLLikeEnv)
    assert env.set_seed(100) == 103
    assert [e.env.seeds for e in env.envs] == [[(100, False)], [(101, False)], [(102, False)]]
    assert env.set_seed(7, static_seed=True) == 7
    assert [e.env.seeds[-1] for e in env.envs] == [(7, True)] * 3

    def offsets(seed):
        e = SerialEnv(3, TorchRLLikeEnv)
        e.set_seed(seed)
        return e.reset()["observation"][:, 2]

    assert torch.equal(offsets(1), offsets(1))
    assert not torch.equal(offsets(1), offsets(2))
    first = offsets(1)
    assert len(set(first.tolist())) == 3  # each row got its own seed


def test_serial_of_torchrl_like_without_truncated():
    env = SerialEnv(2, lambda: TorchRLLikeEnv(with_truncated=False))
    assert env.has_truncated is False


def test_serial_close_closes_every_env():
    env = SerialEnv(3, TorchRLLikeEnv)
    env.close()
    assert [e.env.close_calls for e in env.envs] == [1, 1, 1]


def test_serial_partial_reset_through_tensordict():
    env = SerialEnv(3, lambda: TorchRLLikeEnv(max_steps=None))
    td = env.reset()
    td = env.step(env.rand_action(td))["next"].exclude("reward")
    td = env.step(env.rand_action(td))["next"].exclude("reward")
    out = env.reset(TensorDict({"_reset": torch.tensor([[True], [False], [False]])}, batch_size=[3]))
    assert out["observation"][:, 0].tolist() == [0.0, 2.0, 2.0]
    assert [e.env.count.item() for e in env.envs] == [0, 2, 2]


# -- errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_envs", [0, -1, True, 2.0, None])
def test_serial_bad_num_envs(num_envs):
    with pytest.raises(ValueError, match="num_envs must be a positive int"):
        SerialEnv(num_envs, CountingEnv)


def test_serial_bad_factory():
    with pytest.raises(TypeError, match="create_env_fn must be callable"):
        SerialEnv(2, CountingEnv())


@pytest.mark.parametrize(
    "factory",
    [
        lambda: CountingEnv(batch_size=[2]),
        lambda: GymEnv("CartPole-v1", num_envs=2),
        lambda: GymEnv("CartPole-v1", num_envs=1),
        lambda: TorchRLLikeEnv(batch_size=[2]),
    ],
    ids=["counting", "gym2", "gym1", "torchrl_like"],
)
def test_serial_rejects_batched_sub_envs(factory):
    with pytest.raises(ValueError, match="must be unbatched"):
        SerialEnv(2, factory)
