"""The per-node point-to-point channels: one TCP connection from each node (and one from each
node's watcher) to a listener rank 0 opens on ``master_addr``, carrying the control messages
of ``protocol.py`` (each MAC-checked by its receiver before anything of it is used).

Why a plain socket, not the store or the gloo pair group: the store's values are capped at
8 MiB and its queues can be popped by anyone who reaches its port (a foreign ``queue_pop``
ended a run; a popped and re-pushed notice desynchronised a node); a gloo receive must know
its size in advance, cannot be waited on together with others, and gloo's rendezvous goes
through the store.  A socket per node has none of these limits: a message is an 8-byte length
and the message, of any size; rank 0 waits on all of them at once; a foreign process can only
open connections of its own, which are closed unless their first message is an authentic
"attach" within ``ATTACH_S`` seconds.  The framing is the standard library's ``socket`` and
``selectors``; no extra dependency (``multiprocessing.connection`` frames alike but has no
send deadline, and its handshake would authenticate the connection, not each message).

Only the standard library is imported here: a node's watcher (``watcher.py``) uses this
module without importing torch.
"""

from __future__ import annotations

import collections
import errno
import logging
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("rlcollect")

_LENGTH = struct.Struct("!Q")
#: A connection whose first message (its "attach") has not come within this many seconds is closed.
ATTACH_S = 5.0
#: The largest first message rank 0 reads from a connection not yet attached.
MAX_ATTACH_BYTES = 64 * 1024
#: Connections not yet attached that rank 0 keeps at once; beyond it the oldest are closed.
MAX_PENDING = 256
_CHUNK = 1 << 20


class WireClosed(ConnectionError):
    """The peer closed the connection (or it broke)."""


def send_deadline(nbytes: int) -> float:
    """Seconds a send of ``nbytes`` may take: generous for a slow network, short enough that a
    peer frozen mid-transfer is reported within seconds."""
    return 10.0 + nbytes / 20e6


class Wire:
    """One framed connection.  Sends are serialised by a lock (``send``); a message is
    received whole by ``recv`` (one reader at a time: a thread of its own).

    Args:
        sock: a connected stream socket (kept blocking; sends use ``MSG_DONTWAIT`` and a
            deadline, so a peer that stops reading never blocks a sender for ever).
        received: bytes already read from ``sock`` that follow what was taken (the listener
            reads a connection's first message in chunks: a peer that sends its next message
            at once, as a watcher does, has its start in the same chunk); ``recv`` reads them
            first.
    """

    def __init__(self, sock: socket.socket, received: bytes = b""):
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.lock = threading.Lock()
        self.closed = False
        self._received = bytearray(received)

    @classmethod
    def connect(cls, host: str, port: int, timeout: float) -> Wire:
        return cls(socket.create_connection((host, port), timeout=timeout))

    def fileno(self) -> int:
        return self.sock.fileno()

    # -- sending -----------------------------------------------------------------------------------
    def send(self, data: bytes | Callable[[], bytes], timeout: float | None = None) -> None:
        """Send one message (or what ``data()`` makes, under the lock; ``timeout``: seconds,
        default ``send_deadline``); raises ``WireClosed`` when the connection is broken or the
        peer does not take it in time (the connection is then closed: a half-sent message
        cannot be taken back)."""
        with self.lock:
            if callable(data):
                data = data()
            self._send(data, time.monotonic() + (send_deadline(len(data)) if timeout is None else timeout))

    def try_send(self, make: Callable[[], bytes]) -> bool:
        """Send ``make()`` only if that cannot wait (for heartbeats): not while another send is
        under way (which shows life by itself), nor when the peer's buffer is full (a peer
        that does not read).  True if sent."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            if self.closed or not select.select([], [self.sock], [], 0)[1]:
                return False
            self._send(make(), time.monotonic() + 2.0)
            return True
        except WireClosed:
            return False
        finally:
            self.lock.release()

    def _send(self, data: bytes, deadline: float) -> None:
        if self.closed:
            raise WireClosed("the channel is closed")
        view = memoryview(_LENGTH.pack(len(data)) + data) if len(data) < _CHUNK else None
        parts = [view] if view is not None else [memoryview(_LENGTH.pack(len(data))), memoryview(data)]
        try:
            for part in parts:
                while part:
                    try:
                        part = part[self.sock.send(part[:_CHUNK * 16], socket.MSG_DONTWAIT):]
                    except BlockingIOError:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise TimeoutError("the peer did not take the message in time") from None
                        select.select([], [self.sock], [], min(left, 1.0))
        except (OSError, TimeoutError) as err:
            self.close()
            raise WireClosed(f"cannot send: {err}") from None

    # -- receiving ---------------------------------------------------------------------------------
    def recv(self, max_bytes: int | None = None) -> bytes:
        """The next message (blocking); ``WireClosed`` at end of file or on a broken
        connection, or for a message over ``max_bytes``."""
        size = _LENGTH.unpack(self._recv_exactly(_LENGTH.size))[0]
        if max_bytes is not None and size > max_bytes:
            self.close()
            raise WireClosed(f"a message of {size} bytes (at most {max_bytes} are taken here)")
        return bytes(self._recv_exactly(size))

    def _recv_exactly(self, n: int) -> bytes | bytearray:
        """``n`` bytes, in chunks of at most ``_CHUNK * 16``: what is allocated follows what
        arrived (a peer announcing a gigabyte and sending nothing costs one chunk, not a
        gigabyte)."""
        chunks: list[bytes | bytearray] = []
        got = 0
        if self._received:
            chunks.append(bytes(self._received[:n]))
            got = len(chunks[0])
            del self._received[:got]
        while got < n:
            chunk = bytearray(min(n - got, _CHUNK * 16))
            view, filled = memoryview(chunk), 0
            while filled < len(chunk):
                try:
                    k = self.sock.recv_into(view[filled:])
                except OSError as err:
                    raise WireClosed(f"connection broken: {err}") from None
                if not k:
                    raise WireClosed("end of file")
                filled += k
            view.release()
            chunks.append(chunk)
            got += len(chunk)
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close(self) -> None:
        """Close the connection (a thread blocked in ``recv`` wakes with ``WireClosed``)."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class Reader:
    """A daemon thread that receives a wire's messages and hands each to ``handle(data,
    received_at)``; ``on_close(error)`` once the wire ends.  ``handle`` runs in the thread.
    ``max_bytes()`` (if given) is the most one message may announce, asked before each: a
    longer one closes the wire (``WireClosed``)."""

    def __init__(self, wire: Wire, handle: Callable[[bytes, float], None], on_close: Callable[[BaseException], None],
                 name: str, max_bytes: Callable[[], int | None] | None = None):
        self.wire, self._handle, self._on_close = wire, handle, on_close
        self._max_bytes = max_bytes or (lambda: None)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                data = self.wire.recv(self._max_bytes())
                self._handle(data, time.monotonic())
        except BaseException as err:  # noqa: BLE001  (handed to the owner)
            self._on_close(err)

    def join(self, timeout: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


class Listener:
    """Rank 0's listener on ``address``, the one port a node is told (``port``; 0: one the OS
    picks).

    A thread accepts connections, sends each ``greet()``'s bytes at once (rank 0's "welcome":
    a fresh challenge, which ``greet`` returns too) and reads each one's first message (at most
    ``MAX_ATTACH_BYTES``, within ``ATTACH_S`` seconds; many at once, none can hold up the
    others); ``on_first(wire, data, challenge)`` gets it (in that thread) and keeps the wire,
    or closes it.  At most ``MAX_PENDING`` connections wait for their first message (beyond,
    the oldest are closed), so idle foreign connections cannot pile up in rank 0's file
    descriptors.
    """

    def __init__(self, address: str, on_first: Callable[[Wire, bytes, str], None],
                 greet: Callable[[], tuple[bytes, str]], port: int | None = None):
        self.sock = bind(address, port)
        self.port = self.sock.getsockname()[1]
        self._on_first, self._greet = on_first, greet
        self._stop = threading.Event()
        self._pending: collections.OrderedDict[socket.socket, tuple[float, bytearray, str]] = \
            collections.OrderedDict()
        self.refused = 0  # connections closed without an authentic first message (for the tests and stats)
        self._thread = threading.Thread(target=self._run, name="rlcollect-channel-listener", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in sel.select(0.1):
                    if key.fileobj is self.sock:
                        self._accept(sel)
                    else:
                        self._read(sel, key.fileobj)
                now = time.monotonic()
                for conn, (deadline, _, _) in list(self._pending.items()):
                    if now > deadline:
                        self._drop(sel, conn)
        except Exception:  # noqa: BLE001  (the listener is closed under us at shutdown)
            if not self._stop.is_set():
                logger.exception("rlcollect: the channel listener failed")
        finally:
            for conn in list(self._pending):
                self._drop(sel, conn)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE) and self._pending:
                    self._drop(sel, next(iter(self._pending)))  # make room: the oldest stranger goes
                    continue
                return
            conn.setblocking(False)
            if len(self._pending) >= MAX_PENDING:
                self._drop(sel, next(iter(self._pending)))
            welcome, challenge = self._greet()
            try:  # a few hundred bytes into an empty socket buffer: never blocks
                sent = conn.send(_LENGTH.pack(len(welcome)) + welcome, socket.MSG_DONTWAIT)
            except OSError:
                sent = 0
            if sent != _LENGTH.size + len(welcome):
                self.refused += 1
                conn.close()
                continue
            self._pending[conn] = (time.monotonic() + ATTACH_S, bytearray(), challenge)
            sel.register(conn, selectors.EVENT_READ)

    def _read(self, sel: selectors.BaseSelector, conn: Any) -> None:
        deadline, buf, challenge = self._pending[conn]
        try:
            chunk = conn.recv(MAX_ATTACH_BYTES + _LENGTH.size - len(buf))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(sel, conn)
            return
        buf += chunk
        if len(buf) < _LENGTH.size:
            return
        size = _LENGTH.unpack(buf[:_LENGTH.size])[0]
        if size > MAX_ATTACH_BYTES:
            self._drop(sel, conn)
            return
        if len(buf) < _LENGTH.size + size:
            return
        sel.unregister(conn)
        del self._pending[conn]
        end = _LENGTH.size + size
        try:  # what follows the attach (a watcher's first report) is the wire's to read, each message checked
            self._on_first(Wire(conn, received=bytes(buf[end:])), bytes(buf[_LENGTH.size:end]), challenge)
        except Exception:  # noqa: BLE001
            logger.exception("rlcollect: handling a channel connection failed")
            conn.close()

    def _drop(self, sel: selectors.BaseSelector, conn: Any) -> None:
        self._pending.pop(conn, None)
        self.refused += 1
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.sock.close()


#: How long a user-given port may stay busy (a previous run's socket closing) before we give up.
PORT_RETRY_S = 3.0


def bind(address: str, port: int | None) -> socket.socket:
    """A listening socket on ``address`` (a numeric address: only that interface) and ``port``
    (None or 0: a free one the OS picks, on the socket we keep, so that no other process can
    take it between choosing and listening).  A user-given port that is busy is retried for
    ``PORT_RETRY_S`` seconds, then reported."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    deadline = time.monotonic() + PORT_RETRY_S
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port or 0))
            # A long backlog: a node connecting during a stranger's flood waits in it, not in
            # SYN retries (the listener drains it as fast as connections come).
            sock.listen(1024)
            sock.setblocking(False)
            return sock
        except OSError as err:
            sock.close()
            if err.errno == errno.EADDRINUSE and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            if err.errno == errno.EADDRINUSE:
                raise OSError(errno.EADDRINUSE, f"tcp_port={port} is already in use on {address} (tried for "
                              f"{PORT_RETRY_S:g} s): pass another tcp_port, or tcp_port=None to pick a free "
                              "one") from None
            if err.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"master_addr {address} is not an address of this host: give the address of "
                                 "one of its interfaces, the one the nodes can reach") from None
            raise
