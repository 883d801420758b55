"""Issue 23, items 2 and 3: what a foreign process does on rank 0's port (a TCPStore once, only
the channel listener since issue 36) cannot end or desynchronise a run, and large payloads (node
configuration, ``state_dict``, ``load_state_dict``) travel on the per-node channels, whatever
their size.

The foreign process is another process without the secret; it runs as user ``nobody`` when this
test runs as root and ``nobody`` can execute this interpreter, else as this user (the channels
check no user id: only what reaches the port matters)."""

from __future__ import annotations

import functools
import os
import resource
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from procs import end_processes
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_helpers import NODE_ID, BigPolicy, counting5  # noqa: E402

from rlcollect import DistributedCollector  # noqa: E402

pytestmark = pytest.mark.timeout(240)
HELPERS = str(Path(__file__).resolve().parents[1] / "distributed")
NOBODY = 65534


@functools.cache
def _can_run_as_nobody() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        probe = subprocess.run([sys.executable, "-c", "import torch"], preexec_fn=_become_nobody, capture_output=True)
    except OSError:  # this interpreter is not executable by nobody (under a private home, say)
        return False
    return probe.returncode == 0


def _become_nobody() -> None:
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _rank0(tmp_path: Path, script: str) -> subprocess.Popen:
    """Run ``script`` (rank 0's code) as a file in ``tmp_path``, the tests' helpers on its path,
    with pipes to drive it and read what it prints."""
    path = tmp_path / "rank0.py"
    path.write_text(script)
    return subprocess.Popen([sys.executable, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [HELPERS, os.environ.get("PYTHONPATH")]))})


def _kill_and_await_relaunch(rank0: subprocess.Popen, node: int) -> str:
    """SIGKILL ``node``, tell rank 0 to go on, and return its ``RESTARTS`` line (the test's
    timeout bounds the wait)."""
    os.kill(node, signal.SIGKILL)
    rank0.stdin.write(b"go\n")
    rank0.stdin.flush()
    line = ""
    while not line.startswith("RESTARTS"):  # whole lines
        line = rank0.stdout.readline().decode()
        assert line, rank0.stderr.read().decode()[-3000:]
    return line


def _foreign(code: str, stdin: int | None = None) -> subprocess.Popen:
    """Run ``code`` in a foreign process (no secret; user ``nobody`` where possible), with room
    for thousands of descriptors; ``stdin``: as ``subprocess.Popen``'s (a pipe to tell it to stop)."""

    as_nobody = _can_run_as_nobody()

    def setup() -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        if as_nobody:
            _become_nobody()

    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], preexec_fn=setup, stdin=stdin,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={k: v for k, v in os.environ.items()
                                                                    if k != "RLCOLLECT_SECRET"})


_POP_AND_PUSH = """
import datetime, sys, time
from torch.distributed import TCPStore
popped, refused, end = 0, 0, time.monotonic() + 3
while time.monotonic() < end:  # 3 s of non-blocking pops, each popped message pushed back (out of order)
    try:  # rank 0's port is no store (issue 36): the client is closed before it can pop
        store = TCPStore("127.0.0.1", {port}, None, False, datetime.timedelta(seconds=1))
    except Exception:
        refused += 1
        continue
    for key in ("rlc/inbox", "rlc/cmd/1", "rlc/cmd/2"):
        try:
            data = store.queue_pop(key, False)
        except Exception:
            continue
        popped += 1
        store.queue_push(key, data)
print("DONE", popped, refused, flush=True)
"""


def test_a_foreign_queue_pop_and_push_on_the_store_neither_ends_nor_desynchronises_the_run():
    with DistributedCollector([counting5] * 2, frames_per_batch=10, total_frames=-1, sync=False,
                              launcher="mp", timeout=60.0) as c:
        it = iter(c)
        for _ in range(4):
            next(it)
        attacker = _foreign(_POP_AND_PUSH.format(port=c.master_port))
        out, err = attacker.communicate(timeout=60)
        assert out.startswith("DONE 0 "), err  # nothing popped, ever
        print(out)
        batches = [next(it) for _ in range(40)]
        stats = c.stats()
    assert [b.shape for b in batches] == [torch.Size([10])] * 40
    nodes = [int(b[NODE_ID][0]) for b in batches]
    assert set(nodes[-20:]) == {0, 1}  # both nodes still deliver: neither is stuck
    assert stats["frames"] == 44 * 10 and stats["lost_batches"] == 0


_RANK0 = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
sys.path[:0] = [{helpers!r}]
from dist_helpers import counting5
from rlcollect import DistributedCollector
c = DistributedCollector([counting5] * 2, frames_per_batch=10, total_frames=-1, sync=False, timeout=60.0,
                         launcher="mp", on_node_failure="restart", start_timeout=90.0)
it = iter(c)
next(it)
channel = getattr(c._pool.channel, "port", 0)  # 0: none (before issue 23); master_port itself since issue 36
print("PORTS", c.master_port, channel, *[w["pid"] for w in c.stats()["workers"]], flush=True)
sys.stdin.readline()  # the test killed node 1 while 3,000 foreign connections are open
deadline = time.monotonic() + 150
while c.stats()["restarts"] < 1:
    next(it)
    assert time.monotonic() < deadline, "no relaunch"
while int(next(it)["collector", "node_id"][0]) != 1:  # a batch of the relaunched node
    assert time.monotonic() < deadline, "the relaunched node delivered nothing"
print("RESTARTS", c.stats()["restarts"], c.stats()["workers"][1]["state"], flush=True)
c.shutdown()
"""

_HOLD = """
import socket, sys, time
held = []
for port, n in (({store}, 3000), ({channel}, 1000)):
    for _ in range(n if port else 0):
        s = socket.socket()
        s.connect(("127.0.0.1", port))
        held.append(s)
print("HELD", len(held), flush=True)
sys.stdin.readline()
"""


def test_thousands_of_idle_foreign_connections_do_not_starve_a_relaunch(tmp_path):
    rank0 = _rank0(tmp_path, textwrap.dedent(_RANK0.format(helpers=HELPERS)))
    holder = None
    try:
        line = rank0.stdout.readline().decode()  # (the test's timeout bounds it)
        assert line.startswith("PORTS"), rank0.stderr.read().decode()[-3000:]
        store_port, channel_port, _, node1 = map(int, line.split()[1:])
        holder = _foreign(_HOLD.format(store=store_port, channel=channel_port))
        line = holder.stdout.readline()
        assert line.startswith(f"HELD {3000 + (1000 if channel_port else 0)}"), holder.stderr.read()
        line = _kill_and_await_relaunch(rank0, node1)
        assert line.split()[1:] == ["1", "collecting"]
        assert rank0.wait(timeout=60) == 0, rank0.stderr.read().decode()[-3000:]
    finally:
        end_processes(holder, rank0)


def test_a_100_mb_policy_state_dict_and_load_state_dict_travel_on_the_channel():
    policy = BigPolicy()
    with DistributedCollector([counting5], policy, frames_per_batch=10, total_frames=-1, sync=True,
                              launcher="mp", timeout=120.0) as c:
        it = iter(c)
        next(it)
        state = c.state_dict()  # the node's state holds its 100 MiB policy: a 100 MiB reply
        assert state["node0"]["policy"]["w"].numel() == 25 * 1024 * 1024
        state["node0"]["policy"]["w"].fill_(1.0)  # then a 100 MiB command: the node acts 1
        c.load_state_dict(state)
        batch = next(iter(c))
    assert batch.shape == (1, 10) and batch["action"].unique().tolist() == [1]
