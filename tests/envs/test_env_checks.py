"""What an env returns mid-run, checked (issue 23, item 10): ``check_finite`` finds NaN and
infinite rewards and observations (off by default), and an observation whose shape changes after
the first step of a batch is reported with the env, the key and both shapes, not numpy's "could
not broadcast"."""

from __future__ import annotations

import functools

import gymnasium as gym
import numpy as np
import pytest

from rlcollect import Collector, GymEnv, MultiSyncCollector

pytestmark = pytest.mark.timeout(120)


class BadAt(gym.Env):
    """A 3-feature float env whose step ``at`` returns ``what``: a NaN reward, an infinite
    observation, or an observation of 4 features."""

    observation_space = gym.spaces.Box(-10, 10, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, what: str, at: int):
        self.what, self.at, self.t = what, at, 0

    def reset(self, *, seed=None, options=None):
        return np.zeros(3, np.float32), {}

    def step(self, action):
        self.t += 1
        obs, reward = np.zeros(3, np.float32), 1.0
        if self.t == self.at:
            if self.what == "nan_reward":
                reward = float("nan")
            elif self.what == "inf_obs":
                obs[1] = np.inf
            elif self.what == "wide_obs":
                obs = np.zeros(4, np.float32)
        return obs, reward, False, False, {}


def bad_env(what: str, at: int) -> GymEnv:
    """Two copies: copy 0 behaves, copy 1 returns ``what`` at its step ``at``."""
    made: list[int] = []

    def make() -> BadAt:
        made.append(1)
        return BadAt(what if len(made) == 2 else "none", at)

    return GymEnv(make, num_envs=2)


@pytest.mark.parametrize("what, key", [("nan_reward", "'reward'"), ("inf_obs", "'observation'")])
def test_check_finite_every_names_the_env_row_key_and_step(what, key):
    collector = Collector(bad_env(what, at=7), frames_per_batch=20, check_finite="every")
    with pytest.raises(ValueError, match=rf"row 1 returned a non-finite {key} at step 6 of the batch") as info:
        next(iter(collector))
    assert "check_finite='every'" in str(info.value)
    collector.shutdown()


def test_check_finite_is_off_by_default_and_first_checks_the_first_step_of_each_batch():
    with Collector(bad_env("nan_reward", at=7), frames_per_batch=20, total_frames=20) as collector:
        batch = next(iter(collector))
    assert np.isnan(batch["next", "reward"].numpy()).sum() == 1  # passes silently, as documented
    with Collector(bad_env("nan_reward", at=7), frames_per_batch=20, total_frames=20, check_finite="first") as c:
        next(iter(c))  # step 6 is not the first of the batch
    with Collector(bad_env("nan_reward", at=11), frames_per_batch=20, check_finite="first") as c:
        it = iter(c)
        next(it)
        with pytest.raises(ValueError, match="non-finite 'reward' at step 0 of the batch"):
            next(it)


def test_check_finite_in_a_worker_names_the_worker():
    collector = MultiSyncCollector([functools.partial(bad_env, "none", 0), functools.partial(bad_env, "inf_obs", 3)],
                                   frames_per_batch=40, check_finite="every")
    try:
        with pytest.raises(ValueError, match=r"worker 1: .* row 1 returned a non-finite 'observation' at step 2"):
            next(iter(collector))
    finally:
        collector.shutdown()


def test_check_finite_is_validated():
    with pytest.raises(ValueError, match=r"check_finite must be one of \(None, 'first', 'every'\), got 'always'"):
        Collector(bad_env("none", 0), frames_per_batch=20, check_finite="always")


def test_an_observation_that_changes_shape_mid_batch_is_named():
    with Collector(bad_env("wide_obs", at=7), frames_per_batch=20) as collector:
        with pytest.raises(ValueError) as info:
            next(iter(collector))
    text = str(info.value)
    assert "could not broadcast" not in text
    assert "step() observation (env 1) 'observation': got shape (4,)" in text and "expected shape (3,)" in text
