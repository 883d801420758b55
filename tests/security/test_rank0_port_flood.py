"""Issue 36, item 1's last sentence (round 3's F6): a stranger who reaches rank 0's port holds
thousands of idle connections, then a node dies; under a hard limit of 1,024 (or 4,096) open
files, which rank 0 cannot raise, the relaunch must still work.

Rank 0 runs in a subprocess with ``RLIMIT_NOFILE`` set to (limit, limit).  A foreign process
(no secret; user ``nobody`` where possible) opens more idle connections to every port rank 0
listens on (``master_port``, the one port a node is told, and any other a scan of the host
would find) than rank 0 has descriptors, keeps them and goes on connecting; then the test
SIGKILLs node 1, and rank 0 must relaunch it and take a batch of the relaunched node.  Before
the fix, ``master_port`` was torch's TCPStore, which kept every connection (one descriptor each,
without bound): the relaunch failed with EMFILE; and each pair group's gloo listener did the
same, aborting rank 0 at the limit.  Loopback only; the flood is bounded in count and time.
"""

from __future__ import annotations

import subprocess
import textwrap

import pytest
from procs import end_processes

from test_dist_control_plane import HELPERS, _foreign, _kill_and_await_relaunch, _rank0

pytestmark = pytest.mark.timeout(300)

_RANK0 = """
import os, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
sys.path[:0] = [{helpers!r}]
from dist_helpers import counting5
from rlcollect import DistributedCollector

def listening_ports():
    # the TCP ports this process listens on (what a stranger could find by scanning the host)
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{{fd}}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.add(int(fields[1].split(":")[1], 16))
    return sorted(ports)

def fds():
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # EMFILE: every descriptor is taken
        return {limit}

c = DistributedCollector([counting5] * 2, frames_per_batch=10, total_frames=-1, sync=False, timeout=60.0,
                         launcher="mp", on_node_failure="restart", start_timeout=90.0)
it = iter(c)
next(it)
ports = listening_ports()
assert c.master_port in ports
print("PORTS", ",".join(map(str, ports)), fds(), *[w["pid"] for w in c.stats()["workers"]], flush=True)
sys.stdin.readline()  # the stranger holds its connections; the test killed node 1
peak, deadline = fds(), time.monotonic() + 150
while c.stats()["restarts"] < 1:
    next(it)
    peak = max(peak, fds())
    assert time.monotonic() < deadline, "no relaunch"
while int(next(it)["collector", "node_id"][0]) != 1:  # a batch of the relaunched node
    peak = max(peak, fds())
    assert time.monotonic() < deadline, "the relaunched node delivered nothing"
with open(os.devnull) as f:  # the trainer's own open() works
    pass
print("RESTARTS", c.stats()["restarts"], c.stats()["workers"][1]["state"], peak, flush=True)
c.shutdown()
"""

_HOLD = """
import collections, socket, sys, threading, time
held, told, ports = collections.deque(), threading.Event(), [{ports}]
threading.Thread(target=lambda: (sys.stdin.readline(), told.set()), daemon=True).start()
opened, end, last = 0, time.monotonic() + 150, time.monotonic()
while not told.is_set() and time.monotonic() < end and time.monotonic() - last < 10:  # (10 s refused: rank 0 died)
    try:
        held.append(socket.create_connection(("127.0.0.1", ports[opened % len(ports)]), timeout=1))
    except OSError:
        continue
    opened, last = opened + 1, time.monotonic()
    if len(held) > {count}:  # the oldest go: whatever rank 0 frees, the next connection takes again
        held.popleft().close()
    if opened == {count}:
        print("HELD", opened, flush=True)
print("OPENED", opened, flush=True)
"""


@pytest.mark.parametrize("limit", [1024, 4096])
def test_idle_connections_to_rank_0s_port_under_a_hard_fd_limit_do_not_stop_a_relaunch(tmp_path, limit):
    rank0 = _rank0(tmp_path, textwrap.dedent(_RANK0.format(limit=limit, helpers=HELPERS)))
    holder = None
    count = limit + 2000  # more than rank 0 has descriptors
    try:
        line = rank0.stdout.readline().decode()  # (the test's timeout bounds it)
        assert line.startswith("PORTS"), rank0.stderr.read().decode()[-3000:]
        ports, base_fds, _, node1 = line.split()[1:]
        base_fds, node1 = int(base_fds), int(node1)
        holder = _foreign(_HOLD.format(ports=ports, count=count), stdin=subprocess.PIPE)
        line = holder.stdout.readline()
        if not line.startswith("HELD"):  # (before issue 36: gloo's listener aborted rank 0 at its limit)
            dead = rank0.poll() is not None
            raise AssertionError(f"the stranger: {line!r} {holder.stderr.read()[-2000:]}; rank 0 "
                                 + (f"exited ({rank0.returncode}): {rank0.stderr.read().decode()[-3000:]}" if dead
                                    else "still runs"))
        print(line.strip(), "of", count, "to rank 0's listening ports", ports, "and it goes on connecting")
        line = _kill_and_await_relaunch(rank0, node1)
        print(line.strip(), "base fds", base_fds)
        assert line.split()[1:3] == ["1", "collecting"]
        holder.stdin.write("stop\n")
        holder.stdin.flush()
        print(holder.stdout.readline().strip())
        assert rank0.wait(timeout=60) == 0, rank0.stderr.read().decode()[-3000:]
    finally:
        end_processes(holder, rank0)
