"""A node's watcher: a tiny process beside each node process (``python -m
rlcollect.distributed.control.watcher``, started by the node once its channel is attached) that
reports the node process's state to rank 0 on a channel of its own (to rank 0's listener, like
its node: its first message, "attach", repeats the challenge of rank 0's welcome).

Why: a node's heartbeat thread needs the GIL, so an env step that holds it for seconds (a C
extension, a long reset) silences the beat of a node that is only busy.  The watcher reads the
node's state letter in ``/proc/<pid>/stat`` every ``PERIOD_S`` and sends it (``"state"``,
signed like every message): ``R``/``S``/``D`` (running, sleeping, in a disk wait) tell rank 0
the node is busy, not frozen; ``T`` (SIGSTOP, a debugger) that it is stopped; ``gone`` that it
ended.  Rank 0 then fails a silent node only when its watcher does not vouch for it (see
``heartbeat.Silence``).

It imports neither torch nor the node's code (start-up in tens of milliseconds, a few MB).  It
reads its orders (where rank 0 listens, the node's rank, pid and session, the key to sign with)
as one JSON line on its standard input, which the node keeps open: end of file means the node
process ended, however it ended (SIGKILL included), and the watcher says "gone" and exits.  It
ignores SIGINT (a Ctrl-C reaches the whole process group; it ends with its node).

It never outlives its node, whatever the launcher: it asks the kernel for a SIGKILL when the
node process ends (``PR_SET_PDEATHSIG``), which reaches it even stopped (SIGSTOP to a suspended
job's process group: end of file on a stopped process's input is never read, and a Ray actor
or a submitit job killed by its launcher leaves no process group for rank 0 to kill).  A node
that ends normally closes the watcher's input first, and the watcher says "gone" before it.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from typing import Any

#: Seconds between two reports (and checks of the node's state).
PERIOD_S = 0.5
#: How long a node waits for its watcher to attach before it goes on without its word.
READY_S = 10.0


def proc_state(pid: int) -> str:
    """The ``/proc`` state letter of process ``pid`` (``"gone"`` when there is none)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "gone"


def start(host: str, port: int, rank: int, token: str, key: bytes) -> subprocess.Popen | None:
    """Start the watcher of this process (the node); None (logged) when it cannot start: the
    node then runs without one (rank 0 takes its silence as before: a failure)."""
    import logging

    orders = json.dumps({"host": host, "port": port, "rank": rank, "token": token, "pid": os.getpid(),
                         "key": key.hex()})
    try:
        process = subprocess.Popen([sys.executable, "-m", "rlcollect.distributed.control.watcher"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        process.stdin.write(orders.encode() + b"\n")
        process.stdin.flush()
    except OSError as err:
        logging.getLogger("rlcollect").warning("rlcollect node %d: could not start its watcher: %s", rank, err)
        return None
    # Wait (a little) for it to attach, so that it vouches for the node from its first batch on.
    if not select.select([process.stdout], [], [], READY_S)[0] or not process.stdout.read(1):
        logging.getLogger("rlcollect").warning("rlcollect node %d: its watcher did not attach within %g s", rank,
                                               READY_S)
    return process


def stop(process: subprocess.Popen | None) -> None:
    """End the watcher (closing its standard input is its signal) and reap it."""
    if process is None:
        return
    try:
        process.stdin.close()
        process.wait(2.0)
    except (OSError, subprocess.TimeoutExpired):
        process.kill()
        process.wait()


#: ``prctl`` option: the signal this process gets when its parent ends (linux/prctl.h).
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> bool:
    """Have the kernel SIGKILL this process when ``parent`` (its parent) ends; False where it
    cannot (not Linux) or when ``parent`` has already ended."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return os.getppid() == parent  # it may have ended before the call: no signal would come


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    orders: dict[str, Any] = json.loads(sys.stdin.readline())
    if not die_with_parent(int(orders["pid"])) and os.getppid() != int(orders["pid"]):
        return 0  # the node is gone already
    from rlcollect.distributed.control.messages import MASTER_RANK, Endpoint, ProtocolError, unverified_challenge
    from rlcollect.distributed.control.wire import MAX_ATTACH_BYTES, Wire, WireClosed

    pid = int(orders["pid"])
    node_gone = threading.Event()

    def watch_stdin() -> None:
        while sys.stdin.buffer.read(4096):
            pass
        node_gone.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    try:
        wire = Wire.connect(orders["host"], int(orders["port"]), 30.0)
        wire.sock.settimeout(10.0)
        challenge = unverified_challenge(wire.recv(MAX_ATTACH_BYTES))  # rank 0's welcome
        wire.sock.settimeout(None)
        endpoint = Endpoint(wire, bytes.fromhex(orders["key"]), int(orders["rank"]), MASTER_RANK, orders["token"])
        endpoint.send("attach", role="watch", challenge=challenge, timeout=10.0)
        os.write(1, b"1")  # attached: the node goes on
        while True:
            state = "gone" if node_gone.is_set() else proc_state(pid)
            endpoint.send("state", timeout=5.0, state=state, pid=pid)
            if state in ("gone", "Z", "X"):
                return 0
            node_gone.wait(PERIOD_S)
    except (OSError, WireClosed, ProtocolError):  # rank 0 is gone (or never answered): nothing left to report to
        return 0


if __name__ == "__main__":
    code = main()
    os._exit(code)
