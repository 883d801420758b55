"""Issue 36, item 1: junk first messages to the channel listener.  A foreign process (no secret;
user ``nobody`` where possible) opens thousands of connections to rank 0's channel listener and
sends each a complete but unauthentic first message (12 bytes, or 64 KiB) while the trainer is
between batches.  The attach is verified in the listener's thread and a failure closed there, so
rank 0 holds at most ``MAX_PENDING`` strangers' connections whatever they send: its descriptors
and memory stay bounded, its own ``open()`` works and the run goes on, under a hard limit of
1,024 and of 4,096 open files (set in the rank-0 subprocess, which cannot raise it).
Loopback only; the attacker's loop is bounded in count and in time."""

from __future__ import annotations

import textwrap

import pytest
from procs import end_processes

from test_dist_control_plane import HELPERS, _foreign, _rank0

pytestmark = pytest.mark.timeout(240)

_RANK0 = """
import os, resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, ({limit}, {limit}))
sys.path[:0] = [{helpers!r}]
from dist_helpers import counting5
from rlcollect import DistributedCollector

def fds():
    return len(os.listdir("/proc/self/fd"))

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

c = DistributedCollector([counting5] * 2, frames_per_batch=10, total_frames=-1, sync=True, timeout=60.0,
                         launcher="mp")
it = iter(c)
next(it)
base_fds, base_rss = fds(), rss()
print("PORT", c._pool.channel.port, base_fds, flush=True)
sys.stdin.readline()  # the attacker is flooding; the trainer is between batches
peak_fds, peak_rss, end = base_fds, base_rss, time.monotonic() + 8
while time.monotonic() < end:
    peak_fds, peak_rss = max(peak_fds, fds()), max(peak_rss, rss())
    time.sleep(0.05)
with open(os.devnull) as f:  # the trainer's own open()
    pass
batches = [next(it) for _ in range(5)]
print("RESULT", base_fds, peak_fds, (peak_rss - base_rss) >> 20, len(batches), c.stats()["restarts"], flush=True)
c.shutdown()
"""

_FLOOD = """
import socket, struct, sys, time
size, count = {size}, {count}
message = struct.pack("!Q", size) + b"\\x01" * size
held, sent, end = [], 0, time.monotonic() + 20
while sent < count and time.monotonic() < end:
    try:
        s = socket.create_connection(("127.0.0.1", {port}), timeout=2)
        s.sendall(message)
    except OSError:
        continue
    held.append(s)
    sent += 1
print("SENT", sent, flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("limit", [1024, 4096])
@pytest.mark.parametrize("size,count", [(4, 6000), (64 * 1024 - 8, 3000)], ids=["12B", "64KiB"])
def test_junk_first_messages_from_a_stranger_leave_rank_0_bounded(tmp_path, limit, size, count):
    rank0 = _rank0(tmp_path, textwrap.dedent(_RANK0.format(limit=limit, helpers=HELPERS)))
    flood = None
    try:
        line = rank0.stdout.readline().decode()
        assert line.startswith("PORT"), rank0.stderr.read().decode()[-3000:]
        port = int(line.split()[1])
        flood = _foreign(_FLOOD.format(size=size, count=count, port=port))
        line = flood.stdout.readline()
        assert line.startswith("SENT"), flood.stderr.read()
        rank0.stdin.write(b"go\n")
        rank0.stdin.flush()
        line = rank0.stdout.readline().decode()
        assert line.startswith("RESULT"), rank0.stderr.read().decode()[-3000:]
        base_fds, peak_fds, rss_mib, batches, restarts = map(int, line.split()[1:])
        print(line)
        assert batches == 5 and restarts == 0
        assert peak_fds <= base_fds + 256 + 16  # MAX_PENDING strangers at most (plus a few of its own)
        assert rss_mib < 64  # at most MAX_PENDING first messages of 64 KiB are held
        assert rank0.wait(timeout=60) == 0, rank0.stderr.read().decode()[-3000:]
    finally:
        end_processes(flood, rank0)
