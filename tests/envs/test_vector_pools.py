"""C++ vector envs (ale-py's ``AtariVectorEnv``; EnvPool in test_envpool.py) in a collector give
exactly the batch semantics, checked against one-env pools of the same kind driven by hand in
their own NEXT_STEP way (the step after an episode's end ignores its action and returns the
reset observation with reward 0: that step is not a transition and must not be in a batch).

Skipped where ale-py is not installed (``pip install 'rlcollect[atari]'``)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from rlcollect import Collector, VectorEnv

pytestmark = pytest.mark.timeout(120)

TRAJ_IDS = ("collector", "traj_ids")
FIELDS = ("obs", "next_obs", "reward", "terminated", "truncated", "done", "traj_ids", "step_count", "next_step_count")


def pool_reference(make_one: Callable[[int], object], actions: np.ndarray, seed: int, max_frames: int) -> dict:
    """The batch fields ``(K, steps, ...)`` from ``K`` one-env pools (``make_one(seed + i)``,
    reset without a seed) stepped by hand with ``actions`` ``(K, steps)``. An episode the pool
    ends is restarted by the pool's own autoreset step (checked to be one: reward 0, not done);
    one the collector cuts (``max_frames``) by ``reset()``."""
    rows, steps = actions.shape
    pools = [make_one(seed + i) for i in range(rows)]
    obs = [p.reset()[0][0] for p in pools]
    ids, next_id, count = list(range(rows)), rows, [0] * rows
    out = {k: [[] for _ in range(rows)] for k in FIELDS}
    for t in range(steps):
        ended = []
        for i, pool in enumerate(pools):
            nobs, reward, term, trunc, _ = pool.step(actions[i, t : t + 1])
            nobs, reward, term, trunc = nobs[0], float(reward[0]), bool(term[0]), bool(trunc[0])
            cut = not (term or trunc) and count[i] + 1 >= max_frames  # only the collector ends it
            trunc = trunc or count[i] + 1 >= max_frames
            for key, value in zip(FIELDS, (obs[i], nobs, reward, term, trunc, term or trunc, ids[i], count[i],
                                           count[i] + 1)):
                out[key][i].append(value)
            count[i] += 1
            obs[i] = nobs
            if term or trunc:
                ended.append((i, cut))
        for i, cut in ended:
            if cut:
                obs[i] = pools[i].reset()[0][0]
            else:  # the pool's NEXT_STEP autoreset step: the action is ignored
                robs, reward, term, trunc, _ = pools[i].step(actions[i, t : t + 1])
                assert reward[0] == 0 and not term[0] and not trunc[0]
                obs[i] = robs[0]
            ids[i], next_id, count[i] = next_id, next_id + 1, 0
    for pool in pools:
        pool.close()
    return {k: np.array(v) for k, v in out.items()}


def assert_matches(batch, ref: dict) -> None:
    np.testing.assert_array_equal(batch["observation"].numpy(), ref["obs"])
    np.testing.assert_array_equal(batch["next", "observation"].numpy(), ref["next_obs"])
    np.testing.assert_array_equal(batch["next", "reward"][..., 0].numpy(), ref["reward"].astype(np.float32))
    for key in ("terminated", "truncated", "done"):
        np.testing.assert_array_equal(batch["next", key][..., 0].numpy(), ref[key], err_msg=key)
        assert not batch[key].any()
    np.testing.assert_array_equal(batch[TRAJ_IDS].numpy(), ref["traj_ids"])
    np.testing.assert_array_equal(batch["step_count"][..., 0].numpy(), ref["step_count"])
    np.testing.assert_array_equal(batch["next", "step_count"][..., 0].numpy(), ref["next_step_count"])


def collect(collector) -> torch.Tensor:
    try:
        return torch.cat([b.clone() for b in collector], dim=-1)
    finally:
        collector.shutdown()


# -- ale-py's AtariVectorEnv ------------------------------------------------------------------------
K, T, SEED = 2, 40, 5
# Breakout with a life loss ending the episode: episodes of ~20 steps under random actions.
ALE_KWARGS = {"episodic_life": True, "img_height": 42, "img_width": 42}


@pytest.fixture
def ale_vector():
    pytest.importorskip("ale_py", reason="ale-py is not installed: pip install 'rlcollect[atari]'")
    try:
        from ale_py.vector_env import AtariVectorEnv
    except ImportError:
        pytest.skip("this ale-py has no vector env (ale_py.vector_env, ale-py >= 0.11)")
    return AtariVectorEnv


@pytest.mark.parametrize("max_frames", [1000, 22], ids=["env-ends", "collector-truncates"])
def test_ale_vector_env_matches_one_env_pools(ale_vector, max_frames):
    def make_one(seed):
        pool = ale_vector("breakout", 1, **ALE_KWARGS)
        return _Seeded(pool, seed)

    env = VectorEnv(ale_vector("breakout", K, **ALE_KWARGS))
    assert env.autoreset_mode.name == "NEXT_STEP" and env.obs_layout["observation"].shape == (4, 42, 42)
    collector = Collector(env, policy=None, frames_per_batch=K * T, total_frames=K * T * 2,
                          max_frames_per_traj=max_frames)
    collector.set_seed(SEED)
    batch = collect(collector)
    ref = pool_reference(make_one, batch["action"].numpy(), SEED, max_frames)
    assert ref["terminated"].sum() >= 1
    if max_frames < 1000:
        assert ref["truncated"].sum() >= 1
    assert_matches(batch, ref)


@pytest.mark.parametrize("max_frames", [1000, 22], ids=["env-ends", "collector-truncates"])
def test_ale_same_step_mode_gives_the_same_batches(ale_vector, max_frames):
    def run(mode):
        collector = Collector(VectorEnv(ale_vector("breakout", K, autoreset_mode=mode, **ALE_KWARGS)), policy=None,
                              frames_per_batch=K * T, total_frames=K * T * 2, max_frames_per_traj=max_frames)
        collector.set_seed(SEED)
        return collect(collector)

    same, nxt = run("SameStep"), run("NextStep")
    assert nxt["next", "terminated"].sum() >= 1
    for key in nxt.keys(True, True):
        assert torch.equal(same[key], nxt[key]), key


class _Seeded:
    """A one-env pool whose first ``reset()`` uses ``seed`` (as the collector's first reset does)."""

    def __init__(self, pool, seed: int):
        self.pool, self.seed = pool, seed

    def reset(self):
        seed, self.seed = self.seed, None
        return self.pool.reset(seed=seed)

    def step(self, action):
        return self.pool.step(np.asarray(action, dtype=np.int64))

    def close(self):
        self.pool.close()


def doc_block(marker: str) -> str:
    """The ```py block of docs/vector-envs.md that contains ``marker`` (the optional-dependency
    examples, which tests/test_docs.py does not run)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "vector-envs.md").read_text()
    (block,) = [b for b in re.findall(r"^```py\n(.*?)^```", text, re.S | re.M) if marker in b]
    return block


def test_docs_ale_example_runs(ale_vector):
    exec(compile(doc_block("AtariVectorEnv"), "vector-envs.md[ale]", "exec"), {"__name__": "rlcollect_doc_ale"})


def test_ale_asynchronous_batch_size_is_refused(ale_vector):
    pool = ale_vector("breakout", 4, batch_size=2, **ALE_KWARGS)
    with pytest.raises(ValueError, match="AtariVectorEnv has batch_size 2 != num_envs 4"):
        VectorEnv(pool)
    pool.close()
