"""No distributed process outlives its run (issue 13, items 3, 4, 8, 9): nodes end within 5 s of
rank 0's death in any phase, a frozen rank 0 is given up on after ``rank0_timeout`` (and the
node says why), a node that does not start within ``start_timeout`` fails the construction with
a ``WorkerError`` naming it (and is killed), and a Ctrl-C ends everything within 2 s with one
traceback, rank 0's."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dist_helpers import counting5, free_port, pid_alive, read_line, rlcollect_command, wait_gone  # noqa: E402
from dist_liveness_helpers import gil_hogging_env, hanging_env  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from loadscale import scaled  # noqa: E402

from rlcollect import DistributedCollector, WorkerError  # noqa: E402
from rlcollect.distributed.control.auth import new_secret, write_secret_file  # noqa: E402

pytestmark = pytest.mark.timeout(180)
HELPERS = os.pathsep.join(str(Path(__file__).resolve().parents[1] / d) for d in ("distributed", "security"))
#: The nodes import the helpers, and rlcollect from where this test runs (a worktree's PYTHONPATH).
NODE_PATH = os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")]))

_RANK0 = """
import sys, time
sys.path[:0] = {helpers!r}.split(":")
from dist_helpers import counting5
from dist_liveness_helpers import hanging_env
from rlcollect import DistributedCollector
env = {env}
c = DistributedCollector([env] * 2, frames_per_batch=20, total_frames=-1, sync=True, timeout=60.0, {kwargs})
print("COLLECTING", flush=True)
for batch in c:
    time.sleep(0.01)
"""


def _rank0(tmp_path, env: str = "counting5", **kwargs) -> subprocess.Popen:
    script = tmp_path / "rank0.py"
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    script.write_text(textwrap.dedent(_RANK0.format(helpers=HELPERS, env=env, kwargs=args)))
    # Its own process group: a Ctrl-C test signals that group, as a terminal would.
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": NODE_PATH})


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        children = _children(todo.pop())
        out += children
        todo += children
    return out


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} within {timeout} s")


def _reap(process: subprocess.Popen, pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if process.poll() is None:
        process.kill()
    process.wait()
    for stream in (process.stdout, process.stderr):
        if stream:
            stream.close()


@pytest.mark.parametrize("launcher, phase", [("mp", "importing"), ("mp", "building"), ("mp", "collecting"),
                                             ("submitit", "importing"), ("submitit", "collecting")])
def test_nodes_end_within_5_s_of_rank_0_killed(tmp_path, launcher, phase):
    marker = tmp_path / "building"
    env = f"__import__('functools').partial(hanging_env, {str(marker)!r})" if phase == "building" else "counting5"
    kwargs = {"launcher": launcher}
    if launcher == "submitit":  # local jobs: a controller process per job, the node its child
        kwargs["slurm_kwargs"] = {"executor": "local", "folder": str(tmp_path / "jobs"), "timeout_min": 10}
    rank0 = _rank0(tmp_path, env=env, **kwargs)
    per_node = 1 if launcher == "mp" else 2
    nodes: list[int] = []
    try:
        nodes = _wait_for(lambda: len(_descendants(rank0.pid)) >= 2 * per_node and _descendants(rank0.pid), 90,
                          "the node processes")
        if phase == "building":
            _wait_for(marker.exists, 90, "a node building its env")
        elif phase == "collecting":
            read_line(rank0, "COLLECTING", 150)
        nodes = _descendants(rank0.pid)
        rank0.kill()
        rank0.wait()
        killed = time.monotonic()
        alive = wait_gone(nodes, 5.0)
        assert not alive, f"{alive} of {nodes} alive 5 s after rank 0 ({launcher}) was killed while {phase}"
        assert time.monotonic() - killed <= 5.0
    finally:
        _reap(rank0, nodes)


@pytest.mark.parametrize("launcher", ["external", "mp"])
def test_nodes_of_a_frozen_rank_0_exit_after_rank0_timeout_and_say_why(tmp_path, launcher):
    rank0_timeout = 3.0
    nodes: list = []
    if launcher == "external":
        secret_file = str(write_secret_file(new_secret(), tmp_path / "secret"))
        port = free_port()
        rank0 = _rank0(tmp_path, launcher="external", master_addr="127.0.0.1", tcp_port=port,
                       secret_file=secret_file)
        nodes = [subprocess.Popen([rlcollect_command(), "node", "--master-addr", "127.0.0.1", "--master-port",
                                   str(port), "--rank", str(r), "--world-size", "3", "--timeout", "60",
                                   "--secret-file", secret_file, "--rank0-timeout", f"{rank0_timeout:g}"],
                                  env={**os.environ, "PYTHONPATH": NODE_PATH}, stderr=subprocess.PIPE)
                 for r in (1, 2)]
        pids = [p.pid for p in nodes]
    else:
        rank0 = _rank0(tmp_path, launcher="mp", rank0_timeout=rank0_timeout)
    try:
        read_line(rank0, "COLLECTING", 120)
        if launcher == "mp":
            pids = _children(rank0.pid)
            assert len(pids) == 2
        os.kill(rank0.pid, signal.SIGSTOP)
        frozen = time.monotonic()
        time.sleep(rank0_timeout - 1.0)
        assert all(pid_alive(p) for p in pids)  # not before rank0_timeout
        assert not wait_gone(pids, 6.0), "nodes of a frozen rank 0 still alive rank0_timeout + 5 s later"
        assert time.monotonic() - frozen <= rank0_timeout + 6.0
        if launcher == "external":
            for p in nodes:
                assert p.wait(timeout=5) == 3
                err = p.stderr.read().decode()
                assert "rank 0 has not beaten for" in err and f"rank0_timeout={rank0_timeout:g}" in err
                assert "Traceback" not in err
        else:  # the nodes' stderr is rank 0's
            os.kill(rank0.pid, signal.SIGKILL)
            rank0.wait()
            err = rank0.stderr.read().decode()
            assert err.count(f"rank0_timeout={rank0_timeout:g}") == 2 and "Traceback" not in err
    finally:
        os.kill(rank0.pid, signal.SIGKILL) if rank0.poll() is None else None
        for p in nodes:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stderr.close()
        _reap(rank0, pids if launcher == "mp" else [])


def test_a_node_that_does_not_start_in_start_timeout_fails_the_construction_and_is_killed(tmp_path):
    marker = tmp_path / "building"
    before = set(_children(os.getpid()))
    # ample to import torch and reach rank 0, then hang: 12 s on a quiet machine (a node starts in
    # 3-6 s), stretched by the load (at most 40 s); the test waits the whole bound
    timeout = float(round(scaled(12.0, cap=40.0)))
    started = time.monotonic()
    with pytest.raises(WorkerError, match=rf"nodes \[0\] did not start within start_timeout={timeout:g} s, during "
                                          r"start-up \(node 0 \(rank 1\): configured, building its collector") as info:
        DistributedCollector([functools.partial(hanging_env, str(marker))], frames_per_batch=10,
                             launcher="mp", start_timeout=timeout)
    assert info.value.worker_index == 0 and marker.exists()
    assert timeout <= time.monotonic() - started < timeout + 15.0  # the bound, plus the shutdown's
    assert set(_children(os.getpid())) <= before  # the hanging node was killed and reaped


@pytest.mark.parametrize("value", [0, -1.0, "120", None, True])
def test_start_timeout_is_validated(value):
    with pytest.raises(ValueError, match="start_timeout"):
        DistributedCollector([counting5], frames_per_batch=10, start_timeout=value)


def test_ctrl_c_gives_one_traceback_and_ends_every_process_within_2_s(tmp_path):
    rank0 = _rank0(tmp_path, launcher="mp")
    pids: list[int] = []
    try:
        read_line(rank0, "COLLECTING", 120)
        pids = _children(rank0.pid)
        assert len(pids) == 2
        time.sleep(0.5)
        # The nodes rank 0 started: gone within 2 s on a quiet machine (rank 0 closes them, waits
        # 1 s, then kills). On a loaded one rank 0 gets a share of a core, so the bound is
        # stretched by the load, capped at 8 s: under the 10 s of an ordinary shutdown. Rank 0
        # itself is the user's own interpreter, whose exit (unloading torch) took 3.7-7 s at load
        # 5-8: it is waited for, not timed.
        bound = scaled(2.0, cap=8.0)
        os.killpg(rank0.pid, signal.SIGINT)  # what Ctrl-C in its terminal does
        interrupted = time.monotonic()
        alive = wait_gone(pids, bound)
        assert not alive, f"processes alive {bound:.1f} s after Ctrl-C: {alive}"
        assert time.monotonic() - interrupted <= bound
        rank0.wait(timeout=60)
        err = rank0.stderr.read().decode()
        assert err.count("Traceback (most recent call last)") == 1, err
        assert err.rstrip().splitlines()[-1] == "KeyboardInterrupt", err
        assert "rlcollect node" not in err, err
    finally:
        _reap(rank0, pids)


def test_a_step_holding_the_gil_past_heartbeat_timeout_is_a_busy_node_not_a_frozen_one(tmp_path):
    """Issue 23, item 4: a node whose env step holds the GIL for 8 s (its heartbeat thread cannot
    run) is reported busy by its watcher and not failed; a stopped node still is (the frozen-node
    tests in tests/distributed)."""
    marker = tmp_path / "held"
    env = functools.partial(gil_hogging_env, 12, 8.0, str(marker), max_steps=5)
    started = time.monotonic()
    with DistributedCollector([env, counting5], frames_per_batch=10, total_frames=100, sync=True,
                              heartbeat_timeout=3.0, timeout=60.0) as c:
        frames = sum(batch.numel() for batch in c)
        stats = c.stats()
    assert marker.exists() and time.monotonic() - started > 8.0
    assert frames == 100 and stats["restarts"] == 0


_SHUTDOWN_CTRL_C = """
import os, signal, sys, threading, time
sys.path[:0] = {helpers!r}.split(":")
from dist_helpers import counting5
from rlcollect import DistributedCollector
c = DistributedCollector([counting5] * 2, frames_per_batch=20, total_frames=-1, sync=True, timeout=60.0)
it = iter(c)
next(it)
print("PIDS", *[w["pid"] for w in c.stats()["workers"]], flush=True)

def ctrl_c_twice():  # the second one while the shutdown the first one started runs
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep({delay})
    os.kill(os.getpid(), signal.SIGINT)

timer = threading.Timer(0.3, ctrl_c_twice)
timer.daemon = True
timer.start()
with c:
    for batch in it:
        time.sleep(0.01)
"""


@pytest.mark.parametrize("delay", [0.01, 0.05, 0.1])
def test_ctrl_c_during_shutdown_does_not_abort_the_interpreter(tmp_path, delay):
    """Issue 23, item 5: a second Ctrl-C while the shutdown the first one started runs raises
    ``KeyboardInterrupt`` and the interpreter exits as after any Ctrl-C (it aborted: "terminate
    called without an active exception", exit 134); no process is left."""
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(_SHUTDOWN_CTRL_C.format(helpers=HELPERS, delay=delay)))
    path = os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")]))
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, env={**os.environ, "PYTHONPATH": path})
    try:
        out, err = rank0.communicate(timeout=120)
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()
    text = err.decode()
    assert rank0.returncode in (1, 130, -signal.SIGINT), (rank0.returncode, text[-3000:])
    assert "terminate called" not in text and "Aborted" not in text
    assert text.rstrip().splitlines()[-1].startswith("KeyboardInterrupt"), text[-3000:]
    pids = [int(p) for p in out.decode().split("PIDS", 1)[1].split("\n", 1)[0].split()]
    assert len(pids) == 2 and not wait_gone(pids, 5.0)


_INTERRUPTED_RECEIVE = """
import sys
sys.path[:0] = {helpers!r}.split(":")
from dist_helpers import counting5
import rlcollect.distributed.control.transport as transport
from rlcollect import DistributedCollector
c = DistributedCollector([counting5] * 2, frames_per_batch=20, total_frames=-1, sync=True, timeout=60.0)
it = iter(c)
next(it)
real_wait = transport.wait

def interrupted(work, timeout):  # a Ctrl-C right after a batch's receive was posted, before its bytes came
    transport.wait = real_wait
    del work  # as when it lands between the post and the wait: this frame keeps nothing alive
    raise KeyboardInterrupt

transport.wait = interrupted
with c:
    for batch in it:
        pass
"""


def test_ctrl_c_between_a_receive_and_its_bytes_does_not_hang_the_shutdown(tmp_path):
    """The rare hang behind the Ctrl-C test above, made certain: a ``KeyboardInterrupt`` after
    rank 0 posted a batch's receive and before the node's bytes arrived freed that receive; the
    bytes then stayed unread in the socket and gloo, freeing the pair group at shutdown, ran its
    event loop until nothing was left to read: forever (rank 0 hung after the Ctrl-C, no
    traceback).  The receive is kept until it ends, and the shutdown is bounded."""
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(_INTERRUPTED_RECEIVE.format(helpers=HELPERS)))
    path = os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")]))
    rank0 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True, env={**os.environ, "PYTHONPATH": path})
    try:
        out, err = rank0.communicate(timeout=scaled(60))
    finally:
        if rank0.poll() is None:
            os.killpg(rank0.pid, signal.SIGKILL)
            rank0.wait()
    text = err.decode()
    assert rank0.returncode in (1, 130, -signal.SIGINT), (rank0.returncode, text[-3000:])
    assert text.rstrip().splitlines()[-1].startswith("KeyboardInterrupt"), text[-3000:]
    assert "unread bytes" not in text, text[-3000:]  # freed in time, not left to a thread
