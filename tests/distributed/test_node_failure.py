"""``on_node_failure``: a failed node dropped ("continue", async) or relaunched ("restart", with
the "mp" and "submitit" launchers), with exact counts of frames, restarts and lost batches."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from dist_helpers import BLOCK, NODE_ID, POLICY_VERSION, TRAJ_IDS, ValuePolicy, counting5, node_pids, wait_gone
from rlcollect import FaultyEnv, WorkerError
from rlcollect.distributed.collector import DistributedCollector

pytestmark = pytest.mark.timeout(240)
HELPERS = str(Path(__file__).resolve().parent)


def _batches_until(c, predicate, seconds: float = 60.0) -> list:
    """Batches of ``c`` up to and including the first that satisfies ``predicate`` (within
    ``seconds``: a relaunched node takes a few seconds to start)."""
    out = []
    deadline = time.monotonic() + seconds
    for batch in c:
        out.append(batch)
        if predicate(batch):
            return out
        assert time.monotonic() < deadline, f"the condition was not met within {seconds} s ({len(out)} batches)"
    raise AssertionError("the collector ended before the condition was met")


def test_continue_drops_a_killed_node_and_goes_on_with_the_others():
    c = DistributedCollector([counting5] * 2, None, frames_per_batch=10, total_frames=-1, sync=False,
                             on_node_failure="continue", timeout=120.0)
    try:
        # Both nodes deliver first.
        seen = set()
        _batches_until(c, lambda b: seen.add(int(b[NODE_ID].reshape(-1)[0])) or seen == {0, 1})
        pids = node_pids(c)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        # Node 1's batches still queued are delivered; then only node 0 delivers.
        batches = _batches_until(c, lambda b: c.stats()["dropped_nodes"] == [1])
        frames_at_drop = c.stats()["frames"]
        after = [b for _, b in zip(range(20), c)]
        assert time.monotonic() - killed < 20.0
        assert {int(b[NODE_ID].reshape(-1)[0]) for b in after} == {0}
        stats = c.stats()
        assert stats["frames"] == frames_at_drop + 20 * 10  # every delivered frame counted once
        assert stats["workers"][1]["state"] == "dropped" and stats["workers"][1]["alive"] is False
        assert stats["workers"][0]["state"] == "collecting" and stats["restarts"] == 0
        assert 0 <= stats["lost_batches"] <= 2  # what node 1 had in flight (two slots)
        assert stats["lost_batches"] == stats["workers"][1]["lost_batches"]
        assert len(batches) >= 1 and not wait_gone([pids[1]], timeout=5.0)
        # Control commands skip the dropped node.
        assert c.set_seed(3) is not None
        assert sorted(k for k in c.state_dict() if k.startswith("node")) == ["node0"]
    finally:
        c.shutdown()
    assert not wait_gone(pids)


def test_continue_raises_once_every_node_failed():
    c = DistributedCollector([counting5] * 2, None, frames_per_batch=10, total_frames=-1, sync=False,
                             on_node_failure="continue", timeout=120.0)
    try:
        next(iter(c))
        pids = node_pids(c)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerError, match="every node failed"):
            for _ in c:
                pass
    finally:
        c.shutdown()
    assert not wait_gone(pids)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_restart_relaunches_a_killed_node_which_rejoins_with_the_current_weights(sync):
    c = DistributedCollector([counting5] * 2, ValuePolicy(), frames_per_batch=20, total_frames=-1, sync=sync,
                             on_node_failure="restart", timeout=120.0, collector_kwargs={"track_policy_version": True})
    try:
        first = next(iter(c))
        c.update_policy_weights_(ValuePolicy(1.0))  # version 1: action 1 from now on
        version = c.policy_version
        old_ids = first[TRAJ_IDS]
        pids = node_pids(c)
        os.kill(pids[1], signal.SIGKILL)
        if sync:
            batches = _batches_until(c, lambda b: c.stats()["workers"][1]["pid"] != pids[1])
            for batch in batches:
                assert batch.shape == (2, 10)  # every batch holds a part from both nodes
            later = [b for _, b in zip(range(3), c)]
            for batch in later:
                assert (batch[POLICY_VERSION] == version).all() and (batch["action"] == 1).all()
            node1 = torch.cat([b[1][TRAJ_IDS].reshape(-1) for b in later])
        else:
            # The first batch of the relaunched node: its trajectory ids come from a fresh block.
            batches = _batches_until(c, lambda b: int(b[NODE_ID].reshape(-1)[0]) == 1
                                     and bool((b[TRAJ_IDS] >= 2 * BLOCK).all()))
            back = batches[-1]
            # It acts with the weights it was given before collecting.
            assert (back[POLICY_VERSION] == version).all() and (back["action"] == 1).all()
            node1 = back[TRAJ_IDS].reshape(-1)
        stats = c.stats()
        assert stats["restarts"] == 1 and [w["restarts"] for w in stats["workers"]] == [0, 1]
        assert stats["workers"][1]["state"] == "collecting" and stats["workers"][1]["alive"] is True
        assert c.worker_policy_versions() == [version, version]
        # The relaunched node draws trajectory ids from a block no earlier node used.
        assert (node1 >= 2 * BLOCK).all() and not set(node1.tolist()) & set(old_ids.reshape(-1).tolist())
        assert not wait_gone([pids[1]], timeout=5.0)
        new_pids = node_pids(c)
    finally:
        c.shutdown()
    assert not wait_gone([*pids, *new_pids])


@pytest.mark.parametrize("fault, at_step, options", [
    ("raise", 13, {}),
    # A hung env step: its heartbeat thread keeps beating, so only node_timeout can tell.
    ("hang", 15, {"node_timeout": 3.0}),
])
def test_restart_after_a_transient_fault_completes_with_exact_frames(tmp_path, fault, at_step, options):
    counter = str(tmp_path / "fired")
    # Node 1 fails at that step, once in total: its relaunched incarnation runs clean.
    faulty = functools.partial(FaultyEnv, fault, at_step=at_step, worker_ids=[1], times=1, counter_file=counter)
    c = DistributedCollector([faulty, faulty], None, frames_per_batch=20, total_frames=200, sync=True,
                             on_node_failure="restart", timeout=120.0, **options)
    try:
        pids = node_pids(c)
        started = time.monotonic()
        batches = list(c)
        assert time.monotonic() - started < 60.0
        assert [b.shape for b in batches] == [torch.Size([2, 10])] * 10
        assert sum(b.numel() for b in batches) == 200 == c.stats()["frames"]
        assert [w["restarts"] for w in c.stats()["workers"]] == [0, 1]
        assert os.path.getsize(counter) == 1  # the fault fired once
        # No part is duplicated: a (traj id, step count) pair appears once.
        pairs = torch.stack([torch.cat([b[TRAJ_IDS].reshape(-1) for b in batches]),
                             torch.cat([b["observation"][..., 0].reshape(-1) for b in batches]).long()], 1)
        assert len({tuple(p) for p in pairs.tolist()}) == 200
        assert not wait_gone([pids[1]], timeout=5.0)  # the failed (or hung) process was killed
        new_pids = node_pids(c)
    finally:
        c.shutdown()
    assert not wait_gone([*pids, *new_pids])


def test_a_node_that_keeps_failing_stops_after_max_node_restarts():
    faulty = functools.partial(FaultyEnv, "raise", at_step=3, worker_ids=[0])
    c = DistributedCollector([faulty], None, frames_per_batch=10, total_frames=-1, sync=False,
                             on_node_failure="restart", max_node_restarts=1, timeout=120.0)
    try:
        with pytest.raises(WorkerError, match=r"node 0 failed again after 1 restarts \(max_node_restarts=1\)"):
            for _ in c:
                pass
        assert c.stats()["restarts"] == 1
    finally:
        c.shutdown()


def test_restart_with_the_submitit_launcher(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", HELPERS)  # the jobs import dist_helpers, as a user's jobs import their code
    c = DistributedCollector([counting5] * 2, None, frames_per_batch=20, total_frames=-1, sync=False,
                             launcher="submitit", master_addr="127.0.0.1", timeout=150.0, on_node_failure="restart",
                             slurm_kwargs={"executor": "local", "folder": str(tmp_path / "jobs"), "timeout_min": 10})
    try:
        next(iter(c))
        jobs = c._pool.launcher.jobs
        first_job = jobs[2]
        pids = node_pids(c)
        os.kill(pids[1], signal.SIGKILL)
        _batches_until(c, lambda b: int(b[NODE_ID].reshape(-1)[0]) == 1 and c.stats()["workers"][1]["pid"] != pids[1])
        assert c.stats()["restarts"] == 1
        assert jobs[2] is not first_job and first_job.done() and not jobs[2].done()
        new_pids = node_pids(c)
    finally:
        c.shutdown()
    assert not wait_gone([*pids, *new_pids])


def test_restart_replaces_a_frozen_node_found_by_its_heartbeat():
    c = DistributedCollector([counting5] * 2, None, frames_per_batch=20, total_frames=-1, sync=True,
                             on_node_failure="restart", heartbeat_timeout=2.0, timeout=120.0)
    try:
        next(iter(c))
        pids = node_pids(c)
        os.kill(pids[0], signal.SIGSTOP)  # alive but frozen: only its silence tells
        batches = _batches_until(c, lambda b: c.stats()["workers"][0]["pid"] != pids[0])
        assert all(b.shape == (2, 10) for b in batches)
        assert [w["restarts"] for w in c.stats()["workers"]] == [1, 0]
        assert not wait_gone([pids[0]], timeout=5.0)  # the frozen process was killed, not waited for
        new_pids = node_pids(c)
    finally:
        c.shutdown()
    assert not wait_gone([*pids, *new_pids])


def test_weights_pushed_while_a_node_is_down_reach_its_replacement():
    c = DistributedCollector([counting5] * 2, ValuePolicy(), frames_per_batch=10, total_frames=-1, sync=False,
                             on_node_failure="restart", timeout=120.0, collector_kwargs={"track_policy_version": True})
    try:
        next(iter(c))
        pids = node_pids(c)
        os.kill(pids[1], signal.SIGKILL)
        assert not wait_gone([pids[1]], timeout=5.0)
        for value in (0.0, 1.0) * 6:  # more pushes than sends allowed in flight; the last says action 1
            c.update_policy_weights_(ValuePolicy(value))
        version = c.policy_version
        back = _batches_until(c, lambda b: int(b[NODE_ID].reshape(-1)[0]) == 1
                              and bool((b[TRAJ_IDS] >= 2 * BLOCK).all()))[-1]
        assert (back[POLICY_VERSION] == version).all() and (back["action"] == 1).all()
        assert c.stats()["restarts"] == 1
        new_pids = node_pids(c)
    finally:
        c.shutdown()
    assert not wait_gone([*pids, *new_pids])


def test_node_timeout_raises_with_the_default_policy():
    faulty = functools.partial(FaultyEnv, "hang", at_step=5, worker_ids=[0])
    c = DistributedCollector([faulty], None, frames_per_batch=10, total_frames=-1, node_timeout=2.0, timeout=120.0)
    try:
        pids = node_pids(c)
        started = time.monotonic()
        with pytest.raises(WorkerError, match=r"node 0 has not delivered a batch .*node_timeout=2"):
            for _ in c:
                pass
        assert time.monotonic() - started < 15.0
    finally:
        c.shutdown()
    assert not wait_gone(pids)


def test_node_timeout_does_not_fire_while_the_trainer_is_busy():
    c = DistributedCollector([counting5] * 2, None, frames_per_batch=10, total_frames=-1, sync=False,
                             node_timeout=1.0, timeout=120.0)
    try:
        it = iter(c)
        next(it)
        time.sleep(2.5)  # the nodes finished their batches long ago; they were only not taken
        for _ in range(10):
            next(it)
        assert c.stats()["restarts"] == 0
    finally:
        c.shutdown()


def test_a_push_retried_after_a_node_failure_moves_the_version_by_one():
    """Issue 23, item 10: a weight push that a node's failure interrupts is made again after the
    relaunch, with the same version (it moved by 2)."""
    from rlcollect.distributed.control import protocol as P
    from rlcollect.distributed.nodes import node_error

    policy = ValuePolicy()
    with DistributedCollector([counting5] * 2, policy, frames_per_batch=10, total_frames=-1, sync=True,
                              on_node_failure="restart", collector_kwargs={"track_policy_version": True}) as c:
        next(iter(c))
        pool = c._pool
        push, calls = pool.push_weights, []

        def failing_once(packed, version):
            calls.append(version)
            if len(calls) == 1:  # the connection to node 1 breaks during the push
                raise P.mark_failed(node_error("node 1 lost its connection while receiving weights", 1), 1)
            push(packed, version)

        pool.push_weights = failing_once
        with torch.no_grad():
            policy.w.fill_(1.0)
        c.update_policy_weights_()
        batch = next(iter(c))
        stats = c.stats()
    assert calls == [1, 1]
    assert stats["restarts"] == 1 and c.worker_policy_versions() == [1, 1]
    assert batch[POLICY_VERSION].unique().tolist() == [1] and batch["action"].unique().tolist() == [1]
