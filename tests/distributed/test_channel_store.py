"""The pair groups' rendezvous over the channel (issue 36, F6: rank 0 hosts no store server):
what torch's ``ProcessGroupGloo`` calls on a Python store, and what rank 0's ``StoreServer``
serves a node, and refuses."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
from torch.distributed import HashStore, PrefixStore, ProcessGroupGloo

from rlcollect.distributed.control import protocol as P
from rlcollect.distributed.control.channel_store import MAX_KEYS, MAX_VALUE, ChannelStore, StoreServer, full_key

pytestmark = pytest.mark.timeout(60)


def test_gloo_calls_only_clone_set_wait_and_get_of_a_python_store():
    """What channel_store.py's docstring says torch calls (so that ChannelStore implements
    enough): a lazily connected two-rank pair, made and used in two threads of this process."""
    backing, calls, keep = HashStore(), [], []

    class Logged(torch.distributed.Store):
        def set(self, key, value):
            calls.append("set")
            backing.set(key, value)

        def get(self, key):
            calls.append("get")
            return backing.get(key)

        def check(self, keys):
            calls.append("check")
            return backing.check(keys)

        def wait(self, keys, timeout=None):
            calls.append("wait")
            backing.wait(keys, timeout or datetime.timedelta(seconds=20))

        def clone(self):
            calls.append("clone")
            return self

    groups, errors = {}, []

    def side(rank):
        try:
            options = ProcessGroupGloo._Options()
            options._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=True)]
            options._timeout = datetime.timedelta(seconds=20)
            store = Logged()
            keep.append(store)
            pg = groups[rank] = ProcessGroupGloo(PrefixStore(P.pg_prefix(1, 0), store), rank, 2, options)
            peer, got = 1 - rank, torch.zeros(1)
            works = [pg.send([torch.ones(1)], peer, 3), pg.recv([got], peer, 3)]
            for work in works:
                work.wait(datetime.timedelta(seconds=20))
            assert got.item() == 1.0
        except Exception as err:  # noqa: BLE001  (reported below)
            errors.append(err)

    threads = [threading.Thread(target=side, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert set(calls) <= {"clone", "set", "wait", "get"} and {"set", "get"} <= set(calls)
    groups.clear()


def _store_msg(op, keys, value=b""):
    return P.Message("store", 1, "t" * 32, {"id": 1, "op": op, "keys": keys}, value, 2, 0)


def test_the_store_server_serves_a_node_its_own_pair_keys_only():
    store = HashStore()
    server = StoreServer(store)
    mine = full_key(1, 0, "0/1")
    assert server.serve(1, 0, _store_msg("get", [mine])) == (False, b"")
    assert server.serve(1, 0, _store_msg("set", [mine], b"addr")) == (True, b"")
    assert server.serve(1, 0, _store_msg("check", [mine])) == (True, b"")
    assert server.serve(1, 0, _store_msg("get", [mine])) == (True, b"addr")
    refused = [
        (1, 0, _store_msg("set", [full_key(2, 0, "0/1")], b"x")),  # another node's pair
        (1, 1, _store_msg("get", [mine])),  # its own rank, another incarnation's keys
        (1, 0, _store_msg("set", [mine], b"x" * (MAX_VALUE + 1))),  # too large
        (1, 0, _store_msg("add", [mine])),  # not a rendezvous call
        (1, 0, _store_msg("get", [])),
    ]
    for rank, incarnation, msg in refused:
        with pytest.raises(P.ProtocolError):
            server.serve(rank, incarnation, msg)
    for i in range(MAX_KEYS - 1):  # one key is set already
        server.serve(1, 0, _store_msg("set", [full_key(1, 0, f"k{i}")], b"v"))
    with pytest.raises(P.ProtocolError, match="more than"):
        server.serve(1, 0, _store_msg("set", [full_key(1, 0, "one too many")], b"v"))
    server.forget(1, 0)  # a relaunch: what the incarnation set is gone
    assert not store.check([mine])


def test_a_node_store_call_fails_at_once_when_its_channel_closes():
    class Endpoint:
        def send(self, *args, **fields):
            pass

    store = ChannelStore(Endpoint(), timeout=30.0)
    threading.Timer(0.2, store.lost, args=("end of file",)).start()
    with pytest.raises(RuntimeError, match="channel closed during a store check: end of file"):
        store.check(["k"])


_SEALED = """
import datetime, os, socket, threading, torch
from torch.distributed import HashStore
from rlcollect.distributed.control import pair_ports, transport

store, groups = HashStore(), {}
before = set(pair_ports.listening())
for rank in (0, 1):  # one after the other: each call takes the listeners that appeared during it
    groups[rank] = transport.pair_group(store, 1, 0, rank == 0, "127.0.0.1", 20.0)
gloo = []
for fd in set(pair_ports.listening()) - before:
    probe = socket.socket(fileno=os.dup(fd))
    gloo.append(probe.getsockname()[1])
    probe.close()
threads = [threading.Thread(target=transport.join, args=([groups[r]], r == 0, 20.0)) for r in (0, 1)]
[t.start() for t in threads]; [t.join() for t in threads]
assert not set(pair_ports.listening()) - before, "a pair listener is still open"
for port in gloo:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        raise AssertionError(f"port {port} still takes connections")
    except ConnectionRefusedError:
        pass
work = groups[0].send([torch.ones(3)], 1, 7)  # the pair still works
got = torch.zeros(3)
groups[1].recv([got], 0, 7).wait(datetime.timedelta(seconds=20))
work.wait(datetime.timedelta(seconds=20))
assert got.tolist() == [1.0, 1.0, 1.0]
groups.clear()  # gloo's teardown unregisters the stand-in: no abort
print("SEALED", len(gloo), flush=True)
"""


def test_gloo_pair_listeners_are_closed_once_the_pair_joined_and_the_group_still_works_and_frees():
    """pair_ports.py: each pair group's gloo listener takes no connection after ``join`` (a
    stranger's idle connections to it aborted the process at its open-files limit), the pair
    still carries tensors, and freeing the group does not abort (a subprocess: an abort would
    end pytest)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _SEALED], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                              os.getcwd(), os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 0 and "SEALED 2" in done.stdout, done.stderr[-3000:]


_OTHERS_KEPT = """
import os, selectors, socket, threading
from torch.distributed import HashStore
from rlcollect.distributed.control import pair_ports, transport

real, others = transport.ProcessGroupGloo.create_device, []
loop = selectors.DefaultSelector()  # the program's own event loop, made before


def opened_meanwhile(*args, **kwargs):
    # While a pair group is made, the program opens listening sockets of its own (as another
    # thread could): on the group's address in its existing event loop, on another address in a
    # new event loop, on the group's address in no event loop.
    for register in ("old loop", "new loop", None):
        s = socket.socket()
        s.bind(("127.0.0.2" if register == "new loop" else "127.0.0.1", 0))
        s.listen(8)
        if register == "old loop":
            loop.register(s, selectors.EVENT_READ)
        elif register == "new loop":
            fresh = selectors.DefaultSelector()
            fresh.register(s, selectors.EVENT_READ)
            others.append(fresh)
        others.append(s)
    return real(*args, **kwargs)


transport.ProcessGroupGloo.create_device = staticmethod(opened_meanwhile)
store, groups = HashStore(), {}
for rank in (0, 1):
    groups[rank] = transport.pair_group(store, 1, 0, rank == 0, "127.0.0.1", 20.0)
threads = [threading.Thread(target=transport.join, args=([groups[r]], r == 0, 20.0)) for r in (0, 1)]
[t.start() for t in threads]; [t.join() for t in threads]
kept = 0
for s in others:
    if isinstance(s, socket.socket):
        socket.create_connection(s.getsockname(), timeout=2).close()  # still listening
        kept += 1
groups.clear()
print("KEPT", kept, flush=True)
"""


def test_sealing_leaves_the_programs_own_listeners_alone():
    """pair_ports.made_since: listening sockets the program opens while a pair group is made
    (in its own event loop, in a new one on another address, in none) are not taken for gloo's
    and stay open after ``join`` seals gloo's (a subprocess, as above)."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _OTHERS_KEPT], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                              os.getcwd(), os.environ.get("PYTHONPATH")]))})
    assert done.returncode == 0 and "KEPT 6" in done.stdout, done.stderr[-3000:]
