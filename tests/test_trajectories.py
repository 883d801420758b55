"""Batches of whole trajectories (torchrl 0.14's ``trajs_per_batch``, ``traj_format``,
``trajs_per_write``; issue 28) on ``Collector`` and the multi-process collectors: every row (or
every ``"cat"`` segment) is one trajectory, from its first step to the step that ended it, even
when it spans several collections; with a replay buffer, whole trajectories are written flat.
The comparison with torchrl's own collector is in tests/torchrl/test_torchrl_trajectories.py."""

from __future__ import annotations

import time

import pytest
from loadscale import scaled
import torch

from rlcollect import Collector, MultiAsyncCollector, MultiSyncCollector, ReplayBuffer, SerialEnv
from rlcollect.envs import GymEnv

pytestmark = pytest.mark.timeout(120)


def rows_of(batch):
    """Each row of a padded batch as (trajectory ids, dones) over its real steps; checks the mask."""
    mask = batch["collector", "mask"]
    assert mask.dtype == torch.bool and mask.shape == batch.shape
    out = []
    for r in range(batch.shape[0]):
        length = int(mask[r].sum())
        assert length > 0 and mask[r, :length].all() and not mask[r, length:].any()  # real steps first
        out.append((batch["collector", "traj_ids"][r, :length], batch["next", "done"][r, :length, 0]))
    return out


def check_whole(ids, done):
    """One trajectory, ended by its last step only."""
    assert (ids == ids[0]).all()
    assert bool(done[-1]) and not done[:-1].any()


def test_padded_batches_hold_whole_trajectories_spanning_collections():
    c = Collector("CartPole-v1", frames_per_batch=7, total_frames=700, trajs_per_batch=3)
    c.set_seed(0)
    lengths, seen = [], set()
    for batch in c:
        assert batch.shape[0] == 3 and batch.shape[1] == int(batch["collector", "mask"].sum(1).max())
        for ids, done in rows_of(batch):
            check_whole(ids, done)
            assert int(ids[0]) not in seen  # each trajectory once
            seen.add(int(ids[0]))
            lengths.append(len(ids))
    c.shutdown()
    assert len(lengths) % 3 == 0 and len(lengths) >= 6
    assert max(lengths) > 7  # some spanned two collections or more
    assert sum(lengths) <= 700


def test_cat_batches_concatenate_whole_trajectories_in_the_order_they_ended():
    c = Collector("CartPole-v1", frames_per_batch=16, total_frames=800, trajs_per_batch=4, traj_format="cat")
    c.set_seed(1)
    batches = list(c)
    c.shutdown()
    assert batches
    for batch in batches:
        assert batch.batch_dims == 1 and ("collector", "mask") not in batch.keys(True)
        done = batch["next", "done"][:, 0]
        ends = done.nonzero().flatten().tolist()
        assert len(ends) == 4 and ends[-1] == batch.shape[0] - 1
        starts = [0] + [e + 1 for e in ends[:-1]]
        ids = batch["collector", "traj_ids"]
        for s, e in zip(starts, ends):
            check_whole(ids[s:e + 1], done[s:e + 1])
        assert ids[starts].tolist() == sorted(ids[starts].tolist())  # one env: ids grow as they end


def test_a_batched_env_files_each_rows_trajectories_apart():
    env = SerialEnv(3, lambda: GymEnv("CartPole-v1"))
    c = Collector(env, frames_per_batch=30, total_frames=1500, trajs_per_batch=5)
    c.set_seed(2)
    ids_seen = []
    for batch in c:
        for ids, done in rows_of(batch):
            check_whole(ids, done)
            ids_seen.append(int(ids[0]))
    c.shutdown()
    assert len(ids_seen) == len(set(ids_seen)) >= 10


def test_a_replay_buffer_gets_whole_trajectories_flat_and_iteration_yields_none():
    rb = ReplayBuffer(10_000)
    c = Collector("CartPole-v1", frames_per_batch=20, total_frames=400, trajs_per_batch=2, replay_buffer=rb)
    c.set_seed(3)
    yielded = list(c)
    c.shutdown()
    assert yielded == [None] * 20  # one None per collection, like torchrl
    stored = rb[: len(rb)]
    done = stored["next", "done"][:, 0]
    assert len(rb) < 400 and bool(done[-1])  # the unfinished tail was not written
    ends = done.nonzero().flatten().tolist()
    starts = [0] + [e + 1 for e in ends[:-1]]
    for s, e in zip(starts, ends):
        check_whole(stored["collector", "traj_ids"][s:e + 1], done[s:e + 1])


class CountingBuffer:
    """A user's buffer: anything with ``extend`` is accepted; this one counts the calls."""

    def __init__(self):
        self.calls = []

    def extend(self, data):
        self.calls.append(int(data["next", "done"].sum()))


@pytest.mark.parametrize("per_write", [None, 1])
def test_trajs_per_write_sets_the_trajectories_of_each_extend(per_write):
    rb = CountingBuffer()
    c = Collector("CartPole-v1", frames_per_batch=60, total_frames=600, trajs_per_batch=1, replay_buffer=rb,
                  trajs_per_write=per_write)
    c.set_seed(4)
    for _ in c:
        pass
    c.shutdown()
    if per_write == 1:
        assert set(rb.calls) == {1} and len(rb.calls) > 10
    else:
        assert max(rb.calls) > 1  # all that ended in a collection, in one call
        assert len(rb.calls) <= 10


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_the_multi_process_collectors_assemble_the_workers_trajectories(cls):
    c = cls("CartPole-v1", num_workers=2, frames_per_batch=40, total_frames=800, trajs_per_batch=4)
    ids_seen = []
    try:
        for batch in c:
            for ids, done in rows_of(batch):
                check_whole(ids, done)
                ids_seen.append(int(ids[0]))
    finally:
        c.shutdown()
    assert len(ids_seen) == len(set(ids_seen)) >= 8
    assert len({i >> 40 for i in ids_seen}) == 2  # both workers' id blocks


@pytest.mark.parametrize("make, batches", [
    (lambda: Collector("CartPole-v1", frames_per_batch=5, total_frames=-1, trajs_per_batch=1), 5),
    (lambda: MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=10, total_frames=-1,
                                trajs_per_batch=1, mp_start_method="fork"), 6),
    (lambda: MultiAsyncCollector("CartPole-v1", num_workers=2, frames_per_batch=10, total_frames=-1,
                                 trajs_per_batch=1, mp_start_method="fork"), 6),
], ids=["Collector", "MultiSyncCollector", "MultiAsyncCollector"])
def test_a_reset_drops_the_trajectories_it_cuts(make, batches):
    c = make()
    c.set_seed(5)
    try:
        it = iter(c)
        next(it)
        c.reset()  # whatever was running is cut: never yielded
        for _ in range(batches):
            for ids, done in rows_of(next(it)):
                check_whole(ids, done)
    finally:
        c.shutdown()


@pytest.mark.parametrize("kwargs, message", [
    (dict(trajs_per_batch=0), "trajs_per_batch must be None or a positive int, got 0"),
    (dict(trajs_per_batch=True), "trajs_per_batch must be None or a positive int, got True"),
    (dict(trajs_per_batch=2, traj_format="flat"), "traj_format must be None, 'padded' or 'cat', got 'flat'"),
    (dict(traj_format="cat"), "traj_format='cat' needs trajs_per_batch"),
    (dict(trajs_per_write=2), "trajs_per_write=2 needs trajs_per_batch"),
    (dict(trajs_per_batch=2, split_trajs=True), "split_trajs=True cannot be combined with trajs_per_batch"),
])
def test_bad_trajectory_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Collector("CartPole-v1", frames_per_batch=10, **kwargs)


def test_the_workers_own_buffer_is_refused_with_trajs_per_batch():
    with pytest.raises(ValueError, match="trajs_per_batch cannot be combined with an rlcollect ReplayBuffer"):
        MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=20, trajs_per_batch=2,
                           replay_buffer=ReplayBuffer(100))


def test_reset_at_each_iter_drops_the_trajectories_each_batch_cuts():
    c = Collector("CartPole-v1", frames_per_batch=12, total_frames=1200, trajs_per_batch=2, reset_at_each_iter=True)
    c.set_seed(6)
    lengths = [len(ids) for batch in c for ids, done in rows_of(batch) if check_whole(ids, done) is None]
    c.shutdown()
    assert lengths and max(lengths) <= 12  # none spans two batches: each batch starts fresh


def test_running_free_writes_whole_trajectories_into_the_buffer():
    rb = ReplayBuffer(50_000)
    c = Collector("CartPole-v1", frames_per_batch=20, trajs_per_batch=1, replay_buffer=rb)
    c.set_seed(7)
    c.start()
    deadline = time.monotonic() + scaled(60, cap=240)
    while rb.write_count < 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    c.async_shutdown()
    stored = rb[: len(rb)]
    rb.close()
    done = stored["next", "done"][:, 0]
    assert len(done) >= 200 and bool(done[-1])  # nothing lost, nothing unfinished written
    ends = done.nonzero().flatten().tolist()
    for s, e in zip([0] + [e + 1 for e in ends[:-1]], ends):
        check_whole(stored["collector", "traj_ids"][s:e + 1], done[s:e + 1])


def test_the_multi_process_collectors_refuse_to_run_free_with_trajs_per_batch():
    c = MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=20, trajs_per_batch=2,
                           replay_buffer=CountingBuffer())
    try:
        with pytest.raises(RuntimeError, match=r"start\(\) cannot assemble whole trajectories"):
            c.start()
    finally:
        c.shutdown()


def test_shutting_down_while_running_free_never_fails_on_its_own_closing():
    # The loop's next batch began after shutdown() had marked the collector closed: the batch
    # failed on "has been shut down" and async_shutdown() re-raised it (the loaded `make test`
    # of 2026-12-07). Many short runs, each stopped at a random point between batches.
    rb = ReplayBuffer(10_000)
    for i in range(150):
        c = Collector("CartPole-v1", frames_per_batch=1, replay_buffer=rb)
        c.start()
        time.sleep(0.0005 * (i % 5))
        c.async_shutdown()
    rb.close()
