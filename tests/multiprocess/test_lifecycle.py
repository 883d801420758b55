"""Lifecycle of the worker processes (SPEC 5 "Shutdown"): `with`, idempotent shutdown, garbage
collection, an exception escaping iteration, a SIGKILLed main process, and repeated
create/shutdown cycles that leave no process, file descriptor or /dev/shm entry behind."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import weakref

import pytest
import torch
from mp_helpers import (
    START,
    counting5,
    descendant_pids,
    open_fd_count,
    pid_alive,
    shm_entries,
    wait_gone,
)
from procs import own_tmpdir  # noqa: F401  (fixture)

from rlcollect import MultiAsyncCollector, MultiSyncCollector

pytestmark = pytest.mark.timeout(60)

CLASSES = [MultiSyncCollector, MultiAsyncCollector]


def _closed(collector) -> bool:
    try:
        next(collector)
    except RuntimeError as err:
        return "shut down" in str(err)
    return False


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_with_block_shuts_down(cls):
    with cls(counting5, num_workers=2, frames_per_batch=4, mp_start_method=START) as collector:
        pids = collector.worker_pids()
        assert all(pid_alive(p) for p in pids)
        next(collector)
    assert not wait_gone(pids, 0.5), "shutdown returned before its workers were gone"
    assert _closed(collector)


def test_shutdown_is_idempotent_and_bounded():
    collector = MultiSyncCollector(counting5, num_workers=2, frames_per_batch=4, mp_start_method=START)
    pids = collector.worker_pids()
    next(collector)
    started = time.monotonic()
    collector.shutdown(timeout=2)
    assert time.monotonic() - started < 2.5
    assert not wait_gone(pids, 0.5)
    collector.shutdown()
    collector.shutdown(timeout=0)
    collector.__exit__(None, None, None)
    assert _closed(collector)
    stats = collector.stats()
    assert [w["alive"] for w in stats["workers"]] == [False, False]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_garbage_collection_ends_the_workers(cls):
    collector = cls(counting5, num_workers=2, frames_per_batch=4, mp_start_method=START)
    pids = collector.worker_pids()
    next(collector)  # the collector's own iterator now refers back to it: a reference cycle
    del collector
    gc.collect()
    assert not wait_gone(pids, 5.0), "the workers of a garbage-collected collector are still alive"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_dropped_collector_is_freed_at_once(cls):
    """Its collaborators (weights, restarts, statistics) hold no reference back to it: dropping
    the last reference frees it and ends the workers without waiting for a garbage collection."""
    collector = cls(counting5, num_workers=2, frames_per_batch=4, mp_start_method=START)
    pids = collector.worker_pids()
    ref = weakref.ref(collector)
    gc.disable()
    try:
        del collector
        assert ref() is None, gc.get_referrers(ref())
    finally:
        gc.enable()
    assert not wait_gone(pids, 5.0), "the workers of a freed collector are still alive"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_exception_escaping_iteration_shuts_the_workers_down(cls):
    def postproc(batch):
        raise ArithmeticError("raised by postproc in the main process")

    collector = cls(counting5, num_workers=2, frames_per_batch=4, postproc=postproc, mp_start_method=START)
    pids = collector.worker_pids()
    with pytest.raises(ArithmeticError, match="postproc"):
        for _ in collector:
            pass
    assert not wait_gone(pids, 3.0)
    assert _closed(collector)


# -- the main process dies --------------------------------------------------------------------------------
PARENT = textwrap.dedent("""
    import functools, sys, time

    if __name__ == "__main__":  # imports here: each worker re-runs this file as __mp_main__
        from rlcollect import CountingEnv, MultiSyncCollector

        collector = MultiSyncCollector(functools.partial(CountingEnv, max_steps=5), num_workers=2,
                                       frames_per_batch=8, mp_start_method=sys.argv[1])
        next(collector)
        print(" ".join(map(str, collector.worker_pids())), flush=True)
        if sys.argv[2] == "sleep":
            time.sleep(600)
        # else: the interpreter exits with the collector never shut down
""")


def _start_parent(tmp_path, temp, method: str, then: str):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    # TMPDIR=temp: a SIGKILLed parent never removes its multiprocessing temp folder (pymp-*)
    parent = subprocess.Popen([sys.executable, str(script), method, then], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TMPDIR": str(temp)})
    try:
        line = parent.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, f"the parent process printed {line!r} (exit code {parent.poll()})"
    except BaseException:
        parent.kill()
        parent.wait(10)
        parent.stdout.close()
        raise
    return parent, pids


@pytest.mark.timeout(120)  # a fresh interpreter and its workers import torch: slow on a loaded machine
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_exit_when_the_main_process_is_sigkilled(tmp_path, own_tmpdir, method):
    parent, pids = _start_parent(tmp_path, own_tmpdir, method, "sleep")
    try:
        assert parent.poll() is None, f"the parent process died: {parent.returncode}"
        assert all(pid_alive(p) for p in pids)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        killed_at = time.monotonic()
        alive = wait_gone(pids, 3.0)
        assert not alive, f"workers {alive} outlived their SIGKILLed main process by 3 s"
        assert time.monotonic() - killed_at < 3.0
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        parent.stdout.close()


@pytest.mark.timeout(120)
def test_interpreter_exit_without_shutdown_ends_the_workers(tmp_path, own_tmpdir):
    parent, pids = _start_parent(tmp_path, own_tmpdir, START, "exit")
    try:
        assert parent.wait(30) == 0, "the main process did not exit cleanly"
        assert not wait_gone(pids, 1.0), "workers outlived a main process that exited without shutdown()"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        parent.stdout.close()


# -- many create/shutdown cycles ------------------------------------------------------------------------------
def _cycle(method: str, keep: list) -> None:
    collector = MultiSyncCollector(counting5, num_workers=2 if method == START else 1, frames_per_batch=4,
                                   mp_start_method=method)
    pids = collector.worker_pids()
    next(collector)
    collector.shutdown()
    assert not wait_gone(pids, 1.0)
    keep.append(collector)  # a shut-down collector that is still referenced holds nothing either


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method, cycles", [(START, 20), ("spawn", 2)])
def test_create_shutdown_cycles_leave_nothing_behind(method, cycles, leak_checker):
    keep: list = []
    _cycle(method, keep)  # the first one may start the fork server and lazy helpers
    threads = torch.get_num_threads()
    children, fds, shm = descendant_pids(), open_fd_count(), shm_entries()
    for _ in range(cycles):
        _cycle(method, keep)
    assert descendant_pids() - children == set()
    assert open_fd_count() <= fds + 2, f"{open_fd_count() - fds} file descriptors more after {cycles} cycles"
    new = {n for n in shm_entries() - shm if n.startswith(("torch_", "psm_", "sem."))}
    # /dev/shm is the machine's: count only the entries this test's process tree made
    assert leak_checker.shm_tracker().ours(new) == set()
    assert torch.get_num_threads() == threads
