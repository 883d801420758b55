"""Issue 13.8: a hanging env constructor ends construction after ``start_timeout`` seconds with a
``WorkerError`` naming the worker and "during start-up" (it used to wait a fixed 300 s), and the
argument is validated in the main process before any worker starts."""

from __future__ import annotations

import functools
import multiprocessing
import time

import pytest

from rlcollect import MultiAsyncCollector, MultiSyncCollector, WorkerError
from rlcollect.envs.testing import CountingEnv

START = "forkserver"
multiprocessing.get_context(START).set_forkserver_preload(["torch", "tensordict", "rlcollect.multiprocess.worker"])

hanging_env = functools.partial(time.sleep, 3600)  # an env constructor that never returns
counting = functools.partial(CountingEnv, max_steps=5)


@pytest.fixture(scope="module")
def warm_fork_server():
    """Start the fork server once: its start-up (importing torch) counts against start_timeout,
    and on a loaded machine it can take longer than the short timeout this test uses."""
    with MultiSyncCollector(counting, num_workers=1, frames_per_batch=5, mp_start_method=START):
        pass


@pytest.mark.timeout(90)
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector], ids=["sync", "async"])
def test_hanging_constructor_fails_after_start_timeout(cls, warm_fork_server):
    # Worker 0 is healthy, worker 1 hangs in its env constructor.
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        cls([counting, hanging_env], frames_per_batch=10, mp_start_method=START, start_timeout=4.0)
    elapsed = time.monotonic() - started
    err = info.value
    assert err.worker_index == 1
    assert "worker 1" in str(err) and "during start-up" in str(err) and "start_timeout=4 s" in str(err), str(err)
    # start_timeout bounds the wait (plus the bounded shutdown of the hung worker: <= 2 s).
    assert 4.0 <= elapsed <= 4.0 + 2.0 + 1.0, f"construction took {elapsed:.1f} s"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "10", True, None])
def test_start_timeout_is_validated_before_any_worker_starts(value):
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"start_timeout must be a positive, finite number of seconds .*got"):
        MultiSyncCollector(counting, num_workers=2, frames_per_batch=10, mp_start_method=START, start_timeout=value)
    assert multiprocessing.active_children() == [] or time.monotonic() - started < 0.5


def test_start_timeout_default_is_120_s():
    import inspect

    assert inspect.signature(MultiSyncCollector.__init__).parameters["start_timeout"].default == 120.0
    assert inspect.signature(MultiAsyncCollector.__init__).parameters["start_timeout"].default == 120.0
