"""A foreign process that can reach rank 0's port (its channel listener, the one port it opens;
no secret) tries what issues 13, 23 and 36 found it could do: run code on a node with a pickled
``load_state_dict``, abort rank 0 with a forged ``failed``, talk to the port as to the TCPStore
it once was, join or claim a node's rank, replay what it captured.  Each attack must fail, be
dropped and be logged once per sender; the run goes on.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from dist_helpers import (ValuePolicy, channel_send, counting5, free_port, node_pids, pid_alive,  # noqa: E402
                          rlcollect_command)
from rlcollect.distributed.control.wire import Wire  # noqa: E402

from rlcollect import DistributedCollector  # noqa: E402
from rlcollect.distributed.control import protocol as P  # noqa: E402
from rlcollect.distributed.control.auth import new_secret, write_secret_file  # noqa: E402

pytestmark = pytest.mark.timeout(180)
HELPERS = str(Path(__file__).resolve().parents[1] / "distributed")


class _Payload:
    """Unpickling this runs ``touch MARKER``: the attack's proof of code execution."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _address(c: DistributedCollector) -> tuple[str, int]:
    """What an attacker on the host has: the address and port, nothing else."""
    host, port = c.stats()["master"].rsplit(":", 1)
    return host, int(port)


def _captured_hello(c: DistributedCollector, rank: int) -> bytes:
    """Node ``rank``'s authentic hello as an eavesdropper on the network captured it (its
    session's first message; the challenge is its own connection's, long gone)."""
    pool = c._pool
    return P.encode("hello", rank, pool.keys.to_rank0, pool.handles[rank - 1].token, 1, to=0, world_size=3,
                    pid=1, host="h", run=pool.run, challenge="0" * 32)


def _forge(kind: str, rank: int, token: str, payload: bytes = b"", *, to: int, n: int = 10**6, **fields) -> bytes:
    """A message with every header field right but signed with a key that is not the run's."""
    return P.encode(kind, rank, os.urandom(32), token, n, payload, to=to, **fields)


@pytest.fixture
def collector():
    c = DistributedCollector([counting5] * 2, ValuePolicy(), frames_per_batch=20, total_frames=-1, sync=True,
                             launcher="mp", timeout=60.0)
    try:
        yield c
    finally:
        c.shutdown()


def test_secret_never_enters_what_rank_0_says_to_strangers_or_the_command_line(collector):
    c = collector
    next(iter(c))
    secret = c._pool.secret
    welcomes = []
    for _ in range(2):
        wire = Wire.connect(*_address(c), 10.0)
        welcomes.append(wire.recv())  # what anyone who reaches the port is told: the run's nonce, a challenge
        wire.close()
    assert len({P.unverified_challenge(w) for w in welcomes}) == 2  # a fresh challenge per connection
    assert all(secret not in v and c._pool.keys.to_node not in v and c._pool.keys.to_rank0 not in v
               for v in welcomes)
    for pid in node_pids(c):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert secret not in f.read()
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert secret not in f.read()


def test_a_pickled_command_from_a_foreign_process_runs_no_code(capfd, tmp_path):
    c = DistributedCollector([counting5] * 2, ValuePolicy(), frames_per_batch=20, total_frames=-1, sync=True,
                             launcher="mp", timeout=60.0)  # started here: its nodes write to capfd's stderr
    try:
        _pickled_command_attack(c, capfd, tmp_path)
    finally:
        c.shutdown()


def _pickled_command_attack(c, capfd, tmp_path):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Payload(marker))
    assert not marker.exists()
    # The attacker knows the node's session token (it travels in the clear: an eavesdropper
    # read it) and sends commands, and a node spec, that carry the payload to rank 0's channel
    # listener (nodes listen on nothing: their channel is a connection they opened): forged
    # MACs, no MAC, and, signed with the run's key, node 1's hello replayed on a new connection.
    token = c._pool.handles[0].token
    wires = channel_send(c, *[_forge("command", 0, token, evil, to=1, n=10**6 + n, id=99, name="load_state_dict",
                                     args={}) for n in range(3)],
                         _forge("setup", 0, token, evil, to=1, n=1),
                         P.MAGIC + b"\0" * 32 + b'{"kind":"command"}\n' + evil,
                         _captured_hello(c, 1))
    # The run goes on: batches and a command round trip.
    for _ in range(3):
        assert next(iter(c)).shape == (2, 10)
    c.set_seed(3)
    deadline = time.monotonic() + 10
    while c._pool.channel.drops.total < 6 and time.monotonic() < deadline:
        next(iter(c))
    for wire in wires:
        wire.close()
    assert not marker.exists()
    assert c._pool.channel.drops.total == 6
    err = capfd.readouterr().err
    assert "Traceback" not in err


def test_replayed_messages_are_dropped_and_logged_once(collector, caplog):
    c = collector
    pool = c._pool
    next(iter(c))
    # What an eavesdropper could have captured: node 1's authentic hello (counter 1 of its
    # session), replayed twice on new connections to take over its channel.
    hello = _captured_hello(c, 1)
    with caplog.at_level(logging.ERROR, logger="rlcollect"):
        wires = channel_send(c, hello, hello)
        deadline = time.monotonic() + 10
        while pool.channel.drops.total < 2 and time.monotonic() < deadline:
            assert next(iter(c)).shape == (2, 10)
        for _ in range(3):
            assert next(iter(c)).shape == (2, 10)
    for wire in wires:
        wire.close()
    replays = [r for r in caplog.records if "a replay" in r.getMessage()]
    assert len(replays) == 1 and "claiming to come from rank 1" in replays[0].getMessage()
    assert "challenge" in replays[0].getMessage()
    assert pool.channel.drops.total == 2 and pool.handles[0].state.value == "serving"


def test_a_forged_failure_does_not_abort_rank_0(collector, caplog):
    c = collector
    info = {"type": "builtins.RuntimeError", "message": "forged failure", "traceback": ""}
    with caplog.at_level(logging.ERROR, logger="rlcollect"):
        wires = channel_send(c, *[_forge("failed", rank, c._pool.handles[rank - 1].token, to=0, error=info)
                                  for rank in (1, 2) for _ in range(2)])
        batches = [next(iter(c)) for _ in range(4)]
        deadline = time.monotonic() + 10
        while c._pool.channel.drops.total < 4 and time.monotonic() < deadline:
            batches.append(next(iter(c)))
    for wire in wires:
        wire.close()
    assert {b.shape for b in batches} == {torch.Size([2, 10])}
    dropped = [r.getMessage() for r in caplog.records if "dropped a message on rank 0's channel" in r.getMessage()]
    assert len(dropped) == 2  # once per claimed sender
    assert all("MAC does not verify" in m for m in dropped)


def test_a_store_client_on_rank_0s_port_gets_nothing_and_the_run_goes_on(collector):
    """What ended a run when the port was torch's TCPStore (a ``set`` on a heartbeat key, an
    integer ``add`` on it) has nothing to reach now: a TCPStore client is closed without an answer."""
    c = collector
    pids = node_pids(c)
    host, port = _address(c)
    with pytest.raises(Exception):  # noqa: B017,PT011  (torch's DistStoreError or DistNetworkError: it got no store)
        TCPStore(host, port, None, False, datetime.timedelta(seconds=3)).set("rlc/hb/0", b"x")
    for _ in range(4):
        assert next(iter(c)).shape == (2, 10)
    assert all(pid_alive(pid) for pid in pids)
    assert c.stats()["workers"][0]["pid"] == pids[0]
    assert c._pool.channel.listener.refused >= 1


def _node(port: int, rank: int, world_size: int, secret_file: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([rlcollect_command(), "node", "--master-addr", "127.0.0.1", "--master-port", str(port),
                             "--rank", str(rank), "--world-size", str(world_size), "--timeout", "60",
                             "--secret-file", secret_file, *extra],
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                HELPERS, os.environ.get("PYTHONPATH")]))}, stderr=subprocess.PIPE, text=True)


def test_a_node_without_the_secret_cannot_claim_a_rank_or_join(tmp_path):
    secret_file = str(write_secret_file(new_secret(), tmp_path / "real"))
    wrong_file = str(write_secret_file(new_secret(), tmp_path / "wrong"))
    port = free_port()
    # The impostor (another secret) starts first, to claim rank 1 before the real node does.
    impostor = _node(port, 1, 2, wrong_file, "--rank0-timeout", "5")
    real = None
    try:
        time.sleep(1.0)
        real = _node(port, 1, 2, secret_file)
        with DistributedCollector([counting5], ValuePolicy(), frames_per_batch=10, total_frames=30,
                                  launcher="external", master_addr="127.0.0.1", tcp_port=port, timeout=60.0,
                                  secret_file=secret_file) as c:
            assert [b.shape for b in c] == [torch.Size([10])] * 3
            assert c.stats()["workers"][0]["pid"] == real.pid  # the real node got rank 1
        assert real.wait(timeout=30) == 0
        # The impostor never got a configuration: it could not authenticate rank 0 either.
        assert impostor.wait(timeout=30) == 3
        err = impostor.stderr.read()
        assert "rank 0's welcome" in err and "MAC does not verify" in err and "secret" in err
        assert "Traceback" not in err
    finally:
        for p in (impostor, real):
            if p is not None:
                if p.poll() is None:
                    p.kill()
                p.wait()
                p.stderr.close()


def test_a_forged_hello_gets_no_configuration_and_rank_0_says_why(tmp_path, caplog):
    import threading

    from rlcollect import WorkerError

    secret_file = str(write_secret_file(new_secret(), tmp_path / "real"))
    port = free_port()
    stop = threading.Event()
    seen: list[str] = []

    def attacker() -> None:
        while not stop.wait(0.1):
            try:  # a hello with every field right (the challenge too) but signed without the secret
                wire = Wire.connect("127.0.0.1", port, 5.0)
                challenge = P.unverified_challenge(wire.recv())
                wire.send(_forge("hello", 1, "f" * 32, to=0, n=1, world_size=2, pid=1, host="attacker", run="?",
                                 challenge=challenge))
                wire.sock.settimeout(5.0)
                seen.append(json.loads(wire.recv()[len(P.MAGIC) + 32:].partition(b"\n")[0])["kind"])
            except (OSError, ConnectionError):
                seen.append("closed")  # what it gets: its connection closed, no configuration

    thread = threading.Thread(target=attacker, daemon=True)
    thread.start()
    try:
        with caplog.at_level(logging.ERROR, logger="rlcollect"):
            with pytest.raises(WorkerError, match=r"node 0 \(rank 1\): has not reached rank 0 "
                                                   r"\(no authentic hello\).*failed authentication"):
                DistributedCollector([counting5], frames_per_batch=10, launcher="external", master_addr="127.0.0.1",
                                     tcp_port=port, start_timeout=3.0, secret_file=secret_file)
    finally:
        stop.set()
        thread.join(10)
    assert seen and set(seen) == {"closed"}  # no configuration ever came for the forged session
    dropped = [r.getMessage() for r in caplog.records if "rank 0's channel listener" in r.getMessage()]
    assert len(dropped) == 1 and "MAC does not verify" in dropped[0]
