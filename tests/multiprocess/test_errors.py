"""Bad input and failures (SPEC 9 first two bullets, SPEC 10): arguments are refused in the main
process before any worker starts, with the argument named; an exception in a worker comes back
as the same type with the worker's traceback; a worker that dies, crashes or hangs becomes a
WorkerError within seconds, and the collector is then shut down with no worker left."""

from __future__ import annotations

import functools
import os
import signal
import threading
import time

import gymnasium as gym
import pytest
import torch
from mp_helpers import (
    START,
    ValuePolicy,
    counting5,
    descendant_pids,
    env_failing_with_two_arg_error,
    faulty_env,
    make_value_policy,
    policy_factory_failing,
    slow_env,
    wait_gone,
)

import rlcollect.multiprocess.lifecycle as lifecycle
from rlcollect import InjectedFault, MultiAsyncCollector, MultiSyncCollector, WorkerError

pytestmark = pytest.mark.timeout(60)

CLASSES = [MultiSyncCollector, MultiAsyncCollector]


# -- validation before any worker starts ------------------------------------------------------------------
@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if a worker pool is started (lifecycle.py starts it)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a worker pool was started before the arguments were validated")

    monkeypatch.setattr(lifecycle, "WorkerPool", refuse)


def _locked_factory():
    lock = threading.Lock()
    return lambda: (lock, counting5())[1]


OK = {"num_workers": 2, "frames_per_batch": 4}
BAD_INPUTS = [
    # (id, create_env_fn, kwargs replacing OK, exception type, words the message must hold)
    ("num_workers-missing", counting5, {"num_workers": None}, ValueError, ["num_workers"]),
    ("num_workers-0", counting5, {"num_workers": 0}, ValueError, ["num_workers", "0"]),
    ("num_workers-vs-env-list", [counting5, counting5], {"num_workers": 3}, ValueError, ["num_workers=3", "2"]),
    ("env-list-empty", [], {"num_workers": None}, ValueError, ["create_env_fn"]),
    ("frames_per_batch-0", counting5, {"frames_per_batch": 0}, ValueError, ["frames_per_batch", "0"]),
    ("frames_per_batch-list-length", counting5, {"frames_per_batch": [4, 4, 4]}, ValueError,
     ["frames_per_batch", "3", "2 workers"]),
    ("frames_per_batch-list-value", counting5, {"frames_per_batch": [4, -1]}, ValueError, ["frames_per_batch", "-1"]),
    ("total_frames-0", counting5, {"total_frames": 0}, ValueError, ["total_frames", "0"]),
    ("device-list-length", counting5, {"device": ["cpu"]}, ValueError, ["device", "2 workers"]),
    ("create_env_kwargs-list-length", counting5, {"create_env_kwargs": [{}]}, ValueError,
     ["create_env_kwargs", "2 workers"]),
    ("policy_factory-list-length", counting5, {"policy_factory": [make_value_policy] * 3}, ValueError,
     ["policy_factory", "2 workers"]),
    ("policy-and-policy_factory-without-scheme", counting5, {"policy": ValuePolicy(),
                                                             "policy_factory": make_value_policy},
     ValueError, ["policy_factory", "weight_sync_schemes"]),
    ("cat_results-bogus", counting5, {"cat_results": "bogus"}, ValueError, ["cat_results", "'bogus'"]),
    ("cat_results-float", counting5, {"cat_results": 1.5}, ValueError, ["cat_results", "1.5"]),
    ("mp_start_method-bogus", counting5, {"mp_start_method": "bogus"}, ValueError, ["mp_start_method", "'bogus'"]),
    ("worker_timeout-negative", counting5, {"worker_timeout": -1}, ValueError, ["worker_timeout", "-1"]),
    ("collector_class-bogus", counting5, {"collector_class": "bogus"}, ValueError, ["collector_class", "'bogus'"]),
    ("on_worker_failure-bogus", counting5, {"on_worker_failure": "bogus"}, ValueError, ["on_worker_failure"]),
    ("num_sub_threads-0", counting5, {"num_sub_threads": 0}, ValueError, ["num_sub_threads"]),
    ("weight_sync_schemes-bogus", counting5, {"weight_sync_schemes": {"policy": "bogus"}}, ValueError,
     ["weight_sync_schemes", "'bogus'"]),
    ("unknown-argument", counting5, {"frames_per_batchh": 4}, TypeError, ["frames_per_batchh"]),
    ("env-factory-not-picklable", _locked_factory(), {}, TypeError, ["create_env_fn", "factory function"]),
    ("policy-not-picklable", counting5, {"policy": functools.partial(lambda lock, x: x, threading.Lock())},
     TypeError, ["policy", "policy_factory"]),
]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("env, changes, error, words", [case[1:] for case in BAD_INPUTS],
                         ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_is_refused_before_any_worker_starts(no_workers, cls, env, changes, error, words):
    kwargs = {**OK, "mp_start_method": START, **changes}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    with pytest.raises(error) as info:
        cls(env, **kwargs)
    for word in words:
        assert word in str(info.value), f"{word!r} not in the message: {info.value}"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_preemptive_threshold_out_of_range_is_refused(no_workers, cls):
    with pytest.raises(ValueError, match="preemptive_threshold") as info:
        cls(counting5, num_workers=2, frames_per_batch=4, preemptive_threshold=1.5, mp_start_method=START)
    if cls is MultiSyncCollector:
        assert "1.5" in str(info.value) and "[0, 1]" in str(info.value)


# -- failures inside workers ---------------------------------------------------------------------------------
def _assert_closed_and_gone(collector, pids, timeout=3.0):
    assert not wait_gone(pids, timeout), "a worker outlived the failure"
    with pytest.raises(RuntimeError, match="shut down"):
        next(collector)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_exception_in_a_worker_is_reraised_with_its_type_and_traceback(cls):
    collector = cls(faulty_env, num_workers=2, frames_per_batch=8, mp_start_method=START,
                    create_env_kwargs={"fault": "raise", "at_step": 3, "worker_ids": [1]})
    pids = collector.worker_pids()
    try:
        with pytest.raises(InjectedFault) as info:
            # Async: worker 0 may deliver many batches before worker 1's failure is read.
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                next(collector)
        message = str(info.value)
        assert "injected fault at step 3" in message
        assert "worker 1" in message
        assert "Traceback" in message and "_maybe_fail" in message
        assert info.value.worker_index == 1
        _assert_closed_and_gone(collector, pids)
    finally:
        collector.shutdown()


def test_env_factory_failing_at_start_up_reraises_the_original_type():
    with pytest.raises(Exception) as reference:
        gym.make("NoSuchEnv-v0")
    before, threads = descendant_pids(), torch.get_num_threads()
    with pytest.raises(type(reference.value)) as info:
        MultiSyncCollector("NoSuchEnv-v0", num_workers=2, frames_per_batch=4, mp_start_method=START,
                           num_threads=1 if threads != 1 else 2)
    assert type(info.value) is type(reference.value)
    assert "NoSuchEnv" in str(info.value)
    assert "start-up" in str(info.value) and "Traceback" in str(info.value)
    assert not wait_gone(descendant_pids() - before, 3.0)
    assert torch.get_num_threads() == threads


def test_policy_factory_failing_at_start_up_reraises_the_original_type():
    before = descendant_pids()
    with pytest.raises(LookupError, match="policy factory failed on purpose") as info:
        MultiSyncCollector(counting5, policy_factory=policy_factory_failing, num_workers=2, frames_per_batch=4,
                           mp_start_method=START)
    assert "policy_factory_failing" in str(info.value)  # the worker's traceback
    assert not wait_gone(descendant_pids() - before, 3.0)


def test_exception_that_cannot_be_rebuilt_becomes_a_worker_error():
    with pytest.raises(WorkerError) as info:
        MultiAsyncCollector(env_failing_with_two_arg_error, num_workers=1, frames_per_batch=4, mp_start_method=START)
    message = str(info.value)
    assert "TwoArgError" in message and "code 7: env factory failed on purpose" in message
    assert "env_failing_with_two_arg_error" in info.value.worker_traceback
    assert info.value.worker_index == 0


def test_shape_mismatch_found_after_start_up_shuts_the_workers_down():
    before = descendant_pids()
    with pytest.raises(ValueError, match="same shape"):
        MultiSyncCollector(counting5, num_workers=2, frames_per_batch=[4, 6], mp_start_method=START)
    assert not wait_gone(descendant_pids() - before, 3.0)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_worker_killed_mid_batch_is_a_worker_error_within_3_s(cls):
    # Each batch takes worker 1 about 10 s (200 steps of 50 ms): it is killed in the middle.
    collector = cls(slow_env, num_workers=2, frames_per_batch=400 if cls is MultiSyncCollector else 200,
                    mp_start_method=START)
    pids = collector.worker_pids()
    killed_at = []

    def kill():
        time.sleep(1.0)
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Thread(target=kill)
    try:
        killer.start()
        with pytest.raises(WorkerError) as info:
            next(collector)
        detected = time.monotonic() - killed_at[0]
        assert detected < 3.0, f"the death was noticed after {detected:.1f} s"
        err = info.value
        assert err.worker_index == 1 and err.exitcode == -signal.SIGKILL
        assert "worker 1" in str(err) and "SIGKILL" in str(err)
        _assert_closed_and_gone(collector, pids)
    finally:
        killer.join()
        collector.shutdown()


@pytest.mark.parametrize("fault, exitcode, words", [
    ("exit", 3, ["exited with code 3"]),
    ("segfault", -signal.SIGSEGV, ["SIGSEGV", "-11"]),
    ("kill", -signal.SIGKILL, ["SIGKILL"]),
])
def test_worker_dying_on_its_own_is_a_worker_error(fault, exitcode, words):
    collector = MultiSyncCollector(faulty_env, num_workers=1, frames_per_batch=4, mp_start_method=START,
                                   create_env_kwargs={"fault": fault, "at_step": 6})
    pids = collector.worker_pids()
    try:
        next(collector)  # steps 1-4
        with pytest.raises(WorkerError) as info:
            next(collector)  # dies at step 6
        err = info.value
        assert err.worker_index == 0 and err.exitcode == exitcode
        for word in words:
            assert word in str(err)
        _assert_closed_and_gone(collector, pids)
    finally:
        collector.shutdown()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_hung_worker_is_a_worker_error_after_worker_timeout(cls):
    collector = cls(faulty_env, num_workers=1, frames_per_batch=4, worker_timeout=1, mp_start_method=START,
                    create_env_kwargs={"fault": "hang", "at_step": 2})
    pids = collector.worker_pids()
    try:
        started = time.monotonic()
        with pytest.raises(WorkerError) as info:
            next(collector)
        elapsed = time.monotonic() - started
        assert 1.0 <= elapsed < 3.0, f"the hang was reported after {elapsed:.1f} s (worker_timeout=1)"
        assert info.value.worker_index == 0
        assert "worker_timeout" in str(info.value) and "worker 0" in str(info.value)
        _assert_closed_and_gone(collector, pids)
    finally:
        collector.shutdown()
