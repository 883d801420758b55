"""The launchers besides "mp": nodes started by hand with ``rlcollect node`` (options or
torchrun's environment variables), submitit jobs (with submitit's local executor), and jobs
submitted beforehand for "submitit_delayed"."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import torch

from dist_helpers import (BLOCK, NODE_ID, TRAJ_IDS, ValuePolicy, counting5, free_port, node_pids, rlcollect_command,
                          wait_gone)
from rlcollect.distributed.control.auth import new_secret, write_secret_file
from rlcollect.distributed.collector import DistributedCollector
from rlcollect.distributed.launch.launchers import submit_nodes
from rlcollect.distributed.node import EXIT_OK, EXIT_REJECTED

pytestmark = pytest.mark.timeout(180)
HELPERS = str(Path(__file__).resolve().parent)
#: The nodes import the helpers, and rlcollect from where this test runs (a worktree's PYTHONPATH).
NODE_PATH = os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")]))


@pytest.fixture
def secret_file(tmp_path):
    return str(write_secret_file(new_secret(), tmp_path))


def _node(port: int, rank: int, world_size: int, secret_file: str, *, env_vars: bool = False) -> subprocess.Popen:
    # The env factory and policy are pickled by reference to dist_helpers: like a user's own
    # module, it must be importable on the node.
    env = {**os.environ, "PYTHONPATH": NODE_PATH}
    if env_vars:  # as torchrun would set them, and the secret in the environment
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                   RLCOLLECT_SECRET=open(secret_file).read().strip())
        return subprocess.Popen([rlcollect_command(), "node", "--timeout", "120"], env=env)
    return subprocess.Popen([rlcollect_command(), "node", "--master-addr", "127.0.0.1", "--master-port", str(port),
                             "--rank", str(rank), "--world-size", str(world_size), "--timeout", "120",
                             "--secret-file", secret_file], env=env)


def _stop(*processes: subprocess.Popen) -> None:
    for p in processes:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_external_nodes_started_with_the_cli(secret_file):
    port = free_port()
    nodes = [_node(port, 1, 3, secret_file), _node(port, 2, 3, secret_file, env_vars=True)]
    intruder = _node(port, 2, 3, secret_file)  # a second node claiming rank 2 is turned away
    try:
        with DistributedCollector([counting5] * 2, ValuePolicy(), frames_per_batch=10, total_frames=-1,
                                  launcher="external", master_addr="127.0.0.1", tcp_port=port, timeout=120.0,
                                  secret_file=secret_file) as c:
            # (async: batches come from whichever node announces first; one node can deliver the
            # first several while the other is still taking its first steps)
            batches, it, deadline = [], iter(c), time.monotonic() + 60
            while len(batches) < 4 or {int(b[NODE_ID][0]) for b in batches} != {0, 1}:
                assert time.monotonic() < deadline, f"nodes delivering: {[int(b[NODE_ID][0]) for b in batches]}"
                batches.append(next(it))
            assert all(b.shape == torch.Size([10]) for b in batches)
            for b in batches:
                node = int(b[NODE_ID][0])
                assert ((b[TRAJ_IDS] // BLOCK) == node).all()
            c.update_policy_weights_({"w": torch.ones(1)})
            assert c.stats()["launcher"] == "external"
            # Both hellos for rank 2 must have reached rank 0 before it goes away (a node that
            # finds no rank 0 keeps trying to connect for its whole --timeout).
            deadline = time.monotonic() + 60
            while not c._pool.handshake.turned_away and time.monotonic() < deadline:
                c._pool.check_alive()
                time.sleep(0.05)
            assert len(c._pool.handshake.turned_away) == 1
        assert nodes[0].wait(timeout=30) == EXIT_OK
        # Whichever of the two claimed rank 2 first served; the other was turned away.
        assert sorted([nodes[1].wait(timeout=30), intruder.wait(timeout=30)]) == [EXIT_OK, EXIT_REJECTED]
    finally:
        _stop(*nodes, intruder)


def test_external_node_with_the_wrong_world_size_is_refused(secret_file):
    port = free_port()
    node = _node(port, 1, 5, secret_file)
    try:
        with pytest.raises(ValueError, match="--world-size 5"):
            DistributedCollector([counting5], frames_per_batch=10, launcher="external", master_addr="127.0.0.1",
                                 tcp_port=port, timeout=120.0, secret_file=secret_file)
        assert node.wait(timeout=30) == EXIT_REJECTED
    finally:
        _stop(node)


def test_external_launcher_times_out_clearly(capfd):
    from rlcollect import WorkerError

    port = free_port()
    with pytest.raises(WorkerError, match=r"nodes \[0\] did not start within start_timeout=1 s, during start-up "
                                          r"\(node 0 \(rank 1\): has not reached rank 0 \(no authentic hello\)"
                                          ) as info:
        DistributedCollector([counting5], frames_per_batch=10, launcher="external", master_addr="127.0.0.1",
                             tcp_port=port, start_timeout=1.0)
    assert info.value.worker_index == 0
    # What the user must do reaches stderr with no logging configured, with the bound that
    # applies (start_timeout, not the 300-s timeout of replies).
    err = capfd.readouterr().err
    assert f"rlcollect: waiting up to 1 s (start_timeout) for 1 node(s) to join 127.0.0.1:{port}; start them " in err
    assert f"  rlcollect node --master-addr 127.0.0.1 --master-port {port} --rank 1 --world-size 2" in err
    assert "rlcollect: wrote this run's secret to " in err and "give it to each node with --secret-file" in err


def test_submitit_launcher_with_the_local_executor(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", HELPERS)  # the jobs import dist_helpers, as a user's jobs import their code
    c = DistributedCollector([counting5] * 2, ValuePolicy(), frames_per_batch=20, total_frames=40, sync=True,
                             launcher="submitit", master_addr="127.0.0.1", timeout=150.0,
                             slurm_kwargs={"executor": "local", "folder": str(tmp_path / "jobs"), "timeout_min": 10})
    try:
        assert [b.shape for b in c] == [torch.Size([2, 10])] * 2
        jobs = c._pool.launcher.jobs
        assert len(jobs) == 2 and all(not job.done() for job in jobs.values())
        pids = node_pids(c)
    finally:
        c.shutdown()
    assert all(job.done() for job in jobs.values())
    assert not wait_gone(pids)


def test_submitit_delayed_jobs_wait_for_rank0(tmp_path, monkeypatch, secret_file):
    monkeypatch.setenv("PYTHONPATH", HELPERS)
    port = free_port()
    jobs = submit_nodes("127.0.0.1", port, world_size=2, timeout=150.0, secret_file=secret_file,
                        slurm_kwargs={"executor": "local", "folder": str(tmp_path / "jobs"), "timeout_min": 10})
    try:
        with DistributedCollector([counting5], frames_per_batch=10, total_frames=20, launcher="submitit_delayed",
                                  master_addr="127.0.0.1", tcp_port=port, timeout=150.0, secret_file=secret_file) as c:
            assert [b.shape for b in c] == [torch.Size([10])] * 2
        assert jobs[0].result() == EXIT_OK  # the node's exit code, once rank 0 closed it
    finally:
        for job in jobs:
            if not job.done():
                job.cancel()
            if job._process is not None:
                try:
                    job._process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    job._process.kill()
                    job._process.wait()


def test_the_submitit_job_folder_is_created_private_and_a_shared_one_is_refused(tmp_path):
    """Issue 23, item 9: the job folder holds pickles that run on the nodes."""
    pytest.importorskip("submitit")
    import stat

    from rlcollect.distributed.launch.launchers import make_executor

    fresh = tmp_path / "jobs"
    make_executor({"executor": "local", "folder": str(fresh)})
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    per_job = tmp_path / "per-job"
    make_executor({"executor": "local", "folder": str(per_job / "%j")})
    assert stat.S_IMODE(per_job.stat().st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match=r"writable by other users \(mode drwxrwxrwx\).*chmod 700"):
        make_executor({"executor": "local", "folder": str(shared)})
    group = tmp_path / "group"
    group.mkdir()
    group.chmod(0o770)
    with pytest.raises(ValueError, match="writable by other users"):
        make_executor({"executor": "local", "folder": str(group)})
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        with pytest.raises(ValueError, match="belongs to another user"):
            make_executor({"executor": "local", "folder": str(theirs)})
