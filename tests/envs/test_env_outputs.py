"""Malformed env output is an error, not silently stored: a scalar where the layout says a vector
(numpy would broadcast it into every feature), ``None`` (numpy would store NaN), a complex value
(numpy would drop the imaginary part), a bad reward or flag. The check runs on the first step and
reset of each batch (``EnvBase.arm_checks``), then the env is trusted."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from torchrl_like import TorchRLLikeEnv

from rlcollect import Collector, GymEnv, SerialEnv

pytestmark = pytest.mark.timeout(30)

GOOD = np.zeros(3, np.float32)
BAD = {
    "scalar": (np.float32(1.0), r"got shape \(\) and dtype float32, expected shape \(3,\) and dtype float32"),
    "none": (None, r"got None, expected shape \(3,\) and dtype float32"),
    "complex": (np.ones(3, np.complex64), r"got shape \(3,\) and dtype complex64, expected shape \(3,\)"),
    "too_long": (np.zeros(4, np.float32), r"got shape \(4,\) and dtype float32, expected shape \(3,\)"),
    "object": (np.array(["a", "b", "c"], dtype=object), r"got shape \(3,\) and dtype object"),
}


class MalformedEnv(gym.Env):
    """Box(3) observations; from step ``at`` on (1-based; 0 = also at reset) ``what`` is
    replaced by ``value``."""

    observation_space = spaces.Box(-1.0, 1.0, (3,), np.float32)
    action_space = spaces.Discrete(2)

    def __init__(self, what="observation", value=None, at=1):
        self.what, self.value, self.at, self.t = what, value, at, 0

    def reset(self, *, seed=None, options=None):
        self.t = 0
        obs = self.value if self.what == "observation" and self.at == 0 else GOOD
        return obs, {}

    def step(self, action):
        self.t += 1
        out = {"observation": GOOD, "reward": 1.0, "terminated": False, "truncated": False}
        if self.t >= self.at:
            out[self.what] = self.value
        return out["observation"], out["reward"], out["terminated"], out["truncated"], {}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_malformed_step_observation_is_an_error_naming_env_key_and_shapes(case):
    value, message = BAD[case]
    c = Collector(lambda: GymEnv(MalformedEnv(value=value)), frames_per_batch=4, total_frames=4)
    try:
        with pytest.raises(ValueError, match=r"GymEnv\('MalformedEnv'.*step\(\) observation 'observation': " + message):
            next(c)
    finally:
        c.shutdown()


@pytest.mark.parametrize("case", ["scalar", "none", "complex"])
def test_a_malformed_reset_observation_is_an_error(case):
    value, message = BAD[case]
    env = GymEnv(MalformedEnv(value=value, at=0))
    with pytest.raises(ValueError, match=r"reset\(\) observation 'observation': " + message):
        env.reset()


@pytest.mark.parametrize(("what", "value", "message"), [
    ("reward", None, r"step\(\) reward 'reward': got None, expected shape \(\) and dtype float32"),
    ("reward", np.array([1.0, 2.0]), r"reward 'reward': got shape \(2,\) and dtype float64"),
    ("reward", 1 + 2j, r"reward 'reward': got shape \(\) and dtype complex128"),
    ("terminated", None, r"step\(\) flag 'terminated': got None, expected shape \(\) and dtype bool"),
    ("truncated", 0.5, r"flag 'truncated': got shape \(\) and dtype float64, expected shape \(\) and dtype bool"),
])
def test_a_malformed_reward_or_flag_is_an_error(what, value, message):
    env = GymEnv(MalformedEnv(what=what, value=value))
    env.reset()
    with pytest.raises(ValueError, match=message):
        env.step(env.rand_action())


def test_each_batch_checks_its_first_step_then_trusts_the_env():
    # Malformed from step 3 on: the first batch's first step (step 1) is fine and steps 2-4 are
    # not checked; the second batch's first step (step 5) is checked and fails.
    c = Collector(lambda: GymEnv(MalformedEnv(value=np.float32(1.0), at=3)), frames_per_batch=4, total_frames=8)
    try:
        next(c)
        with pytest.raises(ValueError, match="step\\(\\) observation 'observation': got shape \\(\\)"):
            next(c)
    finally:
        c.shutdown()


def test_well_formed_values_that_convert_are_accepted():
    class Loose(MalformedEnv):
        """float64 observations, int rewards, numpy bool flags: converted as before."""

        def step(self, action):
            self.t += 1
            return np.zeros(3), 1, np.bool_(self.t >= 2), False, {}

    c = Collector(lambda: GymEnv(Loose()), frames_per_batch=4, total_frames=4)
    try:
        batch = next(c)
    finally:
        c.shutdown()
    assert batch["next", "reward"].flatten().tolist() == [1.0] * 4
    assert batch["next", "terminated"].flatten().tolist() == [False, True, False, True]


def test_serial_env_checks_its_sub_envs():
    env = SerialEnv(2, lambda: GymEnv(MalformedEnv(value=None)))
    c = Collector(env, frames_per_batch=4, total_frames=4)
    try:
        with pytest.raises(ValueError, match="GymEnv\\('MalformedEnv'.*got None"):
            next(c)
    finally:
        c.shutdown()


class MalformedTensorDictEnv(TorchRLLikeEnv):
    """A torchrl-style env whose ``step`` replaces ``("next", key)`` with ``value``."""

    def __init__(self, key, value, **kwargs):
        super().__init__(**kwargs)
        self.bad_key, self.bad_value = key, value

    def step(self, td):
        td = super().step(td)
        td.get("next").set(self.bad_key, self.bad_value)
        return td


@pytest.mark.parametrize(("key", "value", "message"), [
    ("observation", torch.zeros(2, 1), r"'observation': got shape \(1,\) and dtype float32, expected shape \(3,\)"),
    ("observation", torch.zeros(2, 3, dtype=torch.complex64), r"'observation': got shape \(3,\) and dtype complex64"),
    ("reward", torch.zeros(2, 2), r"'reward': got shape \(2,\) and dtype float32, expected shape \(1,\)"),
    ("done", torch.zeros(2, 1), r"'done': got shape \(1,\) and dtype float32, expected shape \(1,\) and dtype bool"),
])
def test_a_malformed_tensordict_env_output_is_an_error(key, value, message):
    c = Collector(MalformedTensorDictEnv(key, value, batch_size=[2]), frames_per_batch=4, total_frames=4)
    try:
        with pytest.raises(ValueError, match=r"MalformedTensorDictEnv\(batch_size=\[2\]\).*" + message):
            next(c)
    finally:
        c.shutdown()


def test_a_tensordict_env_missing_an_observation_is_an_error():
    class Missing(TorchRLLikeEnv):
        def step(self, td):
            td = super().step(td)
            td.set("next", td.get("next").exclude("observation"))
            return td

    c = Collector(Missing(batch_size=[2]), frames_per_batch=4, total_frames=4)
    try:
        with pytest.raises(ValueError, match=r"step\(\) observation 'observation': got None"):
            next(c)
    finally:
        c.shutdown()
