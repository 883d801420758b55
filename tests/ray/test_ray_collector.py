"""``DistributedCollector(launcher="ray")`` on a real Ray cluster (one per module, see
conftest.py): batches like "mp"'s, weights, failures through ``on_node_failure`` from Ray's
death notice, shutdown of what the launcher created, a Ray the user started left up."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from ray_helpers import (BLOCK, HERE, NODE_ID, POLICY_VERSION, TRAJ_IDS, ValuePolicy, actor_pids, counting5, pid_alive,
                         wait_gone, wait_no_actors)
from rlcollect import DistributedCollector, WorkerError

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def _layout(batch):
    return {key: (tuple(batch[key].shape), batch[key].dtype) for key in batch.keys(True, True)}, batch.names


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
def test_batches_equal_in_layout_to_mp(ray_cluster, sync):
    """Same nodes, same options: "ray" and "mp" deliver batches of the same keys, shapes,
    dtypes and names; each node draws its own trajectory-id block; weights reach the actors."""
    layouts, blocks = {}, {}
    for launcher in ("mp", "ray"):
        with DistributedCollector([counting5] * 2, ValuePolicy(), frames_per_batch=20, total_frames=80, sync=sync,
                                  launcher=launcher, collector_kwargs={"track_policy_version": True}) as c:
            batches = list(c)
            c.update_policy_weights_({"w": torch.ones(1)})
            deadline = time.monotonic() + 60
            updated = set()
            while updated != {0, 1} and time.monotonic() < deadline:
                b = next(iter(c))
                rows = [(i, b[i]) for i in range(2)] if sync else [(int(b[NODE_ID][0]), b)]
                updated |= {i for i, part in rows if (part["action"] == 1).all() and (part[POLICY_VERSION] == 1).all()}
            assert updated == {0, 1}
            if launcher == "ray":
                stats = c.stats()
                assert stats["launcher"] == "ray"
                pids = [w["pid"] for w in stats["workers"]]
                assert set(pids) <= actor_pids()  # the nodes are the actors' processes
        layouts[launcher] = {_layout(b)[0].__repr__() for b in batches}, {tuple(_layout(b)[1]) for b in batches}
        blocks[launcher] = sorted({int(i) for b in batches for i in (b[TRAJ_IDS] // BLOCK).unique()})
        assert sum(b.numel() for b in batches) == 80
    assert layouts["ray"] == layouts["mp"]
    if sync:
        assert blocks["ray"] == blocks["mp"] == [0, 1]
    else:
        assert set(blocks["ray"]) <= {0, 1}
    assert wait_gone(pids, 30.0) == []


def test_shutdown_removes_actors_and_placement_group_and_leaves_users_ray_up(ray_cluster):
    import ray
    from ray.util import placement_group_table

    before = {g for g in placement_group_table()}
    with DistributedCollector([counting5] * 2, frames_per_batch=20, total_frames=40, sync=True, launcher="ray",
                              ray_options={"placement_group": "PACK", "num_cpus": 1}) as c:
        assert [b.shape for b in c] == [(2, 10)] * 2
        pids = [w["pid"] for w in c.stats()["workers"]]
        groups = {g: v for g, v in placement_group_table().items() if g not in before}
        assert [v["strategy"] for v in groups.values()] == ["PACK"]
        assert [v["state"] for v in groups.values()] == ["CREATED"]
    assert wait_gone(pids, 30.0) == []
    assert [placement_group_table()[g]["state"] for g in groups] == ["REMOVED"]
    assert ray.is_initialized()  # the user's Ray (the fixture's) stays up
    assert ray.cluster_resources().get("CPU") == 4  # and every CPU is free again
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 4 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ray.available_resources().get("CPU") == 4


def _first_pid(c, i):
    return c.stats()["workers"][i]["pid"]


def test_nodes_keep_the_normal_priority_not_rays_niceness_15(ray_cluster):
    """Ray lowers its workers to niceness 15; a node doing the collection at 15 gets only the CPU
    that other jobs leave (relaunched actors still importing torch after 4 minutes at load 9):
    the nodes' actors keep the priority their raylet starts them at (ray_launcher.py)."""
    with DistributedCollector([counting5] * 2, frames_per_batch=20, total_frames=20, launcher="ray") as c:
        next(iter(c))
        pids = [w["pid"] for w in c.stats()["workers"]]
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [os.nice(0)] * 2


def test_sigkilled_actor_raises_naming_node_and_rays_cause(ray_cluster):
    c = DistributedCollector([counting5] * 2, frames_per_batch=20, total_frames=-1, sync=True, launcher="ray")
    try:
        it = iter(c)
        next(it)
        victim = _first_pid(c, 1)
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(WorkerError) as info:
            for _ in range(1000):
                next(it)
        err = info.value
        assert err.worker_index == 1
        assert "node 1" in str(err)
        assert "worker process has died" in str(err) or "stopped answering" in str(err) or "lost" in str(err)
        other = _first_pid(c, 0)
    finally:
        c.shutdown()
    assert wait_gone([victim, other], 30.0) == []


def test_restart_creates_a_fresh_actor_that_rejoins_with_the_weights(ray_cluster):
    with DistributedCollector([counting5] * 2, ValuePolicy(), frames_per_batch=20, total_frames=200, sync=True,
                              launcher="ray", on_node_failure="restart",
                              collector_kwargs={"track_policy_version": True}) as c:
        it = iter(c)
        first = next(it)
        c.update_policy_weights_({"w": torch.ones(1)})
        old = _first_pid(c, 0)
        os.kill(old, signal.SIGKILL)
        batches = [first, *it]
        stats = c.stats()
        new = stats["workers"][0]["pid"]
        assert new != old and pid_alive(new) and not pid_alive(old)
        assert [w["restarts"] for w in stats["workers"]] == [1, 0]
        assert stats["frames"] == 200 == sum(b.numel() for b in batches)
        last = batches[-1]
        assert (last["action"] == 1).all() and (last[POLICY_VERSION] == 1).all()  # the replacement got the weights
        # A relaunched node draws trajectory ids from a block no earlier node used.
        blocks = sorted({int(i) for b in batches for i in (b[TRAJ_IDS][0] // BLOCK).unique()})
        assert blocks[0] == 0 and len(blocks) == 2 and blocks[1] > 1
        pids = [w["pid"] for w in stats["workers"]]
    assert wait_gone(pids, 30.0) == []


def test_continue_drops_a_dead_actor_and_goes_on(ray_cluster):
    with DistributedCollector([counting5] * 2, frames_per_batch=10, total_frames=-1, sync=False, launcher="ray",
                              on_node_failure="continue") as c:
        it = iter(c)
        next(it)
        victim = _first_pid(c, 1)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not c.stats()["dropped_nodes"] and time.monotonic() < deadline:
            next(it)
        rest = [next(it) for _ in range(5)]
        stats = c.stats()
        assert stats["dropped_nodes"] == [1]
        assert stats["workers"][1]["state"] == "dropped"
        assert stats["frames"] == stats["batches"] * 10
        assert {int(b[NODE_ID][0]) for b in rest} == {0}
        pids = [stats["workers"][0]["pid"], victim]
    assert wait_gone(pids, 30.0) == []


def test_bad_env_on_an_actor_is_raised_with_its_traceback(ray_cluster):
    from dist_helpers import failing_env

    with pytest.raises(Exception) as info:
        DistributedCollector([counting5, failing_env], frames_per_batch=10, total_frames=20, launcher="ray",
                             start_timeout=120)
    assert "this env cannot be built" in str(info.value)
    assert wait_no_actors(timeout=30.0) == set()


def test_kill_storm_with_restart_keeps_exact_counts_and_unique_trajectories(ray_cluster):
    """>= 10 SIGKILLs of actor processes at random moments (collecting, starting, rejoining):
    every failure is repaired by a fresh actor, every delivered frame is counted once, no frame
    is delivered twice, and no trajectory id is shared by two incarnations."""
    rng = random.Random(24)
    kills: list[int] = []
    stop = threading.Event()

    def killer() -> None:
        while len(kills) < 10 and not stop.is_set():
            time.sleep(rng.uniform(0.3, 2.5))
            # (a killed actor's process can still be listed while it ends: never counted twice)
            live = sorted(actor_pids() - set(kills))
            if live:
                victim = rng.choice(live)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                    kills.append(victim)

    batches = []
    with DistributedCollector([counting5] * 2, frames_per_batch=10, total_frames=-1, sync=False, launcher="ray",
                              on_node_failure="restart", max_node_restarts=100, start_timeout=120) as c:
        thread = threading.Thread(target=killer, daemon=True)
        it = iter(c)
        batches.append(next(it))
        thread.start()
        deadline = time.monotonic() + 200
        try:
            while thread.is_alive() and time.monotonic() < deadline:
                batches.append(next(it))
            thread.join()
            # The last kill is seen (Ray's notice, checked every 0.25 s) while the other node delivers.
            while c.stats()["restarts"] < len(kills) and time.monotonic() < deadline:
                batches.append(next(it))
            batches += [next(it) for _ in range(10)]  # and it goes on collecting
        finally:
            stop.set()
            thread.join()
        stats = c.stats()
        pids = [w["pid"] for w in stats["workers"]]
    assert len(kills) >= 10
    assert stats["restarts"] == len(kills)
    assert stats["frames"] == sum(b.numel() for b in batches) == 10 * len(batches) == 10 * stats["batches"]
    frames = [(int(t), int(o)) for b in batches for t, o in zip(b[TRAJ_IDS].tolist(), b["observation"][:, 0].tolist())]
    assert len(frames) == len(set(frames))  # no frame delivered twice
    owner: dict[int, int] = {}
    for b in batches:
        node = int(b[NODE_ID][0])
        for block in (b[TRAJ_IDS] // BLOCK).unique().tolist():
            assert owner.setdefault(int(block), node) == node  # one block, one node (and incarnation)
    assert len(owner) > 2  # the relaunched incarnations drew fresh blocks
    assert wait_gone(pids + kills, 30.0) == []
    assert wait_no_actors(timeout=30.0) == set()


_DRIVER = """
import sys, time
sys.path.insert(0, {helpers!r})
from dist_helpers import counting5
from rlcollect import DistributedCollector
c = DistributedCollector([counting5] * 2, frames_per_batch=10, total_frames=-1, launcher="ray")
it = iter(c)
next(it)
print("PIDS " + " ".join(str(w["pid"]) for w in c.stats()["workers"]), flush=True)
time.sleep(600)
"""


def test_driver_killed_ends_every_actor(ray_cluster, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER.format(helpers=str(HERE.parent / "distributed")))
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    try:
        line = b""
        while not line.startswith(b"PIDS "):  # (pytest-timeout bounds this)
            line = driver.stdout.readline()
            assert line, "the driver ended before it printed its nodes' pids"
        pids = [int(p) for p in line.split()[1:]]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        driver.kill()
        driver.wait()
        killed_at = time.monotonic()
        left = wait_gone(pids, 30.0)
        print(f"actors gone {time.monotonic() - killed_at:.2f} s after the driver's SIGKILL")
        assert left == []
    finally:
        if driver.poll() is None:
            driver.kill()
        driver.wait()
        driver.stdout.close()


# A training loop as written for torchrl 0.14 (torchrl.collectors.Collector with backend="ray"),
# with only its imports changed.
_TORCHRL_SCRIPT = '''
import json
import torch
from torch import nn
from rlcollect import Collector, GymEnv  # torchrl: torchrl.collectors.Collector, torchrl.envs.GymEnv


def make_env():
    return GymEnv("CartPole-v1")


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))

    def forward(self, observation):
        return (observation[..., 0] * 0 + self.w[0]).gt(0.5).long()


policy = Policy()
collector = Collector(
    make_env,
    policy,
    frames_per_batch=100,
    total_frames=1000,
    backend="ray",
    num_collectors=2,
    backend_options={
        "ray_init_config": {"address": ADDRESS},
        "remote_configs": {"num_cpus": 1},
        "num_workers_per_collector": 1,
        "collector_kwargs": {"track_policy_version": True},
    },
)
out = {"type": type(collector).__name__, "sync": collector.sync, "shapes": [], "nodes": [], "versions": []}
for i, data in enumerate(collector):
    out["shapes"].append(list(data.shape))
    out["nodes"].append(int(data["collector", "node_id"][0]))
    out["versions"].append(int(data["collector", "policy_version"].max()))
    if i == 2:
        with torch.no_grad():
            policy.w.fill_(1.0)
        collector.update_policy_weights_()
out["last_actions"] = data["action"].unique().tolist()
out["frames"] = collector.stats()["frames"]
collector.shutdown()
print("RESULT " + json.dumps(out), flush=True)
'''


def test_torchrl_014_script_with_backend_ray_runs_unchanged(ray_cluster, tmp_path):
    import json

    script = tmp_path / "train.py"
    script.write_text(_TORCHRL_SCRIPT.replace("ADDRESS", repr(ray_cluster.address)))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=250)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["type"] == "RayCollector" and result["sync"] is False  # torchrl's default: async
    assert result["shapes"] == [[100]] * 10 and result["frames"] == 1000
    assert set(result["nodes"]) <= {0, 1}
    assert result["versions"][-1] == 1 and result["last_actions"] == [1]
