"""Nothing of a replay buffer stays behind when any of its processes dies (issue 13, item 6).

The owner (tests/buffers/rb_owner.py, a subprocess) is SIGKILLed at several phases: just
constructed, while two writer processes extend the buffer, while it takes ``state_dict()``.
Within ``REMOVAL_BOUND_S`` its storage directory must be gone and its reaper too.  A writer
SIGKILLed while writing leaves the buffer whole and usable, and nothing once the owner closes.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from loadscale import scaled
from tensordict import TensorDict

from rlcollect._pids import pid_alive
from rlcollect.buffers import ReplayBuffer

OWNER = Path(__file__).resolve().parents[1] / "buffers" / "rb_owner.py"
#: The documented bound (docs/replay-buffer.md): storage and reaper gone this soon after the
#: owner's death.  The mechanism is EOF on a pipe, then one rm: 0.05-0.7 s after the SIGKILL,
#: measured on a loaded 2-core machine.
REMOVAL_BOUND_S = 2.0


def wait_until(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "phase, storage",
    [("constructed", "memory"), ("constructed", "memmap"), ("writing", "memory"), ("state_dict", "memory")],
)
def test_a_killed_owner_leaves_nothing(phase, storage):
    owner = subprocess.Popen([sys.executable, str(OWNER), phase, storage], stdout=subprocess.PIPE, text=True)
    info = None
    try:
        line = owner.stdout.readline()
        assert line, f"the owner exited with {owner.wait()} before reaching {phase!r}"
        info = json.loads(line)
        path = info["path"]
        reaper = info["reaper"]
        assert os.path.isdir(path)
        if storage == "memory":
            assert path.startswith("/dev/shm/rlcollect-rb-")
        time.sleep(0.3)  # well inside the phase (writing, or taking state_dict() in a loop)
        owner.kill()
        owner.wait()
        assert wait_until(lambda: not os.path.exists(path), REMOVAL_BOUND_S), f"{path} left behind"
        assert reaper is not None
        assert wait_until(lambda: not pid_alive(reaper), REMOVAL_BOUND_S), "the reaper outlived its work"
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"rlcollect-rb-{owner.pid}-")]  # none else
        # The test's writers end when their parent does (so that no process is left either).
        assert wait_until(lambda: not any(pid_alive(w) for w in info["writers"]), 30.0)
    finally:
        owner.kill()
        owner.wait()
        owner.stdout.close()
        if info is not None:
            for pid in [info["reaper"] or 0, *info["writers"]]:
                if pid > 0:
                    kill(pid)
            shutil.rmtree(info["path"], ignore_errors=True)


# argv: the pickled handle (hex).  Extends without end, printing once it has written.
WRITER = """
import pickle, sys
import torch
from tensordict import TensorDict
rb = pickle.loads(bytes.fromhex(sys.argv[1]))
td = TensorDict({"x": torch.ones(500, 16)}, [500])
rb.extend(td)
print("writing", flush=True)
while True:
    rb.extend(td)
"""


@pytest.mark.timeout(120)
def test_a_killed_writer_leaves_the_buffer_usable_and_nothing_after_close():
    rb = ReplayBuffer(10_000, lock_timeout=2.0)  # a lock the writer died holding would raise
    rb.extend(TensorDict({"x": torch.zeros(500, 16)}, [500]))
    reaper = rb._reaper.process.pid
    path = rb.path
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, pickle.dumps(rb).hex()], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        for w in writers:
            assert w.stdout.readline() == "writing\n"
        for w in writers:
            w.kill()  # most likely inside a copy, maybe inside the lock
            w.wait()
        written = rb.write_count
        assert written >= 1500 and written % 500 == 0
        rb.extend(TensorDict({"x": torch.zeros(500, 16)}, [500]))
        state = rb.state_dict()
        sample = rb.sample(1000)["x"]  # abandoned slots are never sampled: only whole frames
        assert bool(((sample == 0) | (sample == 1)).all(-1).all())
        assert rb.write_count == written + 500 == state["write_count"]
        rb.empty()
    finally:
        for w in writers:
            w.kill()
            w.wait()
            w.stdout.close()
        rb.close()
    assert not os.path.exists(path)
    assert wait_until(lambda: not pid_alive(reaper), REMOVAL_BOUND_S)


@pytest.mark.timeout(60)
def test_close_and_garbage_collection_end_the_reaper():
    rb = ReplayBuffer(8)
    reaper, path = rb._reaper.process.pid, rb.path
    assert pid_alive(reaper)
    rb.close()
    assert not os.path.exists(path) and not pid_alive(reaper)  # close() waits for it
    rb = ReplayBuffer(8, storage="memmap")
    reaper, path = rb._reaper.process.pid, rb.path
    assert pid_alive(reaper) and not path.startswith("/dev/shm")
    del rb  # the finalizer
    assert not os.path.exists(path) and not pid_alive(reaper)
    rb = ReplayBuffer(8, shared=False)
    assert rb._reaper is None  # private memory: nothing to reap
    rb.share()
    reaper, path = rb._reaper.process.pid, rb.path
    rb.close()
    assert not os.path.exists(path) and not pid_alive(reaper)


@pytest.mark.timeout(60)
def test_without_a_shell_the_reaper_is_python(monkeypatch):
    from rlcollect.buffers import lifetime

    monkeypatch.setattr(lifetime, "SHELL", "/nonexistent/sh")
    rb = ReplayBuffer(8)
    reaper, path = rb._reaper.process, rb.path
    assert reaper.args[0] == sys.executable
    rb._reaper._write_end, write_end = -1, rb._reaper._write_end  # as if the owner had died:
    os.close(write_end)  # EOF for the reaper
    lifetime._WRITE_ENDS.discard(write_end)
    assert reaper.wait(timeout=scaled(30, cap=120)) == 0  # a fresh interpreter's start, on a loaded machine
    assert not os.path.exists(path)
    rb.close()
