"""The single-process ``Collector``'s batches: layout, continuity, trajectory ids, truncation
(SPEC sections 1 and 4)."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from helpers_collector import (
    BASE_KEYS,
    POLICY_VERSION,
    TRAJ_IDS,
    assert_td_equal,
    cat_time,
    flag,
    leaf_keys,
    make_collector,  # noqa: F401  (fixture)
    next_obs,
    obs,
    take,
)
from helpers_torchrl_env import DuckCountingEnv

from rlcollect import Collector, CountingEnv, GymEnv
from rlcollect.data import TRAJ_ID_BLOCK


def quiet(factory, *args, **kwargs):
    """Build while ignoring the divisibility warnings (tested on their own)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return factory(*args, **kwargs)


# -- shapes, keys and dtypes ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "batch_size, frames, shape",
    [
        (None, 7, (7,)),
        ([4], 12, (4, 3)),
        ([3], 10, (3, 4)),  # T = ceil(10 / 3)
        ([2, 3], 12, (2, 3, 2)),
        ([2, 3], 13, (2, 3, 3)),
    ],
)
def test_batch_shape_and_time_name(make_collector, batch_size, frames, shape):
    c = quiet(make_collector, CountingEnv(batch_size=batch_size), frames_per_batch=frames)
    for _ in range(2):
        batch = next(c)
        assert batch.batch_size == torch.Size(shape)
        assert batch.names == [None] * (len(shape) - 1) + ["time"]


def test_frames_per_batch_not_multiple_of_rows_warns(make_collector):
    with pytest.warns(UserWarning, match="frames_per_batch=10"):
        make_collector(CountingEnv(batch_size=[3]), frames_per_batch=10)


def test_gym_env_batched_shape(make_collector):
    c = make_collector(GymEnv("CartPole-v1", num_envs=3), frames_per_batch=12)
    batch = next(c)
    assert batch.batch_size == torch.Size([3, 4])
    assert batch["observation"].shape == (3, 4, 4)
    assert batch["observation"].dtype == torch.float32
    assert batch["action"].shape == (3, 4)
    assert batch["action"].dtype == torch.int64


def test_key_set_default(make_collector):
    batch = next(make_collector(CountingEnv(batch_size=[2]), frames_per_batch=4))
    assert leaf_keys(batch) == BASE_KEYS


def test_key_set_with_step_count_and_policy_version(make_collector):
    c = make_collector(CountingEnv(), frames_per_batch=4, max_frames_per_traj=3)
    assert leaf_keys(next(c)) == BASE_KEYS | {"step_count", ("next", "step_count")}
    c = make_collector(CountingEnv(), frames_per_batch=4, track_policy_version=True)
    versions = {POLICY_VERSION, "policy_version", ("next", "policy_version")}  # ours and torchrl 0.14's
    assert leaf_keys(next(c)) == BASE_KEYS | versions
    c = make_collector(CountingEnv(), frames_per_batch=4, track_policy_version=True, max_frames_per_traj=3)
    assert leaf_keys(next(c)) == BASE_KEYS | versions | {"step_count", ("next", "step_count")}


def test_dtypes_and_shapes_of_every_entry(make_collector):
    c = make_collector(CountingEnv(max_steps=3, batch_size=[2, 3]), frames_per_batch=24, max_frames_per_traj=10,
                       track_policy_version=True)
    batch = next(c)
    shape = (2, 3, 4)
    expected = {
        "observation": (torch.float32, (*shape, 1)),
        ("next", "observation"): (torch.float32, (*shape, 1)),
        "action": (torch.int64, shape),
        ("next", "reward"): (torch.float32, (*shape, 1)),
        TRAJ_IDS: (torch.int64, shape),
        POLICY_VERSION: (torch.int64, shape),
        "policy_version": (torch.int64, shape),
        ("next", "policy_version"): (torch.int64, shape),
        "step_count": (torch.int64, (*shape, 1)),
        ("next", "step_count"): (torch.int64, (*shape, 1)),
    }
    for name in ("done", "terminated", "truncated"):
        expected[name] = (torch.bool, (*shape, 1))
        expected[("next", name)] = (torch.bool, (*shape, 1))
    assert set(expected) == leaf_keys(batch)
    for key, (dtype, key_shape) in expected.items():
        assert batch.get(key).dtype == dtype, key
        assert batch.get(key).shape == key_shape, key
    # The root done family describes s_t: never done, since ended rows are reset at once.
    for name in ("done", "terminated", "truncated"):
        assert not batch[name].any()
    assert (batch["next", "reward"] == 1.0).all()
    assert (batch[POLICY_VERSION] == 0).all()


# -- continuity ----------------------------------------------------------------------------------
def test_counting_env_exact_stream(make_collector):
    c = make_collector(CountingEnv(max_steps=5, batch_size=[2]), frames_per_batch=14)
    batch = next(c)
    for row in range(2):
        assert obs(batch)[row].tolist() == [0, 1, 2, 3, 4, 0, 1]
        assert next_obs(batch)[row].tolist() == [1, 2, 3, 4, 5, 1, 2]
        assert flag(batch, ("next", "terminated"))[row].tolist() == [False] * 4 + [True, False, False]
        assert flag(batch, ("next", "done"))[row].tolist() == [False] * 4 + [True, False, False]
        assert not flag(batch, ("next", "truncated"))[row].any()
    # The next batch picks up where this one stopped.
    assert obs(next(c))[0].tolist() == [2, 3, 4, 0, 1, 2, 3]


def check_continuity(td, reset_obs=None):
    """Within a trajectory next obs[t] == obs[t+1] and the id stays; after a done the id changes
    (and the row holds ``reset_obs`` when given)."""
    rows = td.reshape(-1, td.shape[-1])
    done = flag(rows, ("next", "done"))
    ids = rows[TRAJ_IDS]
    nxt, cur = rows["next", "observation"], rows["observation"]
    ended = 0
    for r in range(rows.shape[0]):
        for t in range(rows.shape[1] - 1):
            if done[r, t]:
                ended += 1
                assert ids[r, t + 1] != ids[r, t]
                if reset_obs is not None:
                    assert torch.equal(cur[r, t + 1], torch.as_tensor(reset_obs, dtype=cur.dtype))
            else:
                assert ids[r, t + 1] == ids[r, t]
                assert torch.equal(nxt[r, t], cur[r, t + 1])
    return ended


def test_continuity_counting_env_across_batches(make_collector):
    c = make_collector(CountingEnv(max_steps=4, batch_size=[3]), frames_per_batch=15)
    stream = cat_time(take(c, 3))
    assert check_continuity(stream, reset_obs=[0.0]) == 3 * 3  # 15 steps per row, done every 4


def test_continuity_cartpole_batched(make_collector):
    c = make_collector(GymEnv("CartPole-v1", num_envs=3), frames_per_batch=150)
    c.set_seed(0)
    stream = cat_time(take(c, 2))
    assert check_continuity(stream) > 0  # random CartPole episodes last ~20 steps


@pytest.mark.parametrize("batch_size", [None, [2]])
def test_stream_independent_of_frames_per_batch_counting(make_collector, batch_size):
    streams = []
    for frames in (4, 6, 12):
        c = make_collector(CountingEnv(max_steps=5, batch_size=batch_size), frames_per_batch=frames,
                           total_frames=24)
        streams.append(cat_time(list(c)))
    rows = 1 if batch_size is None else 2
    assert streams[0].shape[-1] == 24 // rows
    for other in streams[1:]:
        assert_td_equal(streams[0], other)
    first_row = streams[0] if batch_size is None else streams[0][0]
    assert obs(first_row).tolist() == [0, 1, 2, 3, 4] * (24 // rows // 5) + [0, 1, 2, 3, 4][: (24 // rows) % 5]


@pytest.mark.parametrize("num_envs", [None, 2])
def test_stream_independent_of_frames_per_batch_cartpole(make_collector, num_envs):
    streams = []
    for frames in (4, 6, 12):
        c = make_collector(GymEnv("CartPole-v1", num_envs=num_envs), frames_per_batch=frames, total_frames=120)
        assert c.set_seed(7) == 7 + (num_envs or 1)
        streams.append(cat_time(list(c)))
    assert flag(streams[0], ("next", "done")).any()  # the comparison crosses episode ends
    for other in streams[1:]:
        assert_td_equal(streams[0], other)


# -- trajectory ids --------------------------------------------------------------------------------
def test_traj_ids_exact_and_kept_across_batches(make_collector):
    c = make_collector(CountingEnv(max_steps=3, batch_size=[2]), frames_per_batch=10)
    first, second = take(c, 2)
    assert first[TRAJ_IDS].tolist() == [[0, 0, 0, 2, 2], [1, 1, 1, 3, 3]]
    # Trajectories 2 and 3 go on into the next batch with the same ids.
    assert second[TRAJ_IDS].tolist() == [[2, 4, 4, 4, 6], [3, 5, 5, 5, 7]]
    assert obs(second).tolist() == [[2, 0, 1, 2, 0]] * 2


def test_traj_ids_unbatched(make_collector):
    c = make_collector(CountingEnv(max_steps=2), frames_per_batch=5)
    assert next(c)[TRAJ_IDS].tolist() == [0, 0, 1, 1, 2]
    assert next(c)[TRAJ_IDS].tolist() == [2, 3, 3, 4, 4]


def test_traj_ids_unique_per_trajectory(make_collector):
    c = make_collector(GymEnv("CartPole-v1", num_envs=3), frames_per_batch=90)
    c.set_seed(1)
    stream = cat_time(take(c, 3))
    ids = stream[TRAJ_IDS]
    for traj in ids.unique():
        rows, times = (ids == traj).nonzero(as_tuple=True)
        assert rows.unique().numel() == 1, "a trajectory id appears in two env rows"
        assert (times.diff() == 1).all(), "a trajectory's frames are not contiguous in time"


def test_reset_starts_new_ids(make_collector):
    c = make_collector(CountingEnv(max_steps=10, batch_size=[2]), frames_per_batch=4)
    first = next(c)
    assert first[TRAJ_IDS].tolist() == [[0, 0], [1, 1]]
    assert obs(next(c)).tolist() == [[2, 3], [2, 3]]
    c.reset()
    third = next(c)
    assert obs(third).tolist() == [[0, 1], [0, 1]]
    assert third[TRAJ_IDS].tolist() == [[2, 2], [3, 3]]


def test_reset_at_each_iter_starts_new_ids(make_collector):
    c = make_collector(CountingEnv(max_steps=10, batch_size=[2]), frames_per_batch=6, reset_at_each_iter=True)
    first, second, third = take(c, 3)
    for batch in (first, second, third):
        assert obs(batch).tolist() == [[0, 1, 2]] * 2
    assert first[TRAJ_IDS].tolist() == [[0, 0, 0], [1, 1, 1]]
    assert second[TRAJ_IDS].tolist() == [[2, 2, 2], [3, 3, 3]]
    assert third[TRAJ_IDS].tolist() == [[4, 4, 4], [5, 5, 5]]


@pytest.mark.parametrize("worker_idx", [0, 1, 3])
def test_worker_idx_offsets_ids(make_collector, worker_idx):
    c = make_collector(CountingEnv(max_steps=3, batch_size=[2]), frames_per_batch=10, worker_idx=worker_idx)
    base = worker_idx * TRAJ_ID_BLOCK
    assert TRAJ_ID_BLOCK == 2**40
    assert (next(c)[TRAJ_IDS] - base).tolist() == [[0, 0, 0, 2, 2], [1, 1, 1, 3, 3]]


# -- max_frames_per_traj and set_truncated ------------------------------------------------------------
def test_max_frames_per_traj_truncates(make_collector):
    c = make_collector(CountingEnv(max_steps=None), frames_per_batch=10, max_frames_per_traj=4)
    first, second = take(c, 2)
    assert obs(first).tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    ends = [False, False, False, True] * 2 + [False, False]
    assert flag(first, ("next", "truncated")).tolist() == ends
    assert flag(first, ("next", "done")).tolist() == ends
    assert not flag(first, ("next", "terminated")).any()
    assert flag(first, "step_count").tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert flag(first, ("next", "step_count")).tolist() == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    assert first[TRAJ_IDS].tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    # The count carries over the batch boundary.
    assert flag(second, "step_count").tolist() == [2, 3, 0, 1, 2, 3, 0, 1, 2, 3]
    assert flag(second, ("next", "step_count")).tolist() == [3, 4, 1, 2, 3, 4, 1, 2, 3, 4]
    assert second[TRAJ_IDS].tolist() == [2, 2, 3, 3, 3, 3, 4, 4, 4, 4]


def test_max_frames_per_traj_with_termination_first(make_collector):
    # Episodes terminate after 3 steps, before the limit of 5: step_count restarts on termination.
    c = make_collector(CountingEnv(max_steps=3, batch_size=[2]), frames_per_batch=16, max_frames_per_traj=5)
    batch = next(c)
    assert flag(batch, "step_count").tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]] * 2
    assert not flag(batch, ("next", "truncated")).any()
    assert flag(batch, ("next", "terminated")).tolist() == [[False, False, True] * 2 + [False, False]] * 2


@pytest.mark.parametrize("batch_size", [None, [2]])
def test_set_truncated_ends_every_batch(make_collector, batch_size):
    frames = 4 if batch_size is None else 8
    c = make_collector(CountingEnv(max_steps=None, batch_size=batch_size), frames_per_batch=frames, set_truncated=True)
    for i in range(3):
        batch = next(c).reshape(-1, 4)
        for row in range(batch.shape[0]):
            assert obs(batch)[row].tolist() == [0, 1, 2, 3]  # each batch starts from a reset
            assert flag(batch, ("next", "truncated"))[row].tolist() == [False, False, False, True]
            assert flag(batch, ("next", "done"))[row].tolist() == [False, False, False, True]
            assert not flag(batch, ("next", "terminated"))[row].any()
            rows = batch.shape[0]
            assert batch[TRAJ_IDS][row].tolist() == [i * rows + row] * 4


def test_set_truncated_keeps_natural_ends(make_collector):
    c = make_collector(CountingEnv(max_steps=2), frames_per_batch=5, set_truncated=True)
    batch = next(c)
    assert obs(batch).tolist() == [0, 1, 0, 1, 0]
    assert flag(batch, ("next", "terminated")).tolist() == [False, True, False, True, False]
    assert flag(batch, ("next", "truncated")).tolist() == [False, False, False, False, True]
    assert batch[TRAJ_IDS].tolist() == [0, 0, 1, 1, 2]
    second = next(c)
    assert obs(second).tolist() == [0, 1, 0, 1, 0]
    assert second[TRAJ_IDS].tolist() == [3, 3, 4, 4, 5]


def test_set_truncated_needs_a_truncated_key():
    env = DuckCountingEnv(batch_size=[2], with_truncated=False)
    with pytest.raises(RuntimeError, match="truncated"):
        Collector(env, frames_per_batch=4, set_truncated=True)
    assert env.closed == 1  # the failed construction released the env


def test_env_without_truncated_key_works(make_collector):
    c = make_collector(DuckCountingEnv(batch_size=[2], max_steps=2, with_truncated=False), frames_per_batch=8)
    batch = next(c)
    assert leaf_keys(batch) == BASE_KEYS
    assert not batch["next", "truncated"].any()
    assert flag(batch, ("next", "done")).tolist() == [[False, True] * 2, [False, False, True, False]]


def test_a_dropped_collector_is_freed_at_once():
    """Its collaborators (weights, profiler) hold no reference back to it: dropping the last
    reference frees it (and closes its env) without waiting for a garbage collection."""
    collector = Collector(CountingEnv(), frames_per_batch=4)
    ref = weakref.ref(collector)
    gc.disable()
    try:
        del collector
        assert ref() is None
    finally:
        gc.enable()
