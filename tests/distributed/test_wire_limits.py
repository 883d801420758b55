"""Issue 36, item 5: what a message announces is neither allocated before it arrives nor taken
beyond a cap.  An authenticated peer announcing 1 GiB made rank 0 allocate it up front
(``Wire._recv_exactly`` -> ``bytearray(n)``); now a wire reads in bounded chunks, and a node's
channel refuses a message longer than ``message_cap`` (64 MiB plus twice the node's policy and
batch sizes, or ``$RLCOLLECT_MAX_MESSAGE_BYTES``).  In-process: a loopback connection stands
for the peer."""

from __future__ import annotations

import socket
import struct
import threading
import tracemalloc

import pytest

from rlcollect.distributed.control import channel as C
from rlcollect.distributed.control.wire import Reader, Wire, WireClosed

pytestmark = pytest.mark.timeout(60)
GiB = 1 << 30


def _pair() -> tuple[socket.socket, socket.socket]:
    """A connected TCP pair on loopback (a wire sets TCP options)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        peer = socket.create_connection(server.getsockname())
        mine, _ = server.accept()
    return mine, peer


def _announce(peer: socket.socket, size: int, send: int) -> None:
    peer.sendall(struct.pack("!Q", size) + b"\0" * send)
    peer.close()


def test_an_announced_gigabyte_is_not_allocated_before_it_arrives():
    mine, peer = _pair()
    sender = threading.Thread(target=_announce, args=(peer, GiB, 1 << 20))
    wire = Wire(mine)
    tracemalloc.start()
    try:
        sender.start()
        with pytest.raises(WireClosed, match="end of file"):
            wire.recv()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        sender.join()
        wire.close()
    assert peak < 64 << 20  # one chunk (16 MiB) at most, not the announced gigabyte


def test_a_whole_message_still_arrives_across_chunks():
    mine, peer = _pair()
    data = bytes(range(256)) * (40 << 12)  # 40 MiB: three chunks
    sender = threading.Thread(target=lambda: (peer.sendall(struct.pack("!Q", len(data)) + data), peer.close()))
    wire = Wire(mine)
    sender.start()
    try:
        assert wire.recv() == data
    finally:
        sender.join()
        wire.close()


def test_a_reader_refuses_a_message_over_its_cap():
    mine, peer = _pair()
    closed: list[BaseException] = []
    done = threading.Event()
    reader = Reader(Wire(mine), lambda data, at: None, lambda err: (closed.append(err), done.set()), "test-reader",
                    lambda: 1 << 20)
    _announce(peer, GiB, 0)
    assert done.wait(30)
    reader.join(5)
    assert isinstance(closed[0], WireClosed)
    assert str(closed[0]) == f"a message of {GiB} bytes (at most {1 << 20} are taken here)"


def test_the_cap_follows_the_policy_and_batch_sizes_and_the_environment(monkeypatch):
    monkeypatch.delenv(C.MAX_MESSAGE_ENV, raising=False)
    assert C.message_cap() == 64 << 20
    assert C.message_cap(100 << 20, 1 << 20) == (64 + 200 + 2) << 20
    monkeypatch.setenv(C.MAX_MESSAGE_ENV, str(1 << 30))
    assert C.message_cap(100 << 20) == 1 << 30
    monkeypatch.setenv(C.MAX_MESSAGE_ENV, "lots")
    with pytest.raises(ValueError, match=r"\$RLCOLLECT_MAX_MESSAGE_BYTES='lots': expected a number of bytes, at "
                                         r"least 65536"):
        C.message_cap()
