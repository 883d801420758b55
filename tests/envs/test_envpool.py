"""``EnvPoolEnv``: an EnvPool pool in a collector gives exactly the batch semantics, checked
against one-env EnvPool pools driven by hand in EnvPool's own NEXT_STEP way (see
test_vector_pools.py); seeding, the refused asynchronous mode, and the wrapping of a pool a
collector is given. Skipped where envpool is not installed (``pip install 'rlcollect[envpool]'``)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from test_vector_pools import assert_matches, collect, pool_reference

from rlcollect import Collector, EnvPoolEnv, MultiSyncCollector
from rlcollect.data import TRAJ_ID_BLOCK

envpool = pytest.importorskip("envpool", reason="envpool is not installed: pip install 'rlcollect[envpool]'")

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]

K, T, SEED = 3, 30, 7


def one_cartpole(max_episode_steps: int, seed: int):
    return envpool.make_gymnasium("CartPole-v1", num_envs=1, seed=seed, max_episode_steps=max_episode_steps)


@pytest.mark.parametrize(("max_episode_steps", "max_frames"), [(20, 1000), (500, 15)],
                         ids=["env-ends", "collector-truncates"])
def test_cartpole_pool_matches_one_env_pools(max_episode_steps, max_frames):
    env = EnvPoolEnv("CartPole-v1", num_envs=K, max_episode_steps=max_episode_steps)
    assert env.autoreset_mode.name == "NEXT_STEP"
    collector = Collector(env, policy=None, frames_per_batch=K * T, total_frames=K * T * 3,
                          max_frames_per_traj=max_frames)
    collector.set_seed(SEED)  # rebuilds the pool with seed=SEED: sub-env i gets SEED + i
    batch = collect(collector)
    ref = pool_reference(functools.partial(one_cartpole, max_episode_steps), batch["action"].numpy(), SEED, max_frames)
    assert ref["done"].sum() >= 6
    assert_matches(batch, ref)
    assert (batch["next", "reward"] == 1).all()  # no reset step (reward 0) in the batch


def test_same_seed_same_batches_and_other_seed_other_batches():
    def run(seed):
        collector = Collector(EnvPoolEnv("CartPole-v1", num_envs=2), policy=None, frames_per_batch=100,
                              total_frames=100)
        collector.set_seed(seed)
        return collect(collector)

    a, b, c = run(1), run(1), run(2)
    for key in a.keys(True, True):
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["observation"], c["observation"])


def test_pong_pixels_match_the_raw_pool():
    """Pong frames (4 x 84 x 84 uint8 stacks) arrive as the raw pool gives them, also across the
    collector's own truncation (all rows reset at once)."""
    steps, max_frames = 40, 15
    collector = Collector(EnvPoolEnv("Pong-v5", num_envs=2), policy=None, frames_per_batch=2 * steps,
                          total_frames=2 * steps, max_frames_per_traj=max_frames)
    collector.set_seed(SEED)
    batch = collect(collector)
    assert batch["observation"].shape == (2, steps, 4, 84, 84) and batch["observation"].dtype == torch.uint8
    raw = envpool.make_gymnasium("Pong-v5", num_envs=2, seed=SEED)
    obs, _ = raw.reset()
    actions = batch["action"].numpy()
    for t in range(steps):
        np.testing.assert_array_equal(batch["observation"][:, t].numpy(), obs)
        nobs, reward, term, trunc, _ = raw.step(actions[:, t].astype(np.int32))
        np.testing.assert_array_equal(batch["next", "observation"][:, t].numpy(), nobs)
        np.testing.assert_array_equal(batch["next", "reward"][:, t, 0].numpy(), reward)
        assert not term.any() and not trunc.any()
        obs = raw.reset()[0] if (t + 1) % max_frames == 0 else nobs
    raw.close()
    assert batch["next", "truncated"][:, max_frames - 1].all()


def make_pool() -> EnvPoolEnv:
    return EnvPoolEnv("CartPole-v1", num_envs=K, max_episode_steps=20)


def test_multisync_two_workers_match_one_env_pools():
    collector = MultiSyncCollector([make_pool, make_pool], policy=None, frames_per_batch=2 * K * T,
                                   total_frames=2 * K * T * 2, max_frames_per_traj=1000, mp_start_method="forkserver")
    collector.set_seed(SEED)
    batch = collect(collector)
    assert batch.shape == (2, K, 2 * T)
    for worker in range(2):  # worker 1 is seeded with what worker 0's set_seed returned
        ref = pool_reference(functools.partial(one_cartpole, 20), batch[worker]["action"].numpy(), SEED + worker * K,
                             1000)
        ref["traj_ids"] = ref["traj_ids"] + worker * TRAJ_ID_BLOCK
        assert_matches(batch[worker], ref)


def test_collector_given_a_pool_wraps_it_in_envpoolenv():
    collector = Collector(lambda: envpool.make_gymnasium("CartPole-v1", num_envs=2, seed=3), policy=None,
                          frames_per_batch=20, total_frames=20)
    assert isinstance(collector.env, EnvPoolEnv)
    with pytest.raises(ValueError, match="EnvPool fixes its seeds when a pool is built"):
        collector.set_seed(1)
    assert collect(collector).shape == (2, 10)


def test_asynchronous_mode_and_bad_input_are_refused():
    with pytest.raises(ValueError, match=r"batch_size must equal num_envs \(4\), got 2"):
        EnvPoolEnv("CartPole-v1", num_envs=4, batch_size=2)
    pool = envpool.make_gymnasium("CartPole-v1", num_envs=4, batch_size=2)
    with pytest.raises(ValueError, match=r"batch_size \(2\) must equal its num_envs \(4\)"):
        EnvPoolEnv(pool)
    pool.close()
    with pytest.raises(ValueError, match="num_envs must be a positive int, got None"):
        EnvPoolEnv("CartPole-v1")
    with pytest.raises(TypeError, match="must be an EnvPool task id or pool"):
        EnvPoolEnv(object())
    env = EnvPoolEnv("CartPole-v1", num_envs=2)
    with pytest.raises(TypeError, match="state of a .* cannot be saved"):
        env.state_dict()
    env.close()


@pytest.mark.timeout(300)
def test_docs_envpool_example_runs():
    from test_vector_pools import doc_block

    namespace = {"__name__": "rlcollect_doc_envpool"}
    exec(compile(doc_block("EnvPoolEnv"), "vector-envs.md[envpool]", "exec"), namespace)
