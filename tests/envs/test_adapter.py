"""TensorDictEnvAdapter, as_env and make_env: foreign envs reached through duck typing."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchrl_like import TorchRLLikeEnv

from rlcollect.envs import ArraySpec, CountingEnv, EnvBase, GymEnv, SerialEnv, TensorDictEnvAdapter, as_env, make_env

pytestmark = pytest.mark.timeout(30)


def buffers(env: EnvBase) -> tuple[dict, np.ndarray, np.ndarray, np.ndarray]:
    n = env.num_rows
    obs = {k: np.full((n, *spec.shape), -7, dtype=spec.dtype) for k, spec in env.obs_layout.items()}
    return obs, np.zeros(n, np.float32), np.zeros(n, np.bool_), np.zeros(n, np.bool_)


# -- the helper env itself (other test suites reuse it, so its contract is pinned here) -------
def test_torchrl_like_env_follows_the_torchrl_layout():
    env = TorchRLLikeEnv(batch_size=[3], max_steps=2)
    assert not isinstance(env, EnvBase)
    td = env.reset()
    assert td.batch_size == torch.Size([3])
    assert set(td.keys()) == {"observation", "done", "terminated", "truncated"}
    assert td["observation"].dtype == torch.float32 and td["observation"].shape == (3, 3)
    td = env.rand_action(td)
    assert td["action"].dtype == torch.int64 and td["action"].shape == (3,)
    td = env.step(td)
    assert set(td["next"].keys()) == {"observation", "reward", "done", "terminated", "truncated"}
    assert td["next", "observation"][:, 0].tolist() == [1.0, 1.0, 1.0]
    assert td["next", "observation"][:, 1].tolist() == td["action"].float().tolist()
    td = env.step(env.rand_action(td["next"].exclude("reward", "done", "terminated", "truncated")))
    assert td["next", "terminated"].all() and td["next", "done"].all()


# -- layouts ---------------------------------------------------------------------------------
def test_adapter_layouts_of_a_batched_env():
    inner = TorchRLLikeEnv(batch_size=[3], max_steps=4)
    env = TensorDictEnvAdapter(inner)
    assert env.batch_size == torch.Size([3])
    assert env.num_rows == 3
    assert env.device == torch.device("cpu")
    assert env.obs_layout == {"observation": ArraySpec((3,), np.dtype(np.float32))}
    assert env.action_layout == ArraySpec((), np.dtype(np.int64))
    assert env.has_truncated is True


def test_adapter_of_an_unbatched_env():
    env = TensorDictEnvAdapter(TorchRLLikeEnv(max_steps=3))
    assert env.batch_size == torch.Size([])
    assert env.num_rows == 1
    assert env.obs_layout == {"observation": ArraySpec((3,), np.dtype(np.float32))}
    obs, reward, term, trunc = buffers(env)
    env.reset_rows(None, obs)
    assert obs["observation"][0, 0] == 0
    for t in range(1, 4):
        env.step_rows(np.array([1], np.int64), obs, reward, term, trunc)
        assert obs["observation"][0, 0] == t
    assert term.tolist() == [True] and trunc.tolist() == [False]
    # An unbatched env has nothing to mask: a row reset is a full reset.
    env.reset_rows(np.array([0]), obs)
    assert obs["observation"][0, 0] == 0
    assert env.env.reset_masks[-1] is None


def test_adapter_skips_private_done_reward_and_action_keys():
    class Extra(TorchRLLikeEnv):
        def reset(self, td=None):
            out = super().reset(td)
            out.set("_private", torch.zeros(*self.batch_size, 1))
            out.set("reward", torch.zeros(*self.batch_size, 1))
            out.set("action", torch.zeros(self.batch_size, dtype=torch.int64))
            out.set(("pixels", "small"), torch.zeros(*self.batch_size, 2, 2, dtype=torch.uint8))
            out.set(("pixels", "_hidden"), torch.zeros(*self.batch_size, 1))
            return out

    env = TensorDictEnvAdapter(Extra(batch_size=[2]))
    assert env.obs_layout == {
        "observation": ArraySpec((3,), np.dtype(np.float32)),
        ("pixels", "small"): ArraySpec((2, 2), np.dtype(np.uint8)),
    }


# -- the array interface ----------------------------------------------------------------------
def test_adapter_steps_through_numpy_buffers():
    inner = TorchRLLikeEnv(batch_size=[3], max_steps=3)
    env = TensorDictEnvAdapter(inner)
    obs, reward, term, trunc = buffers(env)
    env.reset_rows(None, obs)
    assert obs["observation"][:, 0].tolist() == [0, 0, 0]
    assert obs["observation"][:, 1].tolist() == [0, 0, 0]
    offsets = obs["observation"][:, 2].copy()
    assert ((offsets >= 0) & (offsets < 1)).all()

    for t in (1, 2):
        action = np.array([0, 1, 1], np.int64)
        env.step_rows(action, obs, reward, term, trunc)
        assert obs["observation"][:, 0].tolist() == [t, t, t]
        assert obs["observation"][:, 1].tolist() == [0, 1, 1]
        np.testing.assert_array_equal(obs["observation"][:, 2], offsets)
        assert reward.tolist() == [1.0, 1.0, 1.0]
        assert term.tolist() == [False, False, False]
        assert trunc.tolist() == [False, False, False]
    env.step_rows(np.array([1, 0, 1], np.int64), obs, reward, term, trunc)
    assert obs["observation"][:, 0].tolist() == [3, 3, 3]
    assert term.tolist() == [True, True, True]
    assert trunc.tolist() == [False, False, False]
    assert inner.step_calls == 3
    # The action reached the env as a [3] int64 tensor.
    assert inner.last_action.tolist() == [1, 0, 1]


def test_adapter_resets_the_env_once_at_construction_as_torchrls_collectors_do():
    """The probe's reset is the env's first: the first reset of all rows takes its observation
    (an env seeded before the collector is built gives torchrl's episodes); after stepping,
    seeding or loading a state every reset is a new one."""
    inner = TorchRLLikeEnv(batch_size=[2], max_steps=10)
    env = TensorDictEnvAdapter(inner)
    probe = inner.offset.tolist()
    obs, reward, term, trunc = buffers(env)
    env.reset_rows(None, obs)
    assert inner.reset_calls == 1 and obs["observation"][:, 2].tolist() == probe
    env.reset_rows(None, obs)
    assert inner.reset_calls == 2 and obs["observation"][:, 2].tolist() != probe
    for spend in (lambda e: e.step_rows(np.array([1, 1], np.int64), obs, reward, term, trunc),
                  lambda e: e.set_seed(3), lambda e: e.load_state_dict(e.state_dict())):
        inner = TorchRLLikeEnv(batch_size=[2], max_steps=10)
        env = TensorDictEnvAdapter(inner)
        spend(env)
        env.reset_rows(None, obs)
        assert inner.reset_calls == 2


def test_adapter_partial_reset_sends_a_reset_mask_and_touches_only_those_rows():
    inner = TorchRLLikeEnv(batch_size=[3], max_steps=10)
    env = TensorDictEnvAdapter(inner)
    obs, reward, term, trunc = buffers(env)
    env.reset_rows(None, obs)
    for _ in range(2):
        env.step_rows(np.array([1, 1, 1], np.int64), obs, reward, term, trunc)
    before = obs["observation"].copy()

    env.reset_rows(np.array([1]), obs)
    assert inner.reset_masks[-1].tolist() == [False, True, False]
    # Row 1 holds the fresh observation; rows 0 and 2 of the buffer are untouched.
    assert obs["observation"][1, :2].tolist() == [0, 0]
    np.testing.assert_array_equal(obs["observation"][[0, 2]], before[[0, 2]])
    assert inner.count.tolist() == [2, 0, 2]

    env.step_rows(np.array([0, 0, 0], np.int64), obs, reward, term, trunc)
    assert obs["observation"][:, 0].tolist() == [3, 1, 3]


def test_adapter_partial_reset_of_several_rows_in_a_2d_batch():
    inner = TorchRLLikeEnv(batch_size=[2, 2], max_steps=10)
    env = TensorDictEnvAdapter(inner)
    assert env.num_rows == 4
    obs, reward, term, trunc = buffers(env)
    env.reset_rows(None, obs)
    env.step_rows(np.zeros(4, np.int64), obs, reward, term, trunc)
    env.reset_rows(np.array([0, 3]), obs)
    assert inner.reset_masks[-1].tolist() == [[True, False], [False, True]]
    assert obs["observation"][:, 0].tolist() == [0, 1, 1, 0]
    env.step_rows(np.zeros(4, np.int64), obs, reward, term, trunc)
    assert obs["observation"][:, 0].tolist() == [1, 2, 2, 1]


def test_adapter_reports_truncation_separately_from_termination():
    env = TensorDictEnvAdapter(TorchRLLikeEnv(batch_size=[2], max_steps=5, truncate_at=2))
    obs, reward, term, trunc = buffers(env)
    env.reset_rows(None, obs)
    env.step_rows(np.zeros(2, np.int64), obs, reward, term, trunc)
    assert trunc.tolist() == [False, False] and term.tolist() == [False, False]
    env.step_rows(np.zeros(2, np.int64), obs, reward, term, trunc)
    assert trunc.tolist() == [True, True]
    assert term.tolist() == [False, False]


def test_adapter_without_truncated_key():
    inner = TorchRLLikeEnv(batch_size=[2], max_steps=2, with_truncated=False)
    env = TensorDictEnvAdapter(inner)
    assert env.has_truncated is False
    obs, reward, term, trunc = buffers(env)
    env.reset_rows(None, obs)
    trunc[:] = True  # must be overwritten
    env.step_rows(np.zeros(2, np.int64), obs, reward, term, trunc)
    assert trunc.tolist() == [False, False] and term.tolist() == [False, False]
    env.step_rows(np.zeros(2, np.int64), obs, reward, term, trunc)
    assert term.tolist() == [True, True]
    assert trunc.tolist() == [False, False]


def test_adapter_without_terminated_key_takes_done_as_terminated():
    inner = TorchRLLikeEnv(batch_size=[2], max_steps=1, with_truncated=False, with_terminated=False)
    env = TensorDictEnvAdapter(inner)
    assert env.has_truncated is False
    obs, reward, term, trunc = buffers(env)
    env.reset_rows(None, obs)
    env.step_rows(np.zeros(2, np.int64), obs, reward, term, trunc)
    assert term.tolist() == [True, True]
    assert trunc.tolist() == [False, False]
    # And through the TensorDict interface the done family is complete.
    td = env.step(env.rand_action(env.reset()))
    assert td["next", "terminated"].tolist() == [[True], [True]]
    assert td["next", "truncated"].tolist() == [[False], [False]]
    assert td["next", "done"].tolist() == [[True], [True]]


def test_adapter_sample_actions_into_numpy_buffer():
    env = TensorDictEnvAdapter(TorchRLLikeEnv(batch_size=[4], num_actions=3))
    out = env.action_layout.empty(env.num_rows)
    assert out.dtype == np.int64 and out.shape == (4,)
    seen = set()
    for _ in range(50):
        env.sample_actions(out)
        assert ((out >= 0) & (out < 3)).all()
        seen.update(out.tolist())
    assert seen == {0, 1, 2}


def test_adapter_sampling_is_reproducible_after_seeding():
    def actions(seed):
        env = TensorDictEnvAdapter(TorchRLLikeEnv(batch_size=[4], num_actions=5))
        env.set_seed(seed)
        out = env.action_layout.empty(env.num_rows)
        seq = []
        for _ in range(10):
            env.sample_actions(out)
            seq.append(out.copy())
        return np.stack(seq)

    np.testing.assert_array_equal(actions(3), actions(3))
    assert not np.array_equal(actions(3), actions(4))


def test_adapter_sample_actions_falls_back_to_action_spec():
    class Spec:
        def rand(self):
            return torch.tensor([2, 2], dtype=torch.int64)

    class WithSpecOnly:
        def __init__(self):
            self._env = TorchRLLikeEnv(batch_size=[2])
            self.batch_size = self._env.batch_size
            self.device = self._env.device
            self.action_spec = Spec()

        def reset(self, td=None):
            return self._env.reset(td)

        def step(self, td):
            return self._env.step(td)

    env = TensorDictEnvAdapter(WithSpecOnly())
    assert env.action_layout == ArraySpec((), np.dtype(np.int64))
    out = env.action_layout.empty(2)
    env.sample_actions(out)
    assert out.tolist() == [2, 2]


def test_adapter_set_seed_and_state_and_close_delegate():
    inner = TorchRLLikeEnv(batch_size=[3])
    env = TensorDictEnvAdapter(inner)
    assert env.set_seed(10) == 13
    assert env.set_seed(10, static_seed=True) == 10
    assert inner.seeds == [(10, False), (10, True)]

    obs, reward, term, trunc = buffers(env)
    env.reset_rows(None, obs)
    env.step_rows(np.array([1, 0, 1], np.int64), obs, reward, term, trunc)
    state = env.state_dict()
    assert state["count"].tolist() == [1, 1, 1]
    env.step_rows(np.array([1, 0, 1], np.int64), obs, reward, term, trunc)
    env.load_state_dict(state)
    assert inner.count.tolist() == [1, 1, 1]

    env.close()
    env.close()
    assert inner.close_calls == 2  # delegated each time; idempotency is the inner env's job


def test_adapter_without_state_dict_refuses_non_empty_state():
    class Stateless:
        def __init__(self):
            self._env = TorchRLLikeEnv()
            self.batch_size = self._env.batch_size

        def reset(self, td=None):
            return self._env.reset(td)

        def step(self, td):
            return self._env.step(td)

        def rand_action(self, td):
            return self._env.rand_action(td)

    env = TensorDictEnvAdapter(Stateless())
    with pytest.warns(UserWarning, match="does not expose its simulator's state"):
        state = env.state_dict()
    assert set(state) == {"_rlcollect_root"}  # only the adapter's own entry
    env.load_state_dict({})
    with pytest.raises(ValueError, match="load_state_dict"):
        env.load_state_dict({"x": 1})
    env.close()  # no close method: nothing to do
    assert env.device == torch.device("cpu")


def test_adapter_tensordict_interface():
    env = TensorDictEnvAdapter(TorchRLLikeEnv(batch_size=[3], max_steps=2))
    td = env.reset()
    assert td.batch_size == torch.Size([3])
    assert set(td.keys()) == {"observation", "done", "terminated", "truncated"}
    td = env.rand_action(td)
    assert td["action"].dtype == torch.int64 and td["action"].shape == (3,)
    td = env.step(td)
    nxt = td["next"]
    assert set(nxt.keys()) == {"observation", "reward", "done", "terminated", "truncated"}
    assert nxt["reward"].dtype == torch.float32 and nxt["reward"].shape == (3, 1)
    assert nxt["observation"][:, 0].tolist() == [1.0, 1.0, 1.0]
    td, root = env.step_and_maybe_reset(env.rand_action(td["next"].exclude("reward")))
    assert td["next", "done"].all()
    assert td["next", "observation"][:, 0].tolist() == [2.0, 2.0, 2.0]
    assert root["observation"][:, 0].tolist() == [0.0, 0.0, 0.0]
    assert not root["done"].any()


def test_adapter_of_an_rlcollect_env():
    env = TensorDictEnvAdapter(CountingEnv(max_steps=3, batch_size=[2]))
    assert env.obs_layout["observation"] == ArraySpec((1,), np.dtype(np.float32))
    assert env.action_layout == ArraySpec((), np.dtype(np.int64))
    obs, reward, term, trunc = buffers(env)
    env.reset_rows(None, obs)
    env.step_rows(np.zeros(2, np.int64), obs, reward, term, trunc)
    assert obs["observation"][:, 0].tolist() == [1.0, 1.0]


def test_adapter_rejects_non_envs():
    with pytest.raises(TypeError, match="lacks 'reset'"):
        TensorDictEnvAdapter(object())

    class NoObs(TorchRLLikeEnv):
        def reset(self, td=None):
            return super().reset(td).exclude("observation")

    with pytest.raises(TypeError, match="no observation keys"):
        TensorDictEnvAdapter(NoObs())

    class NoActions:
        batch_size = torch.Size([])

        def reset(self, td=None):
            return TensorDict({"observation": torch.zeros(3)}, batch_size=[])

        def step(self, td):
            return td

    with pytest.raises(TypeError, match="neither rand_action nor action_spec"):
        TensorDictEnvAdapter(NoActions())


# -- as_env -------------------------------------------------------------------------------------
def test_as_env_passes_rlcollect_envs_through():
    env = CountingEnv()
    assert as_env(env) is env
    serial = SerialEnv(2, CountingEnv)
    assert as_env(serial) is serial


def test_as_env_wraps_gym_ids_and_instances():
    env = as_env("CartPole-v1")
    assert isinstance(env, GymEnv) and env.batch_size == torch.Size([])
    assert env.env_id == "CartPole-v1"
    env.close()
    raw = gym.make("CartPole-v1")
    env = as_env(raw)
    assert isinstance(env, GymEnv) and env._envs[0] is raw
    env.close()


def test_as_env_adapts_torchrl_style_envs():
    inner = TorchRLLikeEnv(batch_size=[3])
    env = as_env(inner)
    assert isinstance(env, TensorDictEnvAdapter) and env.env is inner
    assert env.batch_size == torch.Size([3])
    with pytest.raises(TypeError):
        as_env(42)


# -- make_env ------------------------------------------------------------------------------------
def test_make_env_from_gym_id_with_kwargs():
    env = make_env("CartPole-v1", {"max_episode_steps": 7})
    assert isinstance(env, GymEnv)
    assert env._envs[0].spec.max_episode_steps == 7
    env.close()


def test_make_env_from_instances():
    counting = CountingEnv()
    assert make_env(counting) is counting
    assert make_env(counting, {}) is counting
    inner = TorchRLLikeEnv()
    adapted = make_env(inner)
    assert isinstance(adapted, TensorDictEnvAdapter) and adapted.env is inner
    gym_env = make_env(gym.make("CartPole-v1"))
    assert isinstance(gym_env, GymEnv)
    gym_env.close()
    with pytest.raises(ValueError, match="create_env_kwargs"):
        make_env(counting, {"max_steps": 3})
    with pytest.raises(ValueError, match="create_env_kwargs"):
        make_env(TorchRLLikeEnv(), {"max_steps": 3})


def test_make_env_from_factories():
    env = make_env(lambda max_steps: CountingEnv(max_steps=max_steps, batch_size=[2]), {"max_steps": 3})
    assert isinstance(env, CountingEnv) and env.max_steps == 3 and env.batch_size == torch.Size([2])
    env = make_env(lambda: TorchRLLikeEnv(batch_size=[2]))
    assert isinstance(env, TensorDictEnvAdapter) and env.batch_size == torch.Size([2])
    env = make_env(lambda: gym.make("CartPole-v1"))
    assert isinstance(env, GymEnv)
    env.close()
    env = make_env(lambda: "CartPole-v1")
    assert isinstance(env, GymEnv)
    env.close()


def test_make_env_from_env_classes():
    # Regression: an env class has a ``step`` attribute and used to be taken for an instance.
    env = make_env(CountingEnv, {"max_steps": 3, "batch_size": [2]})
    assert isinstance(env, CountingEnv) and env.max_steps == 3 and env.batch_size == torch.Size([2])
    env = make_env(CountingEnv)
    assert isinstance(env, CountingEnv) and env.batch_size == torch.Size([])
    env = make_env(TorchRLLikeEnv, {"batch_size": [3]})
    assert isinstance(env, TensorDictEnvAdapter) and env.batch_size == torch.Size([3])


def test_make_env_rejects_other_things():
    with pytest.raises(TypeError, match="create_env_fn"):
        make_env(42)
    with pytest.raises(TypeError, match="create_env_fn"):
        make_env(None)
