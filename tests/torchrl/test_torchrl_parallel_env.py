"""torchrl's ``ParallelEnv`` in every collector: given as an instance to ``Collector``, and built
inside the workers (a factory returning a ``ParallelEnv``) of ``MultiSyncCollector``,
``MultiAsyncCollector`` and ``DistributedCollector``; batches compared with torchrl's own
``Collector`` on the same ``ParallelEnv``, every process and file descriptor cleaned up.

Runs in ``.venv-torchrl`` (``make test-torchrl``); skipped where torchrl is not installed.
Each ``ParallelEnv`` starts its own processes ("spawn": each imports torch and torchrl), hence
the long timeout on a loaded machine.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

pytest.importorskip("torchrl.collectors")

# torchrl.envs.libs.utils keeps the ImportError of its optional ``import gym`` in a module global
# (IMPORT_ERROR), traceback included. Imported lazily by the first GymEnv ever built, that
# traceback pins every frame of the call that built it: when that call is ParallelEnv(...)'s
# constructor (it builds one env in the main process for its metadata), the ParallelEnv and its
# shared-memory buffers (10 open fds here) stay alive for the whole process, closed or not.
# Importing it here pins only this import's frames.
import torchrl.envs.libs.utils  # noqa: E402, F401
import torch  # noqa: E402
from torchrl.collectors import Collector as TorchRLCollector  # noqa: E402
from torchrl.envs import ParallelEnv  # noqa: E402
from torchrl.modules import MLP, QValueActor  # noqa: E402

from rlcollect import Collector, DistributedCollector, MultiAsyncCollector, MultiSyncCollector  # noqa: E402

from helpers_torchrl import actor, cartpole, leaves, our_leaves  # noqa: E402

pytestmark = pytest.mark.timeout(420)

ROWS = 2  # envs per ParallelEnv
FRAMES = 100  # frames per batch of one ParallelEnv: ROWS rows of 50 steps
# ParallelEnv.close() waits until its processes have exited, each after a full interpreter
# teardown (seconds on a loaded machine). A worker still closing its ParallelEnv when the
# shutdown timeout (default 10 s) is mostly spent is terminated, before that close has released
# the ParallelEnv's named semaphores: they would stay in /dev/shm until the main process exits.
CLOSE_S = 120.0


# -- envs and policies (module level: the multi-process collectors send them to workers) --------
def parallel_cartpole() -> ParallelEnv:
    if multiprocessing.current_process().daemon:  # what a daemonic worker would meet
        raise AssertionError("the collector's worker is daemonic: it cannot start ParallelEnv's processes")
    return ParallelEnv(ROWS, cartpole)


def greedy_actor() -> QValueActor:
    torch.manual_seed(0)
    return QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                       spec=cartpole().action_spec)


def torchrl_batches(policy_fn, n: int = 1, seed: int | None = None) -> list:
    """Batches of torchrl's own Collector on a fresh ParallelEnv (closed by its shutdown)."""
    env = parallel_cartpole()
    if seed is not None:
        env.set_seed(seed)
    c = TorchRLCollector(env, policy_fn(), frames_per_batch=FRAMES, total_frames=n * FRAMES)
    try:
        return [b.clone() for b in c]
    finally:
        c.shutdown()
        assert env.is_closed  # torchrl's shutdown(close_env=True) closes the env it was given


@pytest.fixture(scope="module")
def theirs() -> dict:
    """The layout of torchrl's Collector on a ParallelEnv with the ProbabilisticActor."""
    (batch,) = torchrl_batches(actor)
    assert batch.shape == (ROWS, FRAMES // ROWS)
    return leaves(batch)


def env_pids(env: ParallelEnv) -> list[int]:
    return [p.pid for p in env._workers]  # no public accessor for a ParallelEnv's processes


def wait_gone(pids, timeout: float) -> set[int]:
    """The pids of ``pids`` still running (not zombies) after up to ``timeout`` seconds."""
    def alive() -> set[int]:
        left = set()
        for pid in pids:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.rfind(b")") + 2:][:1] != b"Z":
                left.add(pid)
        return left

    deadline = time.monotonic() + timeout
    while alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive()


# -- Collector: a ParallelEnv instance ------------------------------------------------------------
def test_collector_with_a_parallel_env_has_torchrls_layout_and_closes_it(theirs):
    env = parallel_cartpole()
    c = Collector(env, actor(), frames_per_batch=FRAMES, total_frames=2 * FRAMES)
    try:
        batches = [b.clone() for b in c]
        pids = env_pids(env)
        assert len(pids) == ROWS and wait_gone(pids, 0) == set(pids)  # they run until shutdown
    finally:
        c.shutdown()
    assert len(batches) == 2
    for batch in batches:
        assert batch.shape == (ROWS, FRAMES // ROWS)
        assert leaves(batch) == theirs
    # As torchrl's Collector with close_env=True: the env it was given is closed on shutdown.
    assert env.is_closed
    assert not wait_gone(pids, 10.0)


def test_collector_values_equal_torchrls_on_a_seeded_parallel_env():
    theirs = torchrl_batches(greedy_actor, n=2, seed=0)
    env = parallel_cartpole()
    c = Collector(env, greedy_actor(), frames_per_batch=FRAMES, total_frames=2 * FRAMES)
    try:
        c.set_seed(0)  # seeds the env (worker i gets seed + i) and resets it, as torchrl's does
        ours = [b.clone() for b in c]
    finally:
        c.shutdown()
    assert len(ours) == len(theirs) == 2
    for a, b in zip(theirs, ours):
        assert leaves(a) == leaves(b)
        for key in a.keys(include_nested=True, leaves_only=True):
            assert torch.equal(a[key], b[key]), key
    ends = torch.cat([b["next", "done"] for b in ours], dim=1)
    assert ends.any()  # episodes ended (and were reset per row) inside the compared stream


# -- multi-process collectors: a ParallelEnv built inside each (non-daemonic) worker ------------
def test_multisync_with_parallel_envs_in_workers_has_torchrls_layout(theirs):
    c = MultiSyncCollector([parallel_cartpole, parallel_cartpole], actor(), frames_per_batch=2 * FRAMES,
                           total_frames=4 * FRAMES)
    try:
        batches = [b.clone() for b in c]
    finally:
        c.shutdown(timeout=CLOSE_S)
    assert len(batches) == 2
    for batch in batches:
        assert batch.shape == (2, ROWS, FRAMES // ROWS)  # (workers, env rows, time), as torchrl's
        for worker in range(2):
            assert leaves(batch[worker]) == theirs
    ids = torch.cat([b["collector", "traj_ids"].reshape(-1) for b in batches])
    first = batches[0]["collector", "traj_ids"][:, :, 0]
    assert len(set(first.reshape(-1).tolist())) == 2 * ROWS  # each worker's rows: distinct trajectories
    assert (ids >= 0).all()


def test_multiasync_with_parallel_envs_in_workers_has_torchrls_layout(theirs):
    c = MultiAsyncCollector([parallel_cartpole, parallel_cartpole], actor(), frames_per_batch=FRAMES,
                            total_frames=4 * FRAMES)
    try:
        batches = [b.clone() for b in c]
    finally:
        c.shutdown(timeout=CLOSE_S)
    assert len(batches) == 4
    for batch in batches:
        assert batch.shape == (ROWS, FRAMES // ROWS)
        assert our_leaves(batch) == theirs
    assert {int(b["collector", "worker_id"].unique()) for b in batches} == {0, 1}


def test_distributed_collector_with_parallel_envs_on_nodes(theirs):
    c = DistributedCollector([parallel_cartpole, parallel_cartpole], actor(), frames_per_batch=2 * FRAMES,
                             total_frames=2 * FRAMES, sync=True, timeout=300.0)
    try:
        batches = [b.clone() for b in c]
    finally:
        c.shutdown(timeout=CLOSE_S)
    assert sum(b.numel() for b in batches) == 2 * FRAMES
    for batch in batches:
        rows = batch.reshape(-1, *batch.shape[-2:]) if batch.ndim > 2 else batch[None]
        for row in rows:
            assert our_leaves(row) == theirs


SEMAPHORES_PER_PARALLEL_ENV = 5 * ROWS  # one multiprocessing Event (5 named semaphores) per env process


def test_parallel_env_processes_end_when_their_worker_is_killed(leak_checker):
    from rlcollect import WorkerError

    before = leak_checker.Snapshot.take()
    c = MultiSyncCollector([parallel_cartpole, parallel_cartpole], None, frames_per_batch=2 * FRAMES,
                           total_frames=-1)
    it = iter(c)
    next(it)
    worker = c.worker_pids()[0]  # no public accessor for a worker's pid
    # ParallelEnv's processes, and the fork server that starts them when the worker's start
    # method is "forkserver" (inherited from ours, the default).
    theirs = list(leak_checker.descendants(worker))
    assert len(theirs) >= ROWS
    os.kill(worker, signal.SIGKILL)
    with pytest.raises(WorkerError, match="worker 0"):
        for _ in range(5):
            next(it)
    c.shutdown(timeout=CLOSE_S, raise_on_error=False)
    # ParallelEnv's processes (and fork server), orphaned (re-parented away from this process
    # tree, so the leak check cannot see them), read end of file on their pipes and exit.
    assert not wait_gone(theirs, 30.0)
    # What is left: at most the named semaphores of the killed worker's ParallelEnv (nothing
    # in the worker can unlink them; the resource tracker that learnt of them does, when it exits).
    # The other worker unlinks its own, even when the worker error's shutdown (default timeout)
    # terminates it in the middle of its ParallelEnv's close (a loaded machine).
    left = leak_checker.find_leaks(before, child_grace=0.0, fd_grace=0.0).shm
    try:
        assert all(name.startswith("sem.mp-") for name in left), sorted(left)
        assert len(left) <= SEMAPHORES_PER_PARALLEL_ENV
    finally:
        leak_checker.remove_shm(left)  # what the resource tracker would do at exit


class SlowToCloseParallelEnv(ParallelEnv):
    """A ParallelEnv whose ``close()`` first waits a minute: its worker is still closing it when
    the shutdown timeout runs out (what a loaded machine does to a real close, less reliably)."""

    def close(self, *args, **kwargs):
        time.sleep(60.0)
        super().close(*args, **kwargs)


def slow_to_close_parallel_cartpole() -> SlowToCloseParallelEnv:
    return SlowToCloseParallelEnv(ROWS, cartpole)


def test_a_worker_terminated_while_closing_its_parallel_env_unlinks_its_semaphores(leak_checker):
    # Regression: the pool's SIGTERM killed the worker by the signal's default action, leaving the
    # ParallelEnv's named semaphores in /dev/shm (the leak check's "sem.mp-*" entries) until the
    # main process exited. The worker now unlinks them before dying of SIGTERM.
    c = MultiSyncCollector([slow_to_close_parallel_cartpole], None, frames_per_batch=FRAMES, total_frames=FRAMES)
    try:
        (batch,) = list(c)
        worker = c.worker_pids()[0]  # no public accessor for a worker's pid
        theirs = list(leak_checker.descendants(worker))
    finally:
        c.shutdown(timeout=2.0)  # 1.2 s to exit, then SIGTERM
    assert batch.shape == (1, ROWS, FRAMES // ROWS)
    assert len(theirs) >= ROWS
    # Never told to close, ParallelEnv's processes read end of file on their pipe and exit.
    assert not wait_gone(theirs, 30.0)
