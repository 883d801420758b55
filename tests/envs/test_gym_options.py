"""GymEnv's torchrl keyword arguments: ``categorical_action_encoding`` (one-hot actions),
``frame_skip``, ``from_pixels``/``pixels_only``, ``env_name``; the ones that mean nothing here
are refused with what to use instead; the action-shape error's hint points the right way."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from tensordict.nn import TensorDictModule

from rlcollect import Collector, GymEnv

pytestmark = pytest.mark.timeout(30)


class Recorder(gym.Env):
    """Observation = [t, last action]; reward = t; terminates after ``episode_len`` steps; an
    ``rgb_array`` render of shape (4, 6, 3) filled with t."""

    observation_space = spaces.Box(-np.inf, np.inf, (2,), np.float32)
    action_space = spaces.Discrete(3)
    metadata = {"render_modes": ["rgb_array"]}

    def __init__(self, episode_len=5, render_mode=None):
        self.episode_len, self.render_mode = episode_len, render_mode
        self.t, self.actions = 0, []

    def reset(self, *, seed=None, options=None):
        self.t = 0
        return np.array([0, -1], np.float32), {}

    def step(self, action):
        self.actions.append(action)
        self.t += 1
        return np.array([self.t, action], np.float32), float(self.t), self.t >= self.episode_len, False, {}

    def render(self):
        return np.full((4, 6, 3), self.t, np.uint8)


def test_one_hot_actions():
    env = GymEnv(Recorder(), categorical_action_encoding=False)
    assert env.action_layout.shape == (3,) and env.action_layout.dtype == np.int64
    env.set_seed(0)
    actions = torch.stack([env.rand_action()["action"] for _ in range(50)])
    assert actions.dtype == torch.int64 and actions.shape == (50, 3)
    assert actions.sum(-1).tolist() == [1] * 50 and set(actions.argmax(-1).tolist()) == {0, 1, 2}
    env.reset()
    td = env.step(env.rand_action().set("action", torch.tensor([0, 0, 1])))
    assert td["next", "observation"].tolist() == [1.0, 2.0]  # the env got index 2
    assert env._envs[0].actions == [2]


def test_one_hot_env_in_a_collector_with_random_and_one_hot_policies():
    def one_hot(observation):
        return torch.nn.functional.one_hot(torch.full(observation.shape[:-1], 1), 3)

    for policy in (None, TensorDictModule(one_hot, in_keys=["observation"], out_keys=["action"])):
        c = Collector(lambda: GymEnv(Recorder, num_envs=2, categorical_action_encoding=False), policy=policy,
                      frames_per_batch=10, total_frames=10)
        try:
            batch = next(c)
        finally:
            c.shutdown()
        assert batch["action"].shape == (2, 5, 3) and batch["action"].sum(-1).eq(1).all()
        # the env saw the index of each one-hot action
        assert torch.equal(batch["next", "observation"][..., 1].long(), batch["action"].argmax(-1))


def test_categorical_is_the_default_here():
    assert GymEnv(Recorder()).action_layout.shape == ()
    assert GymEnv(Recorder(), categorical_action_encoding=True).action_layout.shape == ()


def test_the_action_shape_hint_points_the_right_way():
    index = TensorDictModule(lambda observation: torch.zeros(observation.shape[:-1], dtype=torch.int64),
                             in_keys=["observation"], out_keys=["action"])
    with pytest.raises(TypeError, match=r"has shape \(\) per env row but the env expects \(3,\).*one-hot encode the "
                                        r"index \(torch.nn.functional.one_hot\(index, 3\)\)"
                                        r".*categorical_action_encoding=True"):
        Collector(GymEnv(Recorder(), categorical_action_encoding=False), policy=index, frames_per_batch=4)
    logits = TensorDictModule(lambda observation: torch.zeros(*observation.shape[:-1], 3, dtype=torch.int64),
                              in_keys=["observation"], out_keys=["action"])
    with pytest.raises(TypeError, match=r"has shape \(3,\) per env row but the env expects \(\).*into the index "
                                        r"\(argmax or sampling\).*categorical_action_encoding=False"):
        Collector(GymEnv(Recorder()), policy=logits, frames_per_batch=4)


def test_frame_skip_repeats_the_action_and_sums_rewards_until_the_end():
    env = GymEnv(Recorder(episode_len=5), frame_skip=2)
    env.reset()
    rewards, dones = [], []
    for a in (1, 2, 0):
        td = env.step(env.rand_action().set("action", torch.tensor(a)))
        rewards.append(td["next", "reward"].item())
        dones.append(td["next", "done"].item())
    assert env._envs[0].actions == [1, 1, 2, 2, 0]  # the third step stops at the episode's end
    assert rewards == [1.0 + 2.0, 3.0 + 4.0, 5.0]
    assert dones == [False, False, True]


def test_frame_skip_in_a_collector():
    c = Collector(lambda: GymEnv(Recorder(episode_len=4), frame_skip=2), frames_per_batch=4, total_frames=4)
    try:
        batch = next(c)
    finally:
        c.shutdown()
    assert batch["next", "observation"][:, 0].tolist() == [2.0, 4.0, 2.0, 4.0]
    assert batch["next", "reward"].flatten().tolist() == [3.0, 7.0, 3.0, 7.0]


@pytest.mark.parametrize("pixels_only", [True, False])
def test_from_pixels(pixels_only):
    env = GymEnv(lambda: Recorder(render_mode="rgb_array"), from_pixels=True, pixels_only=pixels_only)
    want = {"pixels"} if pixels_only else {"pixels", "observation"}
    assert set(env.obs_layout) == want
    assert env.obs_layout["pixels"].shape == (4, 6, 3) and env.obs_layout["pixels"].dtype == np.uint8
    env.reset()
    td = env.step(env.rand_action())
    assert td["next", "pixels"].dtype == torch.uint8 and td["next", "pixels"].unique().tolist() == [1]
    if not pixels_only:
        assert td["next", "observation"][0].item() == 1.0


def test_from_pixels_with_an_id_makes_it_with_rgb_array(monkeypatch):
    gym.register("RecorderForPixels-v0", entry_point=Recorder)
    try:
        env = GymEnv("RecorderForPixels-v0", from_pixels=True)
        assert env._envs[0].unwrapped.render_mode == "rgb_array" and set(env.obs_layout) == {"pixels"}
    finally:
        gym.registry.pop("RecorderForPixels-v0")


def test_from_pixels_needs_rgb_array_rendering():
    with pytest.raises(ValueError, match=r"from_pixels=True needs an env with render_mode='rgb_array', got None"):
        GymEnv(Recorder(), from_pixels=True)


def test_env_name_keyword_as_torchrl_spells_it():
    assert GymEnv(env_name="CartPole-v1").env_id == "CartPole-v1"
    with pytest.raises(TypeError, match="env must be given"):
        GymEnv()


@pytest.mark.parametrize(("kwarg", "value", "message"), [
    ("device", "cuda", "GymEnv steps on the CPU"),
    ("batch_size", [4], "use num_envs=K"),
    ("num_workers", 2, "MultiSyncCollector"),
    ("allow_done_after_reset", True, "done right after reset is an error"),
    ("convert_actions_to_numpy", False, "always reach gymnasium as numpy"),
    ("missing_obs_value", 0.0, "must be present"),
])
def test_torchrl_only_kwargs_are_refused_with_what_to_do(kwarg, value, message):
    with pytest.raises(ValueError, match=f"GymEnv: '{kwarg}' is not supported: .*{message}"):
        GymEnv("CartPole-v1", **{kwarg: value})


def test_device_cpu_is_accepted():
    assert GymEnv("CartPole-v1", device="cpu").env_id == "CartPole-v1"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"frame_skip": 0}, "frame_skip must be None or a positive int, got 0"),
    ({"frame_skip": 1.5}, "frame_skip must be None or a positive int"),
    ({"categorical_action_encoding": "yes"}, "categorical_action_encoding must be True or False"),
    ({"from_pixels": 1}, "from_pixels and pixels_only must be bools"),
])
def test_bad_option_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GymEnv("CartPole-v1", **kwargs)
