"""DistributedCollector with the "mp" launcher: batch shapes and totals in sync and async mode,
every node class, weights, automatic updates, trajectory ids, seeding, state and shutdown.

Each node is a fresh interpreter that imports torch (seconds on a small machine), so the
tests that only read share one collector per module."""

from __future__ import annotations

import functools
import logging
import os
import sys
import time

import pytest
import torch

from dist_helpers import (BLOCK, NODE_ID, POLICY_VERSION, TRAJ_IDS, WORKER_ID, ValuePolicy, channel_send, counting5,
                          node_pids,
                          wait_gone)
from rlcollect import GymEnv, MultiAsyncCollector, MultiSyncCollector
from rlcollect.distributed.control import protocol as P
from rlcollect.distributed.collector import DistributedCollector
from rlcollect.distributed.config import ASYNC_SLOTS

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loadscale import scaled  # noqa: E402
from procs import own_tmpdir  # noqa: E402, F401  (fixture)

pytestmark = pytest.mark.timeout(180)

#: The nodes' start-up wait, grown with the machine's load (two nodes import torch at once).
START = scaled(120, cap=480)


def _collector(**kwargs) -> DistributedCollector:
    options = {"frames_per_batch": 20, "total_frames": 60, "sync": True, "timeout": 120.0}
    options.update(kwargs)
    create = options.pop("create_env_fn", [counting5] * options.pop("nodes", 2))
    return DistributedCollector(create, options.pop("policy", ValuePolicy()), **options)


@pytest.fixture(scope="module")
def sync_collector():
    c = _collector(collector_kwargs={"track_policy_version": True})
    yield c
    pids = node_pids(c)
    c.shutdown()
    assert not wait_gone(pids)


@pytest.fixture(scope="module")
def async_collector():
    c = _collector(frames_per_batch=10, sync=False, collector_kwargs={"track_policy_version": True})
    yield c
    pids = node_pids(c)
    c.shutdown()
    assert not wait_gone(pids)


# -- sync ------------------------------------------------------------------------------------------
def test_sync_batches_stack_one_part_per_node(sync_collector):
    c = sync_collector
    batches = list(c)
    assert len(batches) == len(c) == 3
    assert all(b.shape == (2, 10) and b.names == [None, "time"] for b in batches)
    assert sum(b.numel() for b in batches) == c.stats()["frames"] == 60
    # A new iteration collects total_frames more; the nodes kept running.
    assert [b.shape for b in c] == [torch.Size([2, 10])] * 3
    assert c.stats()["frames"] == 120 and all(w["frames"] == 60 for w in c.stats()["workers"])


def test_sync_traj_ids_are_unique_across_nodes(sync_collector):
    batch = next(iter(sync_collector))
    ids0, ids1 = batch[TRAJ_IDS][0], batch[TRAJ_IDS][1]
    assert (ids0 < BLOCK).all() and ((ids1 >= BLOCK) & (ids1 < 2 * BLOCK)).all()
    # CountingEnv(max_steps=5): 10 steps hold two whole trajectories, with continuing ids.
    assert ids0.unique().numel() == 2 and ids1.unique().numel() == 2


def test_sync_weights_change_later_actions_on_every_node(sync_collector):
    c = sync_collector
    before = next(iter(c))
    assert before["action"].unique().tolist() == [0]
    c.update_policy_weights_({"w": torch.ones(1)})
    after = next(iter(c))
    assert after["action"].unique().tolist() == [1]
    assert after[POLICY_VERSION].unique().tolist() == [c.policy_version]
    assert c.worker_policy_versions() == [c.policy_version] * 2
    # Only node 1: node 0 keeps acting with the previous weights.
    c.update_policy_weights_({"w": torch.zeros(1)}, worker_ids=[1])
    batch = next(iter(c))
    assert batch["action"][0].unique().tolist() == [1] and batch["action"][1].unique().tolist() == [0]
    c.update_policy_weights_({0: {"w": torch.zeros(1)}})  # per-node weights
    assert next(iter(c))["action"].unique().tolist() == [0]


def test_sync_rejects_weights_that_do_not_fit(sync_collector):
    version = sync_collector.policy_version
    with pytest.raises(ValueError, match="do not fit"):
        sync_collector.update_policy_weights_({"w": torch.ones(3)})
    with pytest.raises(ValueError, match="node indices"):
        sync_collector.update_policy_weights_({"w": torch.ones(1)}, worker_ids=[2])
    assert sync_collector.policy_version == version
    assert next(iter(sync_collector)).shape == (2, 10)  # still usable


def test_sync_reset_starts_new_trajectories(sync_collector):
    c = sync_collector
    last = next(iter(c))[TRAJ_IDS][:, -1]
    c.reset()
    after = next(iter(c))
    assert (after[TRAJ_IDS][:, 0] > last).all()
    assert (after["observation"][:, 0, 0] == 0).all()  # the reset observation


def test_malformed_forged_and_foreign_notices_are_dropped(sync_collector, caplog):
    c = sync_collector
    keys = c._pool.keys
    token = c._pool.handles[0].token
    ready = dict(seq=0, slot=0, frames=1, version=0, seconds=0.0, version_min=0, version_mean=0.0, step_mean_s=None,
                 step_p95_s=None)
    next(iter(c))
    with caplog.at_level(logging.ERROR, logger="rlcollect"):
        # Each on a connection of its own to the channel listener, as its first message.
        wires = channel_send(
            c, b"garbage",
            P.encode("ready", 1, b"x" * 32, token, 10**6, to=0, **ready),  # without the secret
            lambda ch: P.encode("attach", 2, keys.to_rank0, "not-the-token", 10**6, to=0, role="watch", challenge=ch),
            lambda ch: P.encode("attach", 9, keys.to_rank0, token, 10**6, to=0, role="watch", challenge=ch),
            P.encode("ready", 1, keys.to_rank0, token, 10**6, to=0, **ready))  # a notice is not an attach
        batch = next(iter(c))
        deadline = time.monotonic() + 10
        while c._pool.channel.drops.total < 5 and time.monotonic() < deadline:
            batch = next(iter(c))
    for wire in wires:
        wire.close()
    assert batch.shape == (2, 10)
    text = caplog.text
    assert "not an rlcollect message" in text and "MAC does not verify" in text
    assert "another session" in text and "unknown rank 9" in text
    assert c._pool.channel.drops.total == 5  # the notice too: logged once per claimed sender, counted


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if int(hex_port, 16) == port and state == "0A":
                    out.append(address)
    return out


def test_rank0_listens_on_master_addr_only(sync_collector):
    listeners = _listeners(sync_collector.master_port)
    assert listeners == ["0100007F"]  # 127.0.0.1, and no wildcard socket (SPEC 13)
    assert _listeners(sync_collector._pool.channel.port) == ["0100007F"]  # the channels' listener too


def test_stats_are_json_serialisable(sync_collector):
    import json

    stats = sync_collector.stats()
    json.dumps(stats)
    assert stats["launcher"] == "mp" and len(stats["workers"]) == 2
    assert all(w["alive"] and w["pid"] for w in stats["workers"])
    assert stats["master"].startswith("127.0.0.1:")


# -- async -------------------------------------------------------------------------------------------
def test_async_yields_one_nodes_batch_at_a_time(async_collector):
    c = async_collector
    batches = list(c)
    assert len(batches) == len(c) == 6
    assert all(b.shape == (10,) and b.names == ["time"] for b in batches)
    assert sum(b.numel() for b in batches) == 60
    assert all((b[NODE_ID] == b[NODE_ID][0]).all() for b in batches)
    # Whichever node is ready first delivers: on a loaded machine node 0 may deliver all six
    # before node 1's first batch, so further iterations (60 frames each) run until both did.
    for _ in range(20):
        if {int(b[NODE_ID][0]) for b in batches} == {0, 1}:
            break
        batches += list(c)
    assert {int(b[NODE_ID][0]) for b in batches} == {0, 1}
    for b in batches:
        node = int(b[NODE_ID][0])
        assert ((b[TRAJ_IDS] >= node * BLOCK) & (b[TRAJ_IDS] < (node + 1) * BLOCK)).all()


def test_async_weights_reach_every_node(async_collector):
    c = async_collector
    c.update_policy_weights_({"w": torch.ones(1)})
    version = c.policy_version
    # Each node may deliver the two batches it had in flight with the old weights.
    seen = {0: [], 1: []}
    for _ in range(30):
        batch = next(iter(c))
        seen[int(batch[NODE_ID][0])].append(batch[POLICY_VERSION].unique().tolist())
        if all(len(v) >= 3 for v in seen.values()):
            break
    for node, versions in seen.items():
        assert versions[-1] == [version], (node, versions)
        assert sum(v != [version] for v in versions) <= 2


def test_async_seed_state_and_reset_discard_in_flight(async_collector):
    c = async_collector
    assert isinstance(c.set_seed(5), int)
    state = c.state_dict()
    assert sorted(state) == ["frames", "iter", "node0", "node1", "policy_version"]
    c.load_state_dict(state)
    c.reset()
    assert next(iter(c)).shape == (10,)


def test_async_state_dict_counts_the_frames_delivered_not_those_collected_ahead():
    # Issue 28: each async node keeps ASYNC_SLOTS batches in flight; state_dict() receives them
    # (queued for delivery) but counts only the frames delivered, as total_frames does.
    with _collector(frames_per_batch=20, total_frames=100, sync=False, start_timeout=START) as c:
        it = iter(c)
        assert next(it).numel() == 20
        state = c.state_dict()
        assert (state["frames"], state["iter"]) == (20, 1)
        # the nodes' own counts: the delivered batch and every batch in flight
        assert state["node0"]["frames"] + state["node1"]["frames"] == (1 + 2 * ASYNC_SLOTS) * 20
        stats = c.stats()
        assert stats["frames"] == sum(w["frames"] for w in stats["workers"]) == 20
        assert [b.numel() for b in it] == [20] * 4  # the queued batches, up to total_frames
        assert c.stats()["frames"] == 100
        c.load_state_dict(state)  # a resumed run collects the 80 frames still to go
        assert [b.numel() for b in c] == [20] * 4
        assert c.stats()["frames"] == 100
        c.reset()  # the batches in flight are discarded, never counted
        stats = c.stats()
        # per node: every frame delivered since the start (load_state_dict leaves them)
        assert (stats["frames"], sum(w["frames"] for w in stats["workers"])) == (100, 20 + 80 + 80)


# -- node classes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("collector_class, nodes, inner",
                         [("sync", 2, MultiSyncCollector), ("async", 1, MultiAsyncCollector)])
def test_multi_process_nodes(collector_class, nodes, inner):
    c = _collector(nodes=nodes, collector_class=collector_class, num_workers_per_collector=2,
                   frames_per_batch=20 * nodes, collector_kwargs={"track_policy_version": True})
    try:
        batch = next(iter(c))
        ids = batch[TRAJ_IDS]
        if inner is MultiSyncCollector:
            assert batch.shape == (2, 2, 10)  # (nodes, workers, T): 20 frames per node, 10 per worker
            blocks = (ids // BLOCK).amin(-1)
            assert blocks.tolist() == [[0, 1], [2, 3]]  # every worker of every node has its own block
        else:
            assert batch.shape == (1, 20)
            assert WORKER_ID in batch.keys(include_nested=True)
            assert ((ids // BLOCK) == batch[WORKER_ID]).all()
        c.update_policy_weights_({"w": torch.ones(1)})
        for _ in range(8):  # async workers may deliver batches they had in flight
            batch = next(iter(c))
            if batch[POLICY_VERSION].unique().tolist() == [1]:
                break
        assert batch["action"].unique().tolist() == [1]
        assert batch[POLICY_VERSION].unique().tolist() == [1]
    finally:
        pids = node_pids(c)
        c.shutdown()
    assert not wait_gone(pids)


def test_a_node_removes_its_multiprocessing_temp_folder_at_exit(monkeypatch, own_tmpdir):
    # A node with a multi-process collector has a pymp-* temp folder (the listener that hands
    # the shared batch slots to its workers); it exits with os._exit, which skips its removal.
    monkeypatch.setenv("TMPDIR", str(own_tmpdir))  # the node's temp folder (this process keeps its own)
    c = _collector(nodes=1, collector_class="sync", num_workers_per_collector=2, start_timeout=START)
    try:
        assert next(iter(c)).shape == (1, 2, 10)
        assert len(list(own_tmpdir.glob("pymp-*"))) == 1  # the node's, while it runs
    finally:
        pids = node_pids(c)
        c.shutdown()
    assert not wait_gone(pids)
    assert sorted(p.name for p in own_tmpdir.glob("pymp-*")) == []


def test_a_node_runs_its_workers_with_central_inference():
    # the node's MultiSyncCollector runs the node's policy copy in the node process for both of
    # its workers; the weights still come from rank 0
    c = _collector(nodes=1, collector_class="sync", num_workers_per_collector=2, frames_per_batch=20,
                   collector_kwargs={"track_policy_version": True, "inference": "central"})
    try:
        batch = next(iter(c))
        assert batch.shape == (1, 2, 2, 5)  # (nodes, workers, env splits, T)
        assert batch["action"].unique().tolist() == [0]
        c.update_policy_weights_({"w": torch.ones(1)})
        batch = next(iter(c))
        assert batch["action"].unique().tolist() == [1]
        assert batch[POLICY_VERSION].unique().tolist() == [1]
        inference = c.stats()
        assert inference["frames"] == 40
    finally:
        pids = node_pids(c)
        c.shutdown()
    assert not wait_gone(pids)


# -- automatic weight updates --------------------------------------------------------------------------
@pytest.mark.parametrize("option, expected", [
    ({"update_interval": 3}, [0, 0, 0, 1, 1, 1, 2]),
    ({"max_weight_update_interval": 2}, [0, 0, 1, 1, 2, 2, 3]),
    ({"update_after_each_batch": True}, [1, 2, 3, 4, 5, 6, 7]),
])
def test_automatic_updates(option, expected):
    policy = ValuePolicy()
    c = _collector(nodes=1, policy=policy, frames_per_batch=10, total_frames=-1,
                   collector_kwargs={"track_policy_version": True}, **option)
    try:
        versions = []
        for batch in c:
            versions.append(batch[POLICY_VERSION].unique().tolist())
            if len(versions) == len(expected):
                break
        assert versions == [[v] for v in expected]
        # The weights pushed are rank 0's policy's, read at push time.
        with torch.no_grad():
            policy.w.fill_(1.0)
        batch = [b for _, b in zip(range(4), c)][-1]
        assert batch["action"].unique().tolist() == [1]
    finally:
        c.shutdown()


def test_async_max_weight_update_interval_bounds_staleness():
    c = _collector(frames_per_batch=10, total_frames=-1, sync=False, max_weight_update_interval=2,
                   collector_kwargs={"track_policy_version": True})
    try:
        runs: dict[int, list[int]] = {0: [], 1: []}
        for _, batch in zip(range(16), c):
            runs[int(batch[NODE_ID][0])].append(int(batch[POLICY_VERSION][0]))
        for node, versions in runs.items():
            assert len(versions) >= 3, runs
            streaks = [sum(1 for v in versions if v == version) for version in set(versions)]
            assert max(streaks) <= 2, (node, versions)  # never more than 2 batches on the same weights
            assert versions == sorted(versions)
    finally:
        c.shutdown()


# -- seeding and state ------------------------------------------------------------------------------------
def test_seeding_and_state_round_trip():
    make = functools.partial(GymEnv, "CartPole-v1")
    c = DistributedCollector([make, make], None, frames_per_batch=100, total_frames=-1, sync=True, timeout=120.0)
    try:
        assert c.set_seed(3) == 5  # chained through the nodes: 3 -> node 0 -> 4 -> node 1 -> 5
        first = next(iter(c))
        c.set_seed(3)
        again = next(iter(c))
        for key in ("observation", "action", ("next", "reward")):
            assert torch.equal(first[key], again[key])
        assert not torch.equal(first["observation"][0], first["observation"][1])  # nodes are seeded apart
        state = c.state_dict()
        expected = next(iter(c))
        next(iter(c))
        c.load_state_dict(state)
        assert c.stats()["frames"] == state["frames"]
        restored = next(iter(c))
        for key in ("observation", "action", TRAJ_IDS, ("next", "done")):
            assert torch.equal(expected[key], restored[key])
        with pytest.raises(KeyError, match="node1"):
            c.load_state_dict({"node0": state["node0"], "frames": 0, "iter": 0})
        with pytest.raises(KeyError):  # node 0 rejects a state without its keys; nothing changes
            c.load_state_dict({**state, "node0": {"frames": 1}})
        assert next(iter(c)).shape == (2, 50)
    finally:
        c.shutdown()


# -- shutdown ----------------------------------------------------------------------------------------------
def test_shutdown_leaves_no_process():
    c = _collector(nodes=2, total_frames=-1)
    next(iter(c))
    pids = node_pids(c)
    c.shutdown()
    assert not wait_gone(pids, timeout=1.0)
    c.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        next(iter(c))
    with pytest.raises(RuntimeError, match="shut down"):
        c.update_policy_weights_()


def test_context_manager_endless_len_random_frames_and_postproc():
    def postproc(batch):  # runs on rank 0 only: need not pickle
        batch.set("seen_by_rank0", torch.ones(batch.shape, dtype=torch.bool))
        return batch

    with _collector(nodes=1, total_frames=-1, frames_per_batch=50, policy=ValuePolicy(1.0), init_random_frames=50,
                    postproc=postproc) as c:
        with pytest.raises(TypeError, match="endless"):
            len(c)
        first, second = next(c), next(c)
        assert first.shape == (1, 50) and first["seen_by_rank0"].all()
        assert first["action"].unique().tolist() == [0, 1]  # random actions for the first 50 frames
        assert second["action"].unique().tolist() == [1]  # then the policy's
        pids = node_pids(c)
    assert not wait_gone(pids, timeout=1.0)
