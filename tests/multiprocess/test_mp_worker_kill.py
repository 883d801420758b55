"""Issue 13.13: a worker SIGKILLed at any moment of a batch reaches the user as the documented
``WorkerError`` naming the worker and the signal within a second (or, with
``on_worker_failure="restart"``, is restarted exactly once and the batch completes), never as
``KeyError: 0``.

A dying process closes its file descriptors one at a time, so the main process can see the
worker's sentinel fire a moment before its pipe reads as closed; that ordering is what led
``MultiSyncCollector`` to the ``KeyError``.  It is rare on its own, so the ``sentinel_first``
fixture makes it certain: it wraps the pool's ``wait`` so that a dead worker's pipe is reported
one call after its sentinel, exactly the order the kernel may produce.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from procs import own_tmpdir  # noqa: F401  (fixture)
from rlcollect import MultiAsyncCollector, MultiSyncCollector, WorkerError
from rlcollect.envs.testing import SleepEnv
from rlcollect.multiprocess import pool as pool_module

START = "forkserver"
multiprocessing.get_context(START).set_forkserver_preload(["torch", "tensordict", "rlcollect.multiprocess.worker"])

# 10 ms steps, 100 steps per worker: batches of about 1 s, as in the report.
slow_env = functools.partial(SleepEnv, step_time=0.01, obs_dim=1)
FRAMES_PER_WORKER = 100
#: Moments of a batch (seconds after it was requested) at which worker 0 is killed.
KILL_AT = (0.0, 0.3, 0.6, 0.95)


@pytest.fixture
def sentinel_first(monkeypatch):
    """Make the pool see a dying worker's sentinel before its pipe: when a pipe reads as ready
    and its process's sentinel fires within 50 ms, report the sentinel alone."""
    real_wait = pool_module.wait

    def wait(objects, timeout=None):
        ready = real_wait(objects, timeout)
        half = len(objects) // 2  # WorkerPool._wait passes [*conns, *sentinels], pairwise
        conns, sentinels = objects[:half], objects[half:]
        out = []
        for r in ready:
            if r in conns:
                sentinel = sentinels[conns.index(r)]
                if sentinel in ready or real_wait([sentinel], 0.05):
                    if sentinel not in out:
                        out.append(sentinel)
                    continue
            if r not in out:
                out.append(r)
        return out

    monkeypatch.setattr(pool_module, "wait", wait)


def _kill_later(pid: int, delay: float) -> dict:
    when: dict = {}

    def kill():
        when["t"] = time.monotonic()
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(delay, kill)
    timer.start()
    when["timer"] = timer
    return when


def _collector(cls, **kwargs):
    n = 2
    frames = FRAMES_PER_WORKER * n if cls is MultiSyncCollector else FRAMES_PER_WORKER
    return cls(slow_env, num_workers=n, frames_per_batch=frames, mp_start_method=START, **kwargs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector], ids=["sync", "async"])
def test_sigkill_mid_batch_raises_worker_error(cls, sentinel_first):
    for delay in KILL_AT:
        collector = _collector(cls)
        try:
            batches = iter(collector)
            next(batches)
            victim = collector.worker_pids()[0]
            others = collector.worker_pids()[1:]
            when = _kill_later(victim, delay)
            with pytest.raises(WorkerError) as info:
                for _ in range(20):  # async: the other worker's batches arrive meanwhile
                    next(batches)
            raised = time.monotonic()
            when["timer"].join()
            assert "t" in when, f"kill at {delay} s: the error came before the kill: {info.value}"
            err = info.value
            assert err.worker_index == 0, (delay, str(err))
            assert "worker 0" in str(err) and "SIGKILL" in str(err), (delay, str(err))
            assert err.exitcode == -signal.SIGKILL
            assert raised - when["t"] <= 1.0, f"kill at {delay} s: WorkerError came {raised - when['t']:.2f} s later"
            assert collector._closed  # the collector shut itself down
        finally:
            collector.shutdown()
        deadline = time.monotonic() + 5
        while any(_alive(p) for p in others) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not any(_alive(p) for p in others)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector], ids=["sync", "async"])
def test_sigkill_mid_batch_restarts_once_per_kill(cls, sentinel_first):
    collector = _collector(cls, on_worker_failure="restart", max_worker_restarts=len(KILL_AT))
    try:
        batches = iter(collector)
        next(batches)
        for k, delay in enumerate(KILL_AT, start=1):
            victim = collector.worker_pids()[0]
            when = _kill_later(victim, delay)
            if cls is MultiSyncCollector:
                batch = next(batches)
                assert batch.shape == (2, FRAMES_PER_WORKER)
            else:  # read until the replacement of worker 0 delivered a batch
                for _ in range(40):
                    batch = next(batches)
                    if collector.stats()["restarts"] == k and batch["collector", "worker_id"][0].item() == 0:
                        break
                assert batch.shape == (FRAMES_PER_WORKER,)
            when["timer"].join()
            assert "t" in when
            assert collector.stats()["restarts"] == k, f"kill {k} at {delay} s"
            assert collector.worker_pids()[0] != victim
            # every frame of the delivered batch was collected (no unwritten slot)
            assert bool((batch["next", "observation"] == batch["observation"] + 1).all())
        assert [w["restarts"] for w in collector.stats()["workers"]] == [len(KILL_AT), 0]
    finally:
        collector.shutdown()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_a_sigkilled_worker_leaves_no_multiprocessing_temp_folder(method, own_tmpdir):
    # multiprocessing gives a process a pymp-* temp folder when it first needs one (a fork
    # server's address, the listener that hands tensors' file descriptors on) and removes it
    # only at a normal exit; a SIGKILLed process that had one leaves it. The script runs with
    # its own TMPDIR, SIGKILLs a worker, and reports the folders other than its own.
    temp = own_tmpdir
    script = Path(__file__).with_name("mp_worker_kill_tmp_script.py")
    proc = subprocess.run([sys.executable, str(script), method], capture_output=True, text=True, timeout=200,
                          env={**os.environ, "TMPDIR": str(temp)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []  # none made by the workers
    assert sorted(p.name for p in temp.glob("pymp-*")) == []  # and the main process's removed at its exit
