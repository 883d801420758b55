"""torchrl 0.14's ``init_fn`` on the multi-process collectors: called with no argument in each
worker process before its env and policy are built (again in a worker started to replace one
that died); an error in it reaches the user as a start-up failure of that worker."""

from __future__ import annotations

import os
import signal

import gymnasium as gym
import pytest
from mp_helpers import START, ValuePolicy, descendant_pids, wait_gone

from rlcollect import MultiAsyncCollector, MultiSyncCollector

pytestmark = pytest.mark.timeout(90)

ENV_ID = "RlcollectInitFnCartPole-v0"  # registered only by init_fn, in the workers


def register_env(log_path: str):
    """An init_fn: registers ENV_ID in this process and notes its pid in ``log_path``."""

    def init():
        gym.register(id=ENV_ID, entry_point="gymnasium.envs.classic_control:CartPoleEnv", max_episode_steps=20)
        with open(log_path, "a") as log:
            log.write(f"{os.getpid()}\n")

    return init


def pids_in(log_path) -> list[int]:
    with open(log_path) as log:
        return [int(line) for line in log.read().split()]


@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector])
def test_init_fn_runs_in_each_worker_before_its_env_is_made(cls, tmp_path):
    assert ENV_ID not in gym.registry  # the env id exists only where init_fn ran
    log = str(tmp_path / "init.log")
    c = cls(ENV_ID, ValuePolicy(w=1), num_workers=2, frames_per_batch=20, total_frames=40, init_fn=register_env(log),
            mp_start_method=START)
    try:
        workers = c.worker_pids()
        assert sum(batch.numel() for batch in c) == 40
    finally:
        c.shutdown()
    assert sorted(pids_in(log)) == sorted(workers)
    assert ENV_ID not in gym.registry


def test_a_restarted_worker_runs_init_fn_again(tmp_path):
    log = str(tmp_path / "init.log")
    c = MultiSyncCollector(ENV_ID, ValuePolicy(w=1), num_workers=2, frames_per_batch=20, init_fn=register_env(log),
                           on_worker_failure="restart", mp_start_method=START)
    pids = c.worker_pids()
    try:
        next(c)
        os.kill(pids[1], signal.SIGKILL)
        next(c)
        assert c.stats()["restarts"] == 1
        pids = c.worker_pids()
        ran = pids_in(log)
        assert len(set(ran)) == len(ran) == 3 and set(pids) <= set(ran)  # once per process, the new one too
    finally:
        c.shutdown()


def failing_init():
    raise RuntimeError("init_fn failed on purpose")


def test_an_init_fn_error_is_the_workers_start_up_failure():
    before = descendant_pids()
    with pytest.raises(RuntimeError, match="init_fn failed on purpose") as info:
        MultiAsyncCollector("CartPole-v1", num_workers=2, frames_per_batch=10, init_fn=failing_init,
                            mp_start_method=START)
    assert "failing_init" in str(info.value) and "start-up" in str(info.value)  # the worker's traceback
    assert not wait_gone(descendant_pids() - before, 3.0)


def test_init_fn_must_be_a_callable_that_pickles():
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match="init_fn must be a callable taking no argument, or None, got str"):
        MultiSyncCollector("CartPole-v1", num_workers=1, frames_per_batch=10, init_fn="setup")
    with pytest.raises(TypeError, match="init_fn cannot be pickled for the worker processes"):
        MultiSyncCollector("CartPole-v1", num_workers=1, frames_per_batch=10, init_fn=lambda: lock.acquire())
