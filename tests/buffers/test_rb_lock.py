"""The replay buffer's cross-process lock: a bounded wait naming the holder, and recovery when
the holder dies (issue 13, item 7).

A holder process maps a handle on the buffer and sits inside ``region.lock()`` (the lock that
extend, state_dict, load_state_dict and empty take); the test stops it (SIGSTOP) or kills it.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from loadscale import scaled
from tensordict import TensorDict

from rlcollect.buffers import LockTimeout, ReplayBuffer
from rlcollect.buffers.storage import DEFAULT_LOCK_TIMEOUT_S

TIMEOUT_S = 0.5
SLACK_S = 2.0  # how late a LockTimeout may come on a loaded machine

# argv: the pickled handle (hex), "plain" or "fork".  "fork": while holding the lock, fork a
# child that outlives the holder (it inherits the lock's fd unless rlcollect closes it).
HOLDER = """
import os, pickle, sys, time
rb = pickle.loads(bytes.fromhex(sys.argv[1]))
region = rb._data_region()
with region.lock():
    child = os.fork() if sys.argv[2] == "fork" else -1
    if child == 0:
        time.sleep(600)
        os._exit(0)
    print(child, flush=True)
    time.sleep(600)
"""


def frames(n: int = 4) -> TensorDict:
    return TensorDict({"x": torch.arange(n)}, [n])


class Holder:
    """A process inside the buffer's lock (and, with ``fork``, the child it forked there)."""

    def __init__(self, rb: ReplayBuffer, mode: str = "plain"):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, pickle.dumps(rb).hex(), mode], stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline()
        assert line, "the holder died before taking the lock"
        self.child = int(line)

    def close(self) -> None:
        for pid in (self.proc.pid, self.child):
            if pid > 0:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
        self.proc.wait()
        self.proc.stdout.close()
        if self.child > 0:
            deadline = time.monotonic() + scaled(10, cap=60)  # the reparented child's exit, on a loaded machine
            while os.path.exists(f"/proc/{self.child}") and time.monotonic() < deadline:
                try:  # not ours to reap once reparented; when still ours, reap it
                    os.waitpid(self.child, os.WNOHANG)
                except ChildProcessError:
                    pass
                time.sleep(0.01)


@pytest.fixture
def rb():
    buffer = ReplayBuffer(64, lock_timeout=TIMEOUT_S)
    buffer.extend(frames())  # allocated: every call below goes straight to the lock
    yield buffer
    buffer.close()


CALLS = {
    "extend": lambda rb: rb.extend(frames()),
    "state_dict": lambda rb: rb.state_dict(),
    "empty": lambda rb: rb.empty(),
    "load_state_dict": lambda rb: rb.load_state_dict(STATE),
}
STATE: dict = {}


@pytest.mark.timeout(60)
def test_a_stopped_holder_bounds_every_call_with_an_error_naming_it(rb):
    STATE.update(rb.state_dict())
    holder = Holder(rb)
    try:
        os.kill(holder.proc.pid, signal.SIGSTOP)
        for name, call in CALLS.items():
            start = time.monotonic()
            with pytest.raises(LockTimeout) as info:
                call(rb)
            waited = time.monotonic() - start
            assert TIMEOUT_S <= waited <= TIMEOUT_S + SLACK_S, (name, waited)
            err = info.value
            assert isinstance(err, TimeoutError)
            assert err.pid == holder.proc.pid and err.timeout == TIMEOUT_S
            assert err.path == os.path.join(rb.path, "control")
            message = str(err)
            assert f"held by pid {holder.proc.pid} (stopped)" in message, (name, message)
            assert "lock_timeout=0.5 s" in message
        assert rb.write_count == 4  # nothing half-done: the failed extend reserved nothing
    finally:
        holder.close()
    # The holder is gone: the lock is free again at once.
    rb.extend(frames())
    rb.empty()
    assert rb.write_count == 8 and len(rb) == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["plain", "fork"])
def test_a_killed_holder_releases_the_lock(rb, mode):
    """Also when the holder had forked a child that lives on: the child must not keep the lock
    (flock locks belong to the file description, which a fork shares)."""
    STATE.update(rb.state_dict())
    holder = Holder(rb, mode)
    try:
        if mode == "fork":
            assert holder.child > 0 and os.path.exists(f"/proc/{holder.child}")
        os.kill(holder.proc.pid, signal.SIGKILL)
        holder.proc.wait()
        if mode == "fork":
            assert os.path.exists(f"/proc/{holder.child}")  # alive, holding its copy of everything
        # Each call must get the lock within TIMEOUT_S, or it raises LockTimeout.
        for call in CALLS.values():
            call(rb)
        rb.extend(frames())
        assert rb.write_count == 8 and len(rb) == 8  # the state loaded had 4 frames; 4 more
    finally:
        holder.close()


@pytest.mark.timeout(60)
def test_another_thread_inside_the_lock_is_bounded_too(rb):
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with rb._open_region().lock():
            inside.set()
            leave.wait(30)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert inside.wait(30)
        with pytest.raises(LockTimeout, match="another thread of this process") as info:
            rb.empty()
        assert info.value.pid == os.getpid()
    finally:
        leave.set()
        thread.join()
    rb.empty()


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "1", True, None])
def test_lock_timeout_is_validated(bad):
    with pytest.raises(ValueError, match=r"lock_timeout must be a positive, finite number of seconds, got"):
        ReplayBuffer(4, lock_timeout=bad)


def test_lock_timeout_has_a_default_and_travels_with_handles():
    with ReplayBuffer(4) as rb:
        assert rb._lock_timeout == DEFAULT_LOCK_TIMEOUT_S == 30.0
    with ReplayBuffer(4, lock_timeout=2) as rb:
        handle = pickle.loads(pickle.dumps(rb))
        assert handle._open_region().lock_timeout == 2.0
        handle.close()
