"""``VectorEnv``: gymnasium vector envs in every autoreset mode give exactly the collector's
batch semantics, checked against single gymnasium envs stepped by hand with the same seeds and
actions (observation, true final observation under "next", reward, the done flags, the reset
observation in the next row, trajectory ids, step counts), in a ``Collector`` and in a
``MultiSyncCollector`` with 2 workers."""

from __future__ import annotations

import functools
import multiprocessing

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from rlcollect import Collector, GymEnv, MultiSyncCollector, VectorEnv
from rlcollect.data import TRAJ_ID_BLOCK
from rlcollect.envs import as_env

pytestmark = pytest.mark.timeout(120)

# Workers fork from a server that has these imported (as tests/multiprocess does), instead of
# importing torch each; it takes effect if this module starts the fork server.
multiprocessing.get_context("forkserver").set_forkserver_preload([
    "torch", "numpy", "tensordict", "gymnasium", "rlcollect.collector", "rlcollect.envs.vector",
    "rlcollect.multiprocess.worker",
])

K = 3  # sub-envs
T = 30  # steps per batch
BATCHES = 3
SEED = 11
TRAJ_IDS = ("collector", "traj_ids")
MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED]
# (CartPole's max_episode_steps, the collector's max_frames_per_traj): the first ends episodes
# by the env's termination and truncation, the second also by the collector's own truncation.
CASES = {"env-ends": (20, 1000), "collector-truncates": (500, 15)}


def single_env(max_episode_steps: int) -> gym.Env:
    return gym.make("CartPole-v1", max_episode_steps=max_episode_steps)


def vector_env(kind: str, mode: AutoresetMode, max_episode_steps: int, num_envs: int = K) -> VectorEnv:
    fns = [functools.partial(single_env, max_episode_steps)] * num_envs
    if kind == "sync":
        return VectorEnv(SyncVectorEnv(fns, autoreset_mode=mode))
    return VectorEnv(AsyncVectorEnv(fns, autoreset_mode=mode, context="fork"))


def reference(actions: np.ndarray, seed: int, max_episode_steps: int, max_frames: int, id_start: int = 0) -> dict:
    """The batch fields ``(K, steps, ...)`` of single envs stepped by hand with ``actions``
    ``(K, steps)``: our semantics written out plainly."""
    rows, steps = actions.shape
    envs = [single_env(max_episode_steps) for _ in range(rows)]
    obs = [env.reset(seed=seed + i)[0] for i, env in enumerate(envs)]
    ids = list(range(id_start, id_start + rows))
    next_id = id_start + rows
    count = [0] * rows
    out = {k: [[] for _ in range(rows)] for k in ("obs", "next_obs", "reward", "terminated", "truncated", "done",
                                                   "traj_ids", "step_count", "next_step_count")}
    for t in range(steps):
        ended = []
        for i, env in enumerate(envs):
            nobs, reward, term, trunc, _ = env.step(int(actions[i, t]))
            trunc = trunc or count[i] + 1 >= max_frames
            for key, value in (("obs", obs[i]), ("next_obs", nobs), ("reward", reward), ("terminated", term),
                               ("truncated", trunc), ("done", term or trunc), ("traj_ids", ids[i]),
                               ("step_count", count[i]), ("next_step_count", count[i] + 1)):
                out[key][i].append(value)
            count[i] += 1
            obs[i] = nobs
            if term or trunc:
                ended.append(i)
        for i in ended:  # new trajectory ids go to the ended rows in row order
            obs[i] = envs[i].reset()[0]
            ids[i], next_id, count[i] = next_id, next_id + 1, 0
    for env in envs:
        env.close()
    return {k: np.array(v) for k, v in out.items()}


def assert_matches(batch, ref: dict) -> None:
    np.testing.assert_array_equal(batch["observation"].numpy(), ref["obs"].astype(np.float32))
    np.testing.assert_array_equal(batch["next", "observation"].numpy(), ref["next_obs"].astype(np.float32))
    np.testing.assert_array_equal(batch["next", "reward"][..., 0].numpy(), ref["reward"].astype(np.float32))
    for key in ("terminated", "truncated", "done"):
        np.testing.assert_array_equal(batch["next", key][..., 0].numpy(), ref[key], err_msg=key)
        assert not batch[key].any(), f"root {key} set: every root state is one that goes on"
    np.testing.assert_array_equal(batch[TRAJ_IDS].numpy(), ref["traj_ids"])
    np.testing.assert_array_equal(batch["step_count"][..., 0].numpy(), ref["step_count"])
    np.testing.assert_array_equal(batch["next", "step_count"][..., 0].numpy(), ref["next_step_count"])
    # NEXT_STEP's reset step (reward 0, action ignored) never appears: CartPole pays 1 per real step.
    assert (batch["next", "reward"] == 1).all()


def collect(collector, batches: int = BATCHES):
    try:
        return torch.cat([b.clone() for b in collector], dim=-1)
    finally:
        collector.shutdown()


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_collector_matches_single_envs_stepped_by_hand(mode, kind, case):
    max_episode_steps, max_frames = CASES[case]
    collector = Collector(functools.partial(vector_env, kind, mode, max_episode_steps), policy=None,
                          frames_per_batch=K * T, total_frames=K * T * BATCHES, max_frames_per_traj=max_frames)
    assert isinstance(collector.env, VectorEnv) and collector.env.autoreset_mode is mode
    collector.set_seed(SEED)
    batch = collect(collector)
    assert batch.shape == (K, T * BATCHES)
    ref = reference(batch["action"].numpy(), SEED, max_episode_steps, max_frames)
    assert ref["done"].sum() >= 6 and ref["done"][:, :-1].any()  # several episodes end, also mid-batch
    assert_matches(batch, ref)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_same_batches_as_gymenv(mode):
    """Same seed, same random actions, same data as ``GymEnv`` batching the same envs."""
    def run(factory):
        collector = Collector(factory, policy=None, frames_per_batch=K * T, total_frames=K * T * 2)
        collector.set_seed(SEED)
        return collect(collector)

    ours = run(functools.partial(vector_env, "sync", mode, 20))
    theirs = run(lambda: GymEnv(functools.partial(single_env, 20), num_envs=K))
    assert set(ours.keys(True, True)) == set(theirs.keys(True, True))
    for key in theirs.keys(True, True):
        assert torch.equal(ours[key], theirs[key]), key


def make_worker_env(kind: str, mode_name: str) -> VectorEnv:
    return vector_env(kind, AutoresetMode[mode_name], 20)


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_multisync_two_workers_match_single_envs(mode, kind):
    max_frames = 1000
    factory = functools.partial(make_worker_env, kind, mode.name)
    collector = MultiSyncCollector([factory, factory], policy=None, frames_per_batch=2 * K * T,
                                   total_frames=2 * K * T * 2, max_frames_per_traj=max_frames,
                                   mp_start_method="forkserver")
    collector.set_seed(SEED)
    batch = collect(collector)
    assert batch.shape == (2, K, 2 * T)  # stacked: (workers, sub-envs, time)
    for worker in range(2):  # worker 0 is seeded with SEED, worker 1 with what that returned
        part = batch[worker]
        ref = reference(part["action"].numpy(), SEED + worker * K, 20, max_frames, id_start=worker * TRAJ_ID_BLOCK)
        assert_matches(part, ref)


def test_collector_given_a_vector_env_or_a_factory_wraps_it():
    vec = gym.make_vec("CartPole-v1", num_envs=2)
    collector = Collector(vec, policy=None, frames_per_batch=10, total_frames=10)
    assert isinstance(collector.env, VectorEnv) and collector.env.env is vec
    assert collect(collector).shape == (2, 5)
    env = as_env(gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync"))
    assert isinstance(env, VectorEnv)
    env.close()


def test_make_vec_id_and_callable():
    env = VectorEnv("CartPole-v1", num_envs=4, vectorization_mode="sync")
    assert env.batch_size == torch.Size([4]) and isinstance(env.env, SyncVectorEnv)
    env.close()
    # gymnasium's own vectorised CartPole (make_vec's default for it), a third-party subclass
    collector = Collector(VectorEnv("CartPole-v1", num_envs=4), policy=None, frames_per_batch=400, total_frames=400)
    assert type(collector.env.env).__name__ == "CartPoleVectorEnv"
    batch = collect(collector)
    assert batch["next", "done"].any() and (batch["next", "reward"] == 1).all()
    ended = batch["next", "done"][:, :-1, 0]
    assert not torch.equal(batch["next", "observation"][:, :-1][ended], batch["observation"][:, 1:][ended])
    env = VectorEnv(functools.partial(gym.make_vec, "CartPole-v1", num_envs=2), vectorization_mode="sync")
    assert env.batch_size == torch.Size([2])
    env.close()


def test_bad_input_is_refused_at_the_call():
    with pytest.raises(TypeError, match="VectorEnv: env must be a gymnasium.vector.VectorEnv"):
        VectorEnv(123)
    with pytest.raises(TypeError, match="must return a gymnasium.vector.VectorEnv, got TimeLimit"):
        VectorEnv(lambda: gym.make("CartPole-v1"))
    vec = gym.make_vec("CartPole-v1", num_envs=2)
    with pytest.raises(ValueError, match="num_envs only applies to a gymnasium id"):
        VectorEnv(vec, num_envs=2)
    with pytest.raises(ValueError, match="make kwargs"):
        VectorEnv(vec, render_mode="rgb_array")
    with pytest.raises(ValueError, match="num_envs must be a positive int, got 0"):
        VectorEnv("CartPole-v1", num_envs=0)
    vec.close()


class _NoResetMask(SyncVectorEnv):
    """A third-party vector env whose reset has no reset_mask."""

    def reset(self, *, seed=None, options=None):
        if options and "reset_mask" in options:
            raise TypeError("reset_mask is not supported")
        return super().reset(seed=seed, options=options)


def test_vector_env_without_reset_mask_fails_clearly_in_next_step_mode():
    env = VectorEnv(_NoResetMask([functools.partial(single_env, 20)] * 2))
    collector = Collector(env, policy=None, frames_per_batch=100, total_frames=100)
    with pytest.raises(RuntimeError, match=r"reset_mask.*NEXT_STEP mode"):
        next(iter(collector))
    collector.shutdown()


def test_same_step_works_without_reset_mask():
    fns = [functools.partial(single_env, 20)] * K
    env = VectorEnv(_NoResetMask(fns, autoreset_mode=AutoresetMode.SAME_STEP))
    collector = Collector(env, policy=None, frames_per_batch=K * T, total_frames=K * T * 2)
    collector.set_seed(SEED)
    batch = collect(collector)
    ref = reference(batch["action"].numpy(), SEED, 20, 10**9)
    np.testing.assert_array_equal(batch["next", "observation"].numpy(), ref["next_obs"].astype(np.float32))
    np.testing.assert_array_equal(batch["observation"].numpy(), ref["obs"].astype(np.float32))
    np.testing.assert_array_equal(batch[TRAJ_IDS].numpy(), ref["traj_ids"])


def test_dict_observations_and_float64_boxes():
    class DictObs(gym.Wrapper):
        def __init__(self, env):
            super().__init__(env)
            self.observation_space = gym.spaces.Dict({
                "pos": gym.spaces.Box(-np.inf, np.inf, (2,), np.float64),
                "step": gym.spaces.Discrete(1000),
            })
            self.t = 0

        def _obs(self, obs):
            return {"pos": obs[:2].astype(np.float64), "step": self.t}

        def reset(self, **kwargs):
            obs, info = self.env.reset(**kwargs)
            self.t = 0
            return self._obs(obs), info

        def step(self, action):
            obs, *rest = self.env.step(action)
            self.t += 1
            return self._obs(obs), *rest

    make = lambda: DictObs(single_env(20))  # noqa: E731
    for mode in MODES:
        env = VectorEnv(SyncVectorEnv([make] * 2, autoreset_mode=mode))
        assert env.obs_layout["pos"].dtype == np.float32
        collector = Collector(env, policy=None, frames_per_batch=2 * 40, total_frames=2 * 40)
        batch = collect(collector)
        ended = batch["next", "done"][..., 0]
        assert ended.any()
        # the true final observation under "next" (its step count), the reset one in the next row
        assert (batch["next", "step"][ended] > 0).all()
        nxt = torch.zeros_like(ended)
        nxt[:, 1:] = ended[:, :-1]
        assert (batch["step"][nxt] == 0).all()
        assert torch.equal(batch["next", "step"], batch["step"] + 1)


def test_state_dict_resumes_a_sync_vector_env_exactly():
    def make():
        c = Collector(functools.partial(vector_env, "sync", AutoresetMode.NEXT_STEP, 20), policy=None,
                      frames_per_batch=K * T, total_frames=-1)
        c.set_seed(SEED)
        return c

    straight = make()
    it = iter(straight)
    next(it)
    state = straight.state_dict()
    expected = [next(it).clone() for _ in range(2)]
    straight.shutdown()
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed)
    got = [next(it).clone() for _ in range(2)]
    resumed.shutdown()
    for a, b in zip(expected, got):
        for key in a.keys(True, True):
            assert torch.equal(a[key], b[key]), key


def test_state_dict_of_an_async_vector_env_raises():
    env = vector_env("async", AutoresetMode.NEXT_STEP, 20, num_envs=2)
    with pytest.raises(TypeError, match="state of a AsyncVectorEnv cannot be saved"):
        env.state_dict()
    env.close()
    env.close()  # idempotent


def test_multiasync_two_workers_match_single_envs():
    from rlcollect import MultiAsyncCollector

    factory = functools.partial(make_worker_env, "sync", "NEXT_STEP")
    collector = MultiAsyncCollector([factory, factory], policy=None, frames_per_batch=K * T,
                                    total_frames=K * T * 6, max_frames_per_traj=1000, mp_start_method="forkserver")
    collector.set_seed(SEED)
    try:
        batches = [b.clone() for b in collector]
    finally:
        collector.shutdown()
    assert len(batches) == 6
    for worker in range(2):  # each worker's batches, in the order they came, continue each other
        mine = [b for b in batches if int(b[TRAJ_IDS][0, 0]) // TRAJ_ID_BLOCK == worker]
        assert mine
        stream = torch.cat(mine, dim=-1)
        ref = reference(stream["action"].numpy(), SEED + worker * K, 20, 1000, id_start=worker * TRAJ_ID_BLOCK)
        assert_matches(stream, ref)


def test_mujoco_vector_env_gives_gymenvs_batches():
    """Box actions and float64 observations (HalfCheetah-v5): the same batches as ``GymEnv``."""
    pytest.importorskip("mujoco", reason="mujoco is not installed: pip install 'rlcollect[mujoco]'")

    def run(factory):
        collector = Collector(factory, policy=None, frames_per_batch=2 * 50, total_frames=2 * 100,
                              max_frames_per_traj=30)
        collector.set_seed(SEED)
        return collect(collector)

    ours = run(lambda: VectorEnv("HalfCheetah-v5", num_envs=2, vectorization_mode="sync"))
    theirs = run(lambda: GymEnv("HalfCheetah-v5", num_envs=2))
    assert ours["observation"].dtype == torch.float32 and ours["action"].shape == (2, 100, 6)
    assert ours["next", "truncated"].sum() == 2 * 3  # cut at 30 steps: 3 times per row in 100 steps
    for key in theirs.keys(True, True):
        assert torch.equal(ours[key], theirs[key]), key
