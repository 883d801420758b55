"""``NodePool``'s state machine and bookkeeping, one ``NodeHandle`` per node, driven without
processes: a fake store and launcher stand for the real ones (the real flows are in
test_node_failure.py and test_distributed_collector.py)."""

from __future__ import annotations

import types

import pytest

from rlcollect.distributed.control import protocol as P
from rlcollect.distributed.control.auth import new_secret
from rlcollect.distributed.control.handshake import Handshake
from rlcollect.distributed.nodes import NodeHandle, NodeState, node_error
from rlcollect.distributed.pool import NodePool
from rlcollect.distributed.recovery import Recovery
from rlcollect.members import SEED_STRIDE, Members
from rlcollect.errors import WorkerError

pytestmark = pytest.mark.timeout(30)


class FakeStore:
    def __init__(self):
        self.keys: dict[str, bytes] = {}
        self.queues: dict[str, list[bytes]] = {}

    def delete_key(self, key):
        return self.keys.pop(key, None) is not None

    def queue_len(self, queue):
        return len(self.queues.get(queue, []))

    def queue_pop(self, queue, block):
        return self.queues[queue].pop(0)


class FakeLauncher:
    owns_processes = True

    def __init__(self):
        self.killed, self.relaunched, self.stopped = [], [], None

    def kill(self, rank, timeout=5.0):
        self.killed.append(rank)

    def relaunch(self, rank):
        self.relaunched.append(rank)

    def dead(self):
        return {}

    def stop(self, timeout, failed=frozenset()):
        self.stopped = set(failed)


def _pool(num_nodes=2, on_node_failure="restart"):
    def payload(i, incarnation, seed):
        return f"{i}/{incarnation}/{seed}".encode()

    config = types.SimpleNamespace(num_nodes=num_nodes, start_timeout=5.0, on_node_failure=on_node_failure,
                                   max_node_restarts=2, relaunch_payload=payload)
    pool = NodePool(config, new_secret())
    pool.store, pool.launcher = FakeStore(), FakeLauncher()
    pool.handshake = Handshake(pool.keys, pool.run, pool.world_size, channel=None)
    pool.started = True
    for h in pool.handles:
        h.state, h.configured, h.token = NodeState.SERVING, True, f"token-{h.rank}" * 2
    return pool


def test_a_handle_starts_launching_and_names_its_state_as_stats_does():
    h = NodeHandle(2)
    assert (h.rank, h.state, h.serving, h.outstanding, h.incarnation) == (3, NodeState.LAUNCHING, False, 0, 0)
    names = {}
    for state in NodeState:
        h.state = state
        names[state.value] = h.stats_state()
    assert names == {"launching": "rejoining", "serving": "collecting", "failed": "rejoining",
                     "relaunching": "rejoining", "dropped": "dropped", "closed": "closed"}
    err = node_error("node 2 stopped answering", 2, exitcode=-9)
    assert isinstance(err, WorkerError) and (err.worker_index, err.node_index, err.exitcode) == (2, 2, -9)


def test_failed_relaunching_serving_then_dropped_then_closed():
    pool = _pool()
    h = pool.handles[1]
    h.outstanding, h.expected_seq, h.batch_started = 2, 7, 1.0
    pool.drop(1, for_good=False)
    # Its batches in flight are lost and counted; its session is forgotten.
    assert h.state is NodeState.FAILED and pool.launcher.killed == [2]
    assert (h.lost_batches, h.outstanding, h.expected_seq, h.batch_started) == (2, 0, 0, None)
    assert (h.token, h.configured, h.pg) == ("", False, None)
    assert pool.serving() == [0]
    pool.restart(1, b"its configuration")
    assert h.state is NodeState.RELAUNCHING and h.incarnation == 1 and pool.launcher.relaunched == [2]
    assert h.rejoin.payload == b"its configuration" and not h.rejoin.configured
    assert not pool.settled() and pool.serving() == [0]
    # Rejoined (its handshake done, its pair group joined): admitted once its layout matches.
    layout = object()
    pool.layouts = [layout, layout]
    h.rejoin.info = {"layout": layout, "weights": None, "pid": 1234, "host": "here"}
    assert pool.settled()
    assert h.state is NodeState.SERVING and h.rejoin is None and h.info["pid"] == 1234
    assert pool.serving() == [0, 1]
    pool.drop(0, for_good=True)
    assert pool.handles[0].state is NodeState.DROPPED and not pool.all_dropped()
    pool.close(1.0)
    assert [x.state for x in pool.handles] == [NodeState.CLOSED] * 2
    assert pool.launcher is None and pool.store is None and pool.closed
    pool.close(1.0)  # idempotent


def test_a_rejoined_node_with_another_layout_is_refused():
    pool = _pool()
    pool.drop(0, for_good=False)
    pool.restart(0, b"")
    pool.layouts = ["the layout", "the layout"]
    pool.handles[0].rejoin.info = {"layout": "another layout", "weights": None, "pid": 1, "host": "h"}
    with pytest.raises(WorkerError, match="relaunched node 0 reports another batch layout"):
        pool.admit()
    assert pool.handles[0].state is NodeState.RELAUNCHING


def test_close_kills_the_failed_and_starting_nodes_without_waiting():
    pool = _pool(num_nodes=3)
    launcher = pool.launcher
    pool.handles[0].state = NodeState.FAILED
    pool.drop(2, for_good=False)
    pool.restart(2, b"")
    pool.close(1.0)
    assert launcher.stopped == {1, 3}  # the failed node and the one still relaunching


def _members(pool, recovery):
    """A ``Members`` running steps under ``recovery`` (the gather is not used by ``run``)."""
    gather = types.SimpleNamespace(owed=None, recovered=lambda index: None, abandon=lambda: None)
    return Members(pool, gather, recovery, None)


@pytest.mark.parametrize("mode", ["continue", "restart"])
def test_recovery_drops_or_relaunches_through_the_pool_only(mode):
    pool = _pool(on_node_failure=mode)
    recovery = Recovery(pool.config, pool)
    recovery.note_seed(1, 100)
    failures = [P.mark_failed(node_error("node 1 died", 1), 1)]

    def step():
        if failures:
            raise failures.pop()
        return "the batch"

    members = _members(pool, recovery)
    assert members.run(step) == "the batch"
    h = pool.handles[1]
    if mode == "continue":
        assert h.state is NodeState.DROPPED and recovery.counts[1] == 0 and pool.launcher.relaunched == []
    else:
        assert h.state is NodeState.RELAUNCHING and recovery.counts[1] == 1 and pool.launcher.relaunched == [2]
        assert h.rejoin.payload == f"1/1/{100 + SEED_STRIDE}".encode()  # a seed derived from the last one
    # A failure of a node that is not marked is not recovery's to repair.
    with pytest.raises(ValueError, match="not a node failure"):
        members.run(lambda: (_ for _ in ()).throw(ValueError("not a node failure")))


def test_recovery_raises_after_max_node_restarts():
    pool = _pool()
    recovery = Recovery(pool.config, pool)
    recovery.counts[0] = 2
    with pytest.raises(WorkerError, match=r"node 0 failed again after 2 restarts \(max_node_restarts=2\)"):
        _members(pool, recovery).run(lambda: (_ for _ in ()).throw(P.mark_failed(node_error("node 0 died", 0), 0)))
