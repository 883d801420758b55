"""on_worker_failure="restart": every fault kind is detected and the worker replaced, sync
batches stay whole and single-version, nothing is duplicated, ids never collide (SPEC 9)."""

from __future__ import annotations

import functools
import os
import random
import signal
import time

import numpy as np
import pytest
from mp_helpers import (BLOCK, POLICY_VERSION, START, TRAJ_IDS, WORKER_ID, SubclassedCollector, ValuePolicy,
                        assert_gone, check_counting_stream, rows_of)

from rlcollect import FaultyEnv, GymEnv, MultiAsyncCollector, MultiSyncCollector, WorkerError
from rlcollect.multiprocess.slots import STACKED_SLOTS

pytestmark = pytest.mark.timeout(120)
#: The env of the tests that kill workers themselves: 2 CartPole envs per worker.
CARTPOLE2 = functools.partial(GymEnv, "CartPole-v1", num_envs=2)


def transient(tmp_path, fault: str, at_step: int = 7, worker: int = 1, **kwargs):
    """A FaultyEnv factory whose fault fires once in total (the count survives the restart)."""
    return functools.partial(FaultyEnv, fault, at_step=at_step, worker_ids=[worker], times=1,
                             counter_file=str(tmp_path / f"{fault}.count"), max_steps=4, **kwargs)


@pytest.mark.parametrize("fault", ["raise", "exit", "kill", "segfault"])
def test_sync_restart_after_each_fault_kind(tmp_path, fault):
    env = transient(tmp_path, fault)
    collector = MultiSyncCollector(env, ValuePolicy(w=1), num_workers=2, frames_per_batch=20, total_frames=200,
                                   on_worker_failure="restart", track_policy_version=True, mp_start_method=START)
    first_pids = collector.worker_pids()
    try:
        batches = list(collector)
        stats = collector.stats()
        assert [w["restarts"] for w in stats["workers"]] == [0, 1] and stats["restarts"] == 1
        assert stats["frames"] == 200 and sum(b.numel() for b in batches) == 200
        for batch in batches:  # whole batches: no invalid frame, one version, a valid stream per row
            assert batch.shape == (2, 10)
            assert (batch[TRAJ_IDS] >= 0).all()
            assert batch[POLICY_VERSION].unique().tolist() == [0]
        assert collector.worker_pids()[1] != first_pids[1]
        # worker 0 never failed: its stream is continuous across every batch
        for row in rows_of(batches[0][0:1]):
            check_counting_stream(row, 4)
        ids = np.concatenate([b[TRAJ_IDS][1].numpy() for b in batches])
        restarted = ids[ids >= (1 << 16) * BLOCK]
        assert restarted.size > 0, "the restarted worker draws ids from a fresh block"
        # worker 0's block and the replacement's; the failed worker's partial batch was discarded
        all_ids = np.concatenate([b[TRAJ_IDS].reshape(-1).numpy() for b in batches])
        assert set(np.unique(all_ids // BLOCK).tolist()) == {0, 1 + (1 << 16)}
    finally:
        collector.shutdown()
    assert_gone(first_pids)


def test_a_collector_subclass_in_the_workers_gets_a_fresh_trajectory_id_block_after_a_restart(tmp_path):
    # The wings once told a single-process collector by identity (``collector_class is Collector``):
    # a subclass was refused ("runs its own workers") and, past that, got no fresh id block.
    collector = MultiSyncCollector(transient(tmp_path, "kill"), ValuePolicy(w=1), num_workers=2, frames_per_batch=20,
                                   total_frames=200, collector_class=SubclassedCollector,
                                   on_worker_failure="restart", mp_start_method=START)
    try:
        batches = list(collector)
        assert collector.config.collector_class is SubclassedCollector and collector.stats()["restarts"] == 1
        all_ids = np.concatenate([b[TRAJ_IDS].reshape(-1).numpy() for b in batches])
        assert set(np.unique(all_ids // BLOCK).tolist()) == {0, 1 + (1 << 16)}
    finally:
        collector.shutdown()


def test_sync_batch_after_restart_uses_current_weights(tmp_path):
    policy = ValuePolicy(w=1)
    collector = MultiSyncCollector(transient(tmp_path, "kill", at_step=15), policy, num_workers=2, frames_per_batch=20,
                                   on_worker_failure="restart", track_policy_version=True, mp_start_method=START)
    try:
        first = next(collector)
        assert first["action"].unique().tolist() == [1]
        collector.update_policy_weights_({"w": policy.w.detach() * 0 + 3, "b": policy.b})
        second = next(collector)  # worker 1 dies during this batch and is replaced
        assert collector.stats()["restarts"] == 1
        assert second["action"].unique().tolist() == [3]
        assert second[POLICY_VERSION].unique().tolist() == [1]
    finally:
        collector.shutdown()


def test_hang_is_detected_by_worker_timeout_and_restarted(tmp_path):
    env = transient(tmp_path, "hang", at_step=5, worker=0)
    with MultiSyncCollector(env, num_workers=2, frames_per_batch=20, total_frames=80, on_worker_failure="restart",
                            worker_timeout=2.0, mp_start_method=START) as collector:
        batches = list(collector)
        assert sum(b.numel() for b in batches) == 80
        assert [w["restarts"] for w in collector.stats()["workers"]] == [1, 0]


def test_async_restart_discards_the_lost_partial_batch(tmp_path):
    env = transient(tmp_path, "kill", at_step=7)
    with MultiAsyncCollector(env, num_workers=2, frames_per_batch=10, total_frames=200, on_worker_failure="restart",
                             mp_start_method=START) as collector:
        batches = list(collector)
        assert collector.stats()["restarts"] == 1
        assert sum(b.numel() for b in batches) == collector.stats()["frames"] == 200
        for batch in batches:  # every delivered batch is a whole, valid one
            assert batch.shape == (10,) and (batch[TRAJ_IDS] >= 0).all()
        from_worker1 = [b for b in batches if b[WORKER_ID][0] == 1]
        ids = np.concatenate([b[TRAJ_IDS].numpy() for b in from_worker1])
        assert (ids >= (1 << 16) * BLOCK).any(), "batches from the replacement were delivered"
        # no frame twice: (trajectory id, count) pairs are unique
        pairs = [(int(i), float(o)) for b in batches for i, o in zip(b[TRAJ_IDS], b["observation"][:, 0])]
        assert len(pairs) == len(set(pairs))


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector], ids=lambda c: c.__name__)
def test_a_recurring_fault_stops_after_max_worker_restarts(cls):
    env = functools.partial(FaultyEnv, "raise", at_step=3, worker_ids=[0])
    collector = cls(env, num_workers=2, frames_per_batch=10, on_worker_failure="restart", max_worker_restarts=2,
                    mp_start_method=START)
    try:
        with pytest.raises(WorkerError, match="max_worker_restarts=2") as info:
            for _ in range(50):
                next(collector)
        assert info.value.worker_index == 0
        assert "InjectedFault" in str(info.value)
    finally:
        collector.shutdown()


def test_restart_arguments_are_validated():
    with pytest.raises(ValueError, match="on_worker_failure"):
        MultiSyncCollector(FaultyEnv, num_workers=1, frames_per_batch=4, on_worker_failure="retry")
    with pytest.raises(ValueError, match="max_worker_restarts"):
        MultiSyncCollector(FaultyEnv, num_workers=1, frames_per_batch=4, max_worker_restarts=-1)


def test_async_hang_is_caught_while_the_other_worker_keeps_delivering(tmp_path):
    env = transient(tmp_path, "hang", at_step=5, worker=0)
    with MultiAsyncCollector(env, num_workers=2, frames_per_batch=10, on_worker_failure="restart",
                             worker_timeout=2.0, mp_start_method=START) as collector:
        started, from_worker1 = time.monotonic(), 0
        for batch in collector:  # endless: worker 1 never stops delivering
            from_worker1 += int(batch[WORKER_ID][0] == 1)
            if collector.stats()["restarts"] == 1 or time.monotonic() - started > 30:
                break
        assert [w["restarts"] for w in collector.stats()["workers"]] == [1, 0]
        assert from_worker1 > 10, "worker 1 kept delivering while worker 0 hung"


def test_a_restarted_worker_keeps_its_handle_through_each_state(tmp_path):
    """The pool's member is one WorkerHandle across restarts (serving -> failed -> restarting ->
    starting -> serving, a new incarnation), re-attached to the same slots; closed at shutdown."""
    from rlcollect.multiprocess.handle import WorkerState

    collector = MultiSyncCollector(transient(tmp_path, "kill"), ValuePolicy(w=1), num_workers=2, frames_per_batch=20,
                                   on_worker_failure="restart", mp_start_method=START)
    handles = list(collector._pool.handles)
    attached = handles[1].attachment
    pids = collector.worker_pids()
    try:
        assert [h.state for h in handles] == [WorkerState.SERVING] * 2
        for _ in range(3):
            next(collector)
        assert collector._pool.handles == handles  # the same objects
        assert [h.incarnation for h in handles] == [0, 1]
        assert [h.state for h in handles] == [WorkerState.SERVING] * 2
        assert handles[1].attachment is not None and handles[1].attachment[0] is attached[0]
        pids += collector.worker_pids()[1:]
    finally:
        collector.shutdown()
    assert [h.state for h in handles] == [WorkerState.CLOSED] * 2
    assert_gone(pids)


@pytest.mark.parametrize("inference", ["worker", "central"])
def test_a_worker_killed_while_handed_the_reserve_slot_is_restarted(inference):
    """The user holds both batch slots, so the collector hands every worker the reserve; worker 0
    is SIGKILLed just before it is asked to take it. Its replacement gets the reserve and the
    batch comes whole (this phase used to raise the WorkerError instead)."""
    collector = MultiSyncCollector(CARTPOLE2, ValuePolicy(w=1), num_workers=2, frames_per_batch=40,
                                   on_worker_failure="restart", inference=inference, mp_start_method=START)
    pool, victims = collector._pool, []
    attach = pool.attach

    def kill_then_attach(index, slots, *rest):
        if index == 0 and len(slots) > STACKED_SLOTS and not victims:  # the first hand-over of the reserve
            victims.append(pool.handles[0].process.pid)
            os.kill(victims[0], signal.SIGKILL)
            pool.handles[0].process.join(5)
        attach(index, slots, *rest)

    pool.attach = kill_then_attach
    try:
        held = [next(collector) for _ in range(STACKED_SLOTS)]  # both slots stay referenced
        third = next(collector)  # collected into the reserve
        assert victims and collector.stats()["restarts"] == 1
        assert pool.pids()[0] != victims[0]
        shape = (2, 2, 10) if inference == "worker" else (2, 4, 5)  # (central: env_splits=2 copies of the env)
        assert third.shape == held[0].shape == shape and (third[TRAJ_IDS] >= 0).all()
        assert next(collector).shape == shape  # and the replacement goes on collecting
    finally:
        del pool.attach
        collector.shutdown()
    assert_gone(victims)


@pytest.mark.parametrize("inference", ["worker", "central"])
def test_a_sync_worker_killed_between_two_batches_is_restarted(inference):
    """Worker 1 dies after delivering a batch, before it is asked for the next one: asking it
    finds its pipe broken, and it is replaced before the batch starts (this used to raise)."""
    collector = MultiSyncCollector(CARTPOLE2, ValuePolicy(w=1),
                                   num_workers=2, frames_per_batch=40, on_worker_failure="restart",
                                   inference=inference, mp_start_method=START)
    victim = collector._pool.handles[1].process
    pids = [victim.pid]
    try:
        first = next(collector)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(5)
        second = next(collector)
        assert collector.stats()["restarts"] == 1 and second.shape == first.shape
        assert (second[TRAJ_IDS] >= 0).all()
        pids += collector.worker_pids()
    finally:
        collector.shutdown()
    assert_gone(pids)


@pytest.mark.parametrize("inference", ["worker", "central"])
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_workers_killed_at_random_moments_are_each_restarted(cls, inference):
    """Twelve SIGKILLs at seeded random moments (between batches, mid-step, while batches are
    held so the sync collector hands out its reserve slot): each is noticed and replaced, every
    batch is whole, and nothing is left behind."""
    rng = random.Random(12)
    collector = cls(CARTPOLE2, ValuePolicy(w=1), num_workers=2,
                    frames_per_batch=40, on_worker_failure="restart", max_worker_restarts=20, inference=inference,
                    mp_start_method=START)
    it, held, pids = iter(collector), [], []
    shape = next(it).shape
    try:
        for kill in range(12):
            victim = collector._pool.handles[rng.randrange(2)].process
            pids.append(victim.pid)
            end = time.monotonic() + rng.random() * 0.05
            while time.monotonic() < end:
                batch = next(it)
                if rng.random() < 0.3:
                    held = [*held[-2:], batch]  # held batches: the sync collector's reserve slot
            os.kill(victim.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while collector.stats()["restarts"] < kill + 1:  # noticed within a few batches
                assert time.monotonic() < deadline, f"kill {kill} was not noticed"
                batch = next(it)
                assert batch.shape[-1] == shape[-1] and (batch[TRAJ_IDS] >= 0).all()
        assert collector.stats()["restarts"] == 12
        pids += collector.worker_pids()
    finally:
        collector.shutdown()
    assert_gone(pids)
