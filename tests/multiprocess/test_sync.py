"""MultiSyncCollector (SPEC 1 shapes, SPEC 5): layouts for each cat_results, per-worker lists,
trajectory ids, continuity, len/total_frames, seeding, state, reset, weights between batches,
update_at_each_batch, preemption, getattr_*, stats and the main process's threads."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from mp_helpers import (
    BLOCK,
    MASK,
    POLICY_VERSION,
    TRAJ_IDS,
    ListBuffer,
    ValuePolicy,
    assert_td_equal,
    check_counting_stream,
    concat_rows,
    make_multi,  # noqa: F401  (fixture)
    counting3,
    counting5,
    rows_of,
    running,
    slow_env,
    take,
    weights,
)

from rlcollect import MultiSyncCollector

pytestmark = pytest.mark.timeout(90)


# -- one collector, run to the end, shared by the layout tests ------------------------------------
@pytest.fixture(scope="module")
def stacked():
    """2 workers, each a CountingEnv(max_steps=5) with batch_size [2]; 12 frames per batch
    (6 per worker: T=3), 48 frames in all, iterated to the end."""
    with running(MultiSyncCollector, counting5, num_workers=2, frames_per_batch=12, total_frames=48,
                 create_env_kwargs={"batch_size": [2]}) as collector:
        batches = list(collector)
        yield collector, batches


def test_stack_shape_is_workers_env_batch_time(stacked):
    _, batches = stacked
    assert len(batches) == 4
    for batch in batches:
        assert batch.shape == torch.Size([2, 2, 3])
        assert batch.names[-1] == "time"
        assert batch["observation"].shape == torch.Size([2, 2, 3, 1])
        assert batch["next", "reward"].shape == torch.Size([2, 2, 3, 1])
        assert batch[TRAJ_IDS].dtype == torch.int64
        assert MASK not in batch.keys(include_nested=True)


def test_root_done_flags_are_written_not_left_as_slot_poison(stacked):
    # Regression: the rollout never wrote the root done family, so stacked batches showed the
    # shared slot's poison bytes (True) there. Those flags describe states that go on.
    _, batches = stacked
    for batch in batches:
        for name in ("done", "terminated", "truncated"):
            assert not batch[name].any(), name
    assert any(batch["next", "done"].any() for batch in batches)  # trajectories did end


def test_len_and_total_frames_stop_iteration(stacked):
    collector, batches = stacked
    assert len(collector) == 4 == len(batches)
    assert collector.stats()["frames"] == 48
    assert list(collector) == []  # already at total_frames


def test_traj_ids_unique_across_workers(stacked):
    _, batches = stacked
    for batch in batches:
        ids0, ids1 = batch[0][TRAJ_IDS], batch[1][TRAJ_IDS]
        assert (ids0 >= 0).all() and (ids0 < BLOCK).all()
        assert (ids1 >= BLOCK).all() and (ids1 < 2 * BLOCK).all()
    owner = {}
    for batch in batches:
        for w in range(2):
            for r in range(2):
                for i in batch[w, r][TRAJ_IDS].tolist():
                    assert owner.setdefault(i, (w, r)) == (w, r), f"trajectory id {i} used by two env rows"


def test_each_worker_stream_is_continuous_across_batches(stacked):
    _, batches = stacked
    for w in range(2):
        for r in range(2):
            row = concat_rows([rows_of(batch[w, r].unsqueeze(0))[0] for batch in batches])
            assert row["obs"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
            check_counting_stream(row, max_steps=5)


def test_stats_are_json_with_exact_frames(stacked):
    collector, _ = stacked
    stats = json.loads(json.dumps(collector.stats()))
    assert stats["frames"] == 48
    assert stats["batches"] == 4
    assert [w["frames"] for w in stats["workers"]] == [24, 24]
    assert [w["alive"] for w in stats["workers"]] == [True, True]
    assert stats["policy_version"] == 0


def test_getattr_env_and_rb(stacked):
    collector, _ = stacked
    assert collector.getattr_env("max_steps") == 5
    assert collector.getattr_env("batch_size") == torch.Size([2])
    with pytest.raises(AttributeError, match="no_such_attribute") as info:
        collector.getattr_env("no_such_attribute")
    assert "worker 0" in str(info.value)
    with pytest.raises(RuntimeError, match="replay_buffer"):
        collector.getattr_rb("frames")
    assert collector.getattr_env("max_steps") == 5  # still usable after an error reply


# -- other layouts ------------------------------------------------------------------------------------
def test_frames_not_divisible_by_workers_warns_and_rounds_up(make_multi):
    with pytest.warns(UserWarning, match="not divisible"):
        collector = make_multi(MultiSyncCollector, counting5, num_workers=2, frames_per_batch=7)
    assert next(collector).shape == torch.Size([2, 4])
    assert collector.stats()["frames"] == 8


def test_cat_results_0_with_per_worker_frames_and_env_kwargs(make_multi):
    # Worker 0: 2 env rows x T=2 (4 frames); worker 1: 3 rows x T=2 (6 frames).
    collector = make_multi(MultiSyncCollector, counting5, num_workers=2, frames_per_batch=[4, 6], cat_results=0,
                           create_env_kwargs=[{"batch_size": [2]}, {"batch_size": [3]}])
    assert collector.frames_per_batch == 10
    first, second = take(collector, 2)
    assert first.shape == second.shape == torch.Size([5, 2])
    assert first.names[-1] == "time"
    assert (first[:2][TRAJ_IDS] < BLOCK).all() and (first[2:][TRAJ_IDS] >= BLOCK).all()
    assert first["observation"][..., 0].tolist() == [[0, 1]] * 5
    assert second["observation"][..., 0].tolist() == [[2, 3]] * 5
    for r in range(5):
        check_counting_stream(concat_rows([rows_of(first[r:r + 1])[0], rows_of(second[r:r + 1])[0]]), max_steps=5)
    assert collector.stats()["frames"] == 20


def test_cat_results_minus1_with_one_env_factory_per_worker(make_multi):
    # Worker 0: CountingEnv(max_steps=5), 3 frames; worker 1: CountingEnv(max_steps=3), 5 frames.
    collector = make_multi(MultiSyncCollector, [counting5, counting3], frames_per_batch=[3, 5], cat_results=-1)
    assert collector.num_workers == 2
    first, second = take(collector, 2)
    assert first.shape == second.shape == torch.Size([8])
    assert first.names == ["time"]
    b = BLOCK
    assert first["observation"][:, 0].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert first[TRAJ_IDS].tolist() == [0, 0, 0, b, b, b, b + 1, b + 1]
    assert second["observation"][:, 0].tolist() == [3, 4, 0, 2, 0, 1, 2, 0]
    assert second[TRAJ_IDS].tolist() == [0, 0, 1, b + 1, b + 2, b + 2, b + 2, b + 3]
    assert first["next", "done"][:, 0].tolist() == [False] * 5 + [True, False, False]
    assert collector.stats()["frames"] == 16


# -- seeding, state, reset --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cartpoles():
    """Two alike collectors: CartPole, random policy, 2 workers, 20 frames per batch."""
    with running(MultiSyncCollector, "CartPole-v1", num_workers=2, frames_per_batch=20) as a, \
            running(MultiSyncCollector, "CartPole-v1", num_workers=2, frames_per_batch=20) as b:
        yield a, b


def test_set_seed_chains_through_workers_and_reproduces(cartpoles):
    a, b = cartpoles
    # Worker 0 gets 7 and returns 8, worker 1 gets 8 and returns 9 (one env row each).
    assert a.set_seed(7) == 9
    assert b.set_seed(7) == 9
    batches_a, batches_b = take(a, 2), take(b, 2)
    for x, y in zip(batches_a, batches_b):
        assert x.shape == torch.Size([2, 10])
        assert_td_equal(x, y)
    assert not torch.equal(batches_a[0][0]["observation"], batches_a[0][1]["observation"])
    assert b.set_seed(100) == 102
    with pytest.raises(TypeError, match="seed"):
        b.set_seed(True)
    assert not torch.equal(next(b)["observation"], next(a)["observation"])


def test_state_dict_round_trip_continues_the_stream(cartpoles):
    a, b = cartpoles
    a.set_seed(3)
    take(a, 2)
    state = a.state_dict()
    assert set(state) == {"worker0", "worker1", "frames", "iter", "traj_pool", "policy_version"}
    frames = a.stats()["frames"]
    assert state["frames"] == frames
    reference = take(a, 2)
    b.set_seed(1234)
    take(b, 1)  # b is somewhere else entirely before the load
    b.load_state_dict(state)
    assert b.stats()["frames"] == frames
    for x, y in zip(reference, take(b, 2)):
        assert_td_equal(x, y)


def test_reset_starts_new_trajectory_ids(cartpoles):
    a, _ = cartpoles
    before = next(a)
    a.reset()
    after = next(a)
    for w in range(2):
        assert after[w][TRAJ_IDS][0] > before[w][TRAJ_IDS].max()
        assert (after[w][TRAJ_IDS] >= w * BLOCK).all() and (after[w][TRAJ_IDS] < (w + 1) * BLOCK).all()


def test_bad_load_state_dict_raises_and_leaves_the_collector_usable(cartpoles):
    a, _ = cartpoles
    with pytest.raises(TypeError, match="state_dict"):
        a.load_state_dict([1, 2])
    with pytest.raises(KeyError, match="worker1"):
        a.load_state_dict({"worker0": {}, "frames": 0, "iter": 0})
    state = a.state_dict()
    state["worker1"] = {**state["worker1"], "rollout": {"bogus": 1}}
    with pytest.raises(KeyError, match="rollout state is missing") as info:
        a.load_state_dict(state)
    assert "worker 1" in str(info.value)
    assert next(a).shape == torch.Size([2, 10])


# -- weights between batches ----------------------------------------------------------------------------
def test_every_frame_of_the_next_batch_uses_the_new_weights(make_multi):
    collector = make_multi(MultiSyncCollector, counting5, ValuePolicy(), num_workers=2, frames_per_batch=8,
                           track_policy_version=True)
    first = next(collector)
    assert (first[POLICY_VERSION] == 0).all() and (first["action"] == 0).all()
    collector.update_policy_weights_(weights(3))
    assert collector.worker_policy_versions() == [1, 1]
    second = next(collector)
    assert second.shape == torch.Size([2, 4])
    assert (second[POLICY_VERSION] == 1).all(), second[POLICY_VERSION]
    assert (second["action"] == 3).all(), second["action"]
    collector.update_policy_weights_(weights(4))
    third = next(collector)
    assert (third[POLICY_VERSION] == 2).all() and (third["action"] == 4).all()
    assert collector.getattr_policy("w").tolist() == [4.0]
    assert collector.stats()["policy_version"] == 2


def test_update_at_each_batch_pushes_the_main_policy_before_every_batch(make_multi):
    policy, buffer = ValuePolicy(w=1), ListBuffer()
    collector = make_multi(MultiSyncCollector, counting5, policy, num_workers=2, frames_per_batch=8, total_frames=24,
                           update_at_each_batch=True, track_policy_version=True, replay_buffer=buffer)
    results = []
    for expected_w, out in zip((2, 5, 7), collector):
        results.append(out)
        with torch.no_grad():
            policy.w.fill_(expected_w)  # no explicit update: the next batch pushes it
    assert results == [None, None, None]
    assert len(buffer.batches) == 6  # each worker's batch extended on its own, as torchrl's workers do
    for version, action in enumerate((1, 2, 5), start=1):
        for batch in buffer.batches[2 * version - 2 : 2 * version]:
            assert (batch[POLICY_VERSION] == version).all(), batch[POLICY_VERSION]
            assert (batch["action"] == action).all(), batch["action"]
    assert collector.getattr_rb("frames") == 24
    assert collector.stats()["frames"] == 24


# -- preemption ------------------------------------------------------------------------------------------
SLOW_STEP_S = 0.5


def _preemptive(make_multi, **kwargs):
    # Worker 0 fills its 8 steps in ~10 ms; worker 1 would need 8 x 0.5 s.
    return make_multi(MultiSyncCollector, [slow_env, slow_env], frames_per_batch=16, preemptive_threshold=0.5,
                      create_env_kwargs=[{"step_time": 0.001}, {"step_time": SLOW_STEP_S}], **kwargs)


def test_preemption_masks_the_slow_workers_tail_and_counts_valid_frames(make_multi):
    before = torch.get_num_threads()
    threads = 1 if before != 1 else 2
    collector = _preemptive(make_multi, num_threads=threads)
    assert torch.get_num_threads() == threads
    started = time.monotonic()
    first = next(collector)
    assert time.monotonic() - started < 8 * SLOW_STEP_S - 1, "the slow worker was not preempted"
    second = next(collector)
    assert first.shape == second.shape == torch.Size([2, 8])
    frames = 0
    for batch in (first, second):
        mask = batch[MASK]
        assert mask[0].all()
        valid = int(mask[1].sum())
        assert valid < 8
        assert mask[1, :valid].all() and not mask[1, valid:].any()
        assert (batch[1][TRAJ_IDS][valid:] == -1).all()
        assert (batch[1][TRAJ_IDS][:valid] >= BLOCK).all()
        frames += 8 + valid
    assert collector.stats()["frames"] == frames
    # The slow worker's valid frames continue where they stopped (SleepEnv counts up forever).
    slow = np.concatenate([b[1]["observation"][:, 0][b[1][MASK]].numpy() for b in (first, second)])
    np.testing.assert_array_equal(slow, np.arange(len(slow)))
    collector.shutdown()
    assert torch.get_num_threads() == before


def test_preemption_with_integer_cat_results_drops_invalid_frames(make_multi):
    collector = _preemptive(make_multi, cat_results=-1)
    batch = next(collector)
    assert MASK not in batch.keys(include_nested=True)
    assert 8 <= batch.shape[0] < 16
    assert (batch[TRAJ_IDS] != -1).all()
    assert (batch[TRAJ_IDS][:8] < BLOCK).all() and (batch[TRAJ_IDS][8:] >= BLOCK).all()
    assert batch["observation"][:, 0].tolist() == list(range(8)) + list(range(batch.shape[0] - 8))
    assert collector.stats()["frames"] == batch.shape[0]
