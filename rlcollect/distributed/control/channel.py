"""The control plane's channels (``wire.py``), both sides: ``Channel``, rank 0's (a listener
that nodes connect to, their hellos; commands out; replies, "batch ready" notices, start-up
reports and failures in; the pair groups' rendezvous calls answered), and ``NodeInbox``, a
node's (rank 0's messages in).

Each attached channel has a reader thread that receives whole messages, checks each one
(``protocol.decode``: MAC first, then sender, receiver, session and a counter that must grow)
and hands it on; what does not verify is dropped and logged once per sender.  Heartbeats are
stamped in the reader thread (their arrival time, not when the main thread looks), so a
trainer busy for a minute does not find its nodes silent.  The main thread waits on one
``queue.Queue`` with short timeouts and runs its liveness checks in between.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import secrets
import select
import threading
from collections.abc import Callable
from typing import Any

from rlcollect.data import field_bytes
from rlcollect.distributed.control import protocol as P
from rlcollect.distributed.control import transport
from rlcollect.distributed.control.auth import DropLog, Keys
from rlcollect.distributed.control.channel_store import StoreServer
from rlcollect.distributed.control.wire import MAX_ATTACH_BYTES, Listener, Reader, Wire, WireClosed

logger = logging.getLogger("rlcollect")

#: What a node sends rank 0 on its channel (after its "hello").
NODE_KINDS = ("started", "failed", "ready", "reply", "beat", "bye", "store")
#: What a node's watcher sends.
WATCH_KINDS = ("state",)
#: Authentic first messages (hellos, watchers' attaches) waiting for the main thread, per node:
#: beyond it a connection is closed at once.
ATTACHES_PER_NODE = 4
#: How long rank 0 waits for a node it refuses to read why, when rank 0 raises next.
REFUSAL_READ_S = 2.0
#: What one message from a node may announce before it reported its layout and policy (its
#: "started" report is JSON), and on top of twice its policy and batch sizes after (a
#: ``state_dict`` reply holds the policy and the env's state).  A longer one ends that node's
#: channel (its failure), before anything of it is allocated.
BASE_MESSAGE_BYTES = 64 << 20
#: The environment variable that sets the cap of one node message instead (bytes).
MAX_MESSAGE_ENV = "RLCOLLECT_MAX_MESSAGE_BYTES"


def message_cap(weights_nbytes: int = 0, batch_nbytes: int = 0) -> int:
    """The most one node message may announce: ``$RLCOLLECT_MAX_MESSAGE_BYTES`` if set, else
    ``BASE_MESSAGE_BYTES`` plus twice the node's policy (``weights_nbytes``) and batch sizes.

    Example:
        >>> message_cap(10 << 20, 1 << 20) >> 20  # (without the environment variable)
        86
    """
    value = os.environ.get(MAX_MESSAGE_ENV)
    if value is not None:
        try:
            cap = int(value)
        except ValueError:
            cap = 0
        if cap < MAX_ATTACH_BYTES:
            raise ValueError(f"${MAX_MESSAGE_ENV}={value!r}: expected a number of bytes, at least {MAX_ATTACH_BYTES}")
        return cap
    return BASE_MESSAGE_BYTES + 2 * (weights_nbytes + batch_nbytes)


class Channel:
    """Rank 0's control plane: the listener on ``address`` and ``port`` (the one port the nodes
    are told: ``tcp_port``, None for a free one), the nodes' hellos, commands out, and what the
    nodes send sorted into batch notices, replies and start-up reports; the pair groups'
    rendezvous calls are served from ``store`` (``channel_store.py``) in the readers' threads.
    It never waits by itself: ``NodePool.wait_for`` pumps it between liveness checks.

    Every connection gets rank 0's "welcome" first (signed; the run's nonce and a fresh
    challenge); its first message must be an authentic "hello" (a node) or "attach" (its
    watcher) of this run repeating that challenge, else it is closed in the listener's thread.

    Args:
        address: the interface to listen on (``master_addr``'s); ``port``: its port.
        handles: ``{rank: NodeHandle}``: each node's current session (token), which the
            handshake updates when it configures a node; only that session's watcher may
            attach, once.
        keys: the run's keys (``auth.Keys``): commands are signed, what comes in is checked.
        on_attach: called (in the main thread) with a node's handle once it is configured.
        run: the run's nonce (a hello of another run is a replay).
        store: the ``HashStore`` that rank 0's pair groups use (nodes reach it through
            ``StoreServer``).
    """

    def __init__(self, address: str, handles: dict[int, Any], keys: Keys, on_attach: Callable[[Any], None],
                 run: str = "", port: int | None = None, store: Any = None):
        self.handles, self.keys, self.on_attach, self.run = handles, keys, on_attach, run
        self.store = None if store is None else StoreServer(store)
        self.drops = DropLog("rlcollect")
        self.ranks = range(1, len(handles) + 1)
        self._ids = {rank: 0 for rank in self.ranks}
        self.notices: collections.deque[P.Message] = collections.deque()
        self._replies: dict[int, collections.deque[P.Message]] = {rank: collections.deque() for rank in self.ranks}
        self.started: dict[int, P.Message] = {}  # each node's "started" (or start-up "failed") report
        self.byes: set[int] = set()
        self.closed: dict[int, str] = {}  # rank -> why its current channel closed
        self.caps = {rank: message_cap() for rank in self.ranks}  # what one message of node rank may announce
        # Authentic hellos the handshake has not answered yet, per rank: (endpoint, hello).
        self.hellos: dict[int, collections.deque] = {rank: collections.deque() for rank in self.ranks}
        # Their endpoints, beaten (heartbeat thread) until answered: the node waits on rank 0's word.
        self._greeted: set[P.Endpoint] = set()
        self._greeted_lock = threading.Lock()
        # What waits here is authentic: the listener's thread checks a connection's first
        # message and closes it there unless it is a hello or an attach; those are bounded too
        # (``_attach_room``), so no stranger can fill this queue or hold a descriptor in it.
        self._events: queue.Queue = queue.Queue()
        self._attach_room = threading.BoundedSemaphore(ATTACHES_PER_NODE * len(handles))
        transport.raise_fd_limit()
        self.listener = Listener(address, self._first_message, self._welcome, port)
        self.port = self.listener.port

    # -- out ------------------------------------------------------------------------------------------
    def command(self, rank: int, name: str, payload: bytes = b"", **args: Any) -> int:
        """Send node ``rank`` a command; returns its id (to wait for its reply).  Raises
        ``WireClosed`` when the node's channel is broken."""
        P.check_command(name, args)
        self._ids[rank] += 1
        self.send(rank, "command", payload, id=self._ids[rank], name=name, args=args)
        return self._ids[rank]

    def send(self, rank: int, kind: str, payload: bytes = b"", **fields: Any) -> None:
        endpoint = self.handles[rank].endpoint
        if endpoint is None:
            raise WireClosed(f"node rank {rank} has no channel")
        endpoint.send(kind, payload, **fields)

    def beat_all(self) -> None:
        """Rank 0's beat on every node's channel, and to every node waiting for its answer
        (from the heartbeat thread; never waits)."""
        for h in list(self.handles.values()):
            endpoint = h.endpoint
            if endpoint is not None:
                endpoint.try_send("beat")
        with self._greeted_lock:
            waiting = list(self._greeted)
        for endpoint in waiting:
            endpoint.try_send("beat")

    # -- in -------------------------------------------------------------------------------------------
    def pump(self, timeout: float = 0.0) -> bool:
        """Sort every waiting event (waiting up to ``timeout`` s for the first); raise a node's
        reported failure.  True if something was taken."""
        try:
            event = self._events.get(timeout=timeout) if timeout else self._events.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._sort(event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return True

    def _welcome(self) -> tuple[bytes, str]:
        """What the listener sends each new connection: rank 0's signed "welcome" (the run's
        nonce, and a challenge of this connection's own), and that challenge."""
        challenge = secrets.token_hex(16)
        return P.encode("welcome", P.MASTER_RANK, self.keys.to_node, self.run, 0, to=P.EVERYONE,
                        challenge=challenge), challenge

    def _first_message(self, wire: Wire, data: bytes, challenge: str) -> None:
        """A connection's first message (in the listener's thread): an authentic hello of this
        run or a watcher's attach, repeating this connection's ``challenge``, is queued for the
        main thread; anything else is closed here."""
        try:
            msg = P.decode(data, self.keys.to_rank0, kinds=("hello", "attach"), to=P.MASTER_RANK, ranks=self.ranks)
            if msg["challenge"] != challenge:
                raise P.ProtocolError("it does not repeat this connection's challenge (a replay)")
            if msg.kind == "hello" and msg["run"] != self.run:
                raise P.ProtocolError("it is for another run (a replay, or a node of an earlier collector)")
            if msg.kind == "hello" and len(msg.token) < 16:
                raise P.ProtocolError("its session token is too short")
        except P.ProtocolError as err:
            self.drops.drop("rank 0's channel listener", P.claimed_sender(data), str(err))
            wire.close()
            return
        if not self._attach_room.acquire(blocking=False):
            self.drops.drop("rank 0's channel listener", P.claimed_sender(data),
                            "too many hellos and attaches wait already")
            wire.close()
            return
        if msg.kind == "attach":
            self._events.put(("attach", wire, msg))
            return
        endpoint = P.Endpoint(wire, self.keys.to_node, P.MASTER_RANK, msg.rank, msg.token)
        with self._greeted_lock:
            self._greeted.add(endpoint)
        self._events.put(("hello", endpoint, msg))

    def _sort(self, event: tuple) -> None:
        what = event[0]
        if what in ("attach", "hello"):
            self._attach_room.release()
            if what == "attach":
                self._attach(event[1], event[2])
                return
            waiting = self.hellos[event[2].rank]
            waiting.append(event[1:])
            if len(waiting) > ATTACHES_PER_NODE:  # authentic, but more than any node says
                self.refuse(*waiting.popleft(), "too many hellos for this rank")
            return
        endpoint, rank = event[1], event[2]
        h = self.handles[rank]
        if endpoint is not h.endpoint:  # a late event of a node incarnation that failed
            if what == "msg":
                logger.info("rlcollect: dropped a %r message of a replaced incarnation of node %d", event[3].kind,
                            rank - 1)
            return
        if what == "closed":
            self.closed.setdefault(rank, event[3])
            return
        msg = event[3]
        if msg.kind == "started" or (msg.kind == "failed" and rank not in self.started):
            self.started.setdefault(rank, msg)
            if msg.kind == "started":
                self.caps[rank] = _cap_of(msg)
        elif msg.kind == "failed":
            raise P.mark_failed(P.rebuild_error(msg["error"], rank - 1, "collection"), rank - 1)
        elif msg.kind == "ready":
            self.notices.append(msg)
        elif msg.kind == "reply":
            self._replies[rank].append(msg)
        elif msg.kind == "bye":
            self.byes.add(rank)

    # -- the handshake's answers -----------------------------------------------------------------------
    def take_hello(self, rank: int) -> tuple[P.Endpoint, P.Message] | None:
        """The oldest authentic hello of node ``rank`` not answered yet (its endpoint and the
        message); the caller answers it with ``adopt`` or ``refuse``."""
        waiting = self.hellos[rank]
        return waiting.popleft() if waiting else None

    def _ungreet(self, endpoint: P.Endpoint) -> None:
        with self._greeted_lock:
            self._greeted.discard(endpoint)

    def refuse(self, endpoint: P.Endpoint, msg: P.Message, reason: str, linger: bool = False) -> None:
        """Answer ``msg`` (a hello) with a refusal and close its connection (``linger``: after
        the node read it, for up to ``REFUSAL_READ_S``: rank 0 raises next)."""
        self._ungreet(endpoint)
        try:
            endpoint.send("reject", timeout=REFUSAL_READ_S, reason=reason)
            if linger:  # the node closes once it read why: its end of file
                select.select([endpoint.wire.sock], [], [], REFUSAL_READ_S)
        except (OSError, WireClosed):
            pass
        endpoint.close()

    def adopt(self, h: Any, endpoint: P.Endpoint, msg: P.Message, **config: Any) -> None:
        """Make ``endpoint`` (whose hello ``msg`` the handshake accepted) node ``h``'s channel:
        send it ``config``, read what it sends from now on, and ``on_attach`` (which sends its
        spec).  A connection that broke meanwhile is reported as closed by its reader."""
        self._ungreet(endpoint)
        rank, last = msg.rank, [msg.n]
        h.endpoint, h.received = endpoint, msg.n
        try:
            endpoint.send("config", **config)
        except WireClosed:
            pass

        def on_message(data: bytes, at: float) -> None:
            got = self._check(data, rank, endpoint.token, last, NODE_KINDS, "channel")
            if got is None:
                return
            if got.kind == "beat":
                if h.endpoint is endpoint:
                    h.last_beat = at
                return
            if got.kind == "store":
                self._serve_store(h, endpoint, got)
                return
            self._events.put(("msg", endpoint, rank, got))

        def on_close(err: BaseException) -> None:
            self._events.put(("closed", endpoint, rank, _first_line(err)))

        self.caps[rank] = message_cap()  # until this session reports its layout and policy
        Reader(endpoint.wire, on_message, on_close, f"rlcollect-channel-{rank}", lambda: self.caps[rank])
        self.on_attach(h)

    def _serve_store(self, h: Any, endpoint: P.Endpoint, msg: P.Message) -> None:
        """Answer a node's store call (in its reader's thread: rank 0's main thread may be
        waiting on the pair group that needs it)."""
        if h.endpoint is not endpoint or self.store is None:
            return
        try:
            found, value = self.store.serve(msg.rank, h.incarnation, msg)
        except P.ProtocolError as err:
            self.drops.drop(f"node rank {msg.rank}'s store calls", f"rank {msg.rank}", str(err))
            found, value = False, b""
        try:
            endpoint.send("stored", value, id=msg["id"], found=found)
        except WireClosed:
            pass

    def _attach(self, wire: Wire, msg: P.Message) -> None:
        """A watcher's attach (authentic, this connection's): its reports of its node's state."""
        try:
            h = self.handles[msg.rank]
            if not h.configured or msg.token != h.token:
                raise P.ProtocolError("it belongs to another session (a replay, or a node rank 0 did not configure)")
            if msg["role"] != "watch":
                raise P.ProtocolError(f"unknown role {msg['role']!r}")
            if h.watcher is not None:
                raise P.ProtocolError("this session's watcher is attached already (a replay)")
        except P.ProtocolError as err:
            self.drops.drop("rank 0's channel listener", f"rank {msg.rank}", str(err))
            wire.close()
            return
        rank, last = msg.rank, [msg.n]
        h.watcher = wire

        def on_report(data: bytes, at: float) -> None:
            report = self._check(data, rank, h.token, last, WATCH_KINDS, "watcher channel")
            if report is not None and h.watcher is wire:
                h.watch = (report["state"], at)

        Reader(wire, on_report, lambda err: None, f"rlcollect-watch-{rank}", lambda: MAX_ATTACH_BYTES)

    def _check(self, data: bytes, rank: int, token: str, last: list[int], kinds: tuple[str, ...],
               where: str) -> P.Message | None:
        """``data`` decoded if authentic, from ``rank``'s session ``token``, newer than
        ``last[0]`` (updated); else None (dropped, logged once).  Runs in a reader thread."""
        try:
            msg = P.decode(data, self.keys.to_rank0, kinds=kinds, to=P.MASTER_RANK, rank=rank, token=token,
                           after=last[0])
        except P.ProtocolError as err:
            self.drops.drop(f"node rank {rank}'s {where}", P.claimed_sender(data), str(err))
            return None
        last[0] = msg.n
        return msg

    def take_reply(self, rank: int, command_id: int) -> P.Message | None:
        """Node ``rank``'s reply to command ``command_id`` if it came (replies to older commands
        are logged and dropped)."""
        replies = self._replies[rank]
        while replies:
            msg = replies.popleft()
            if msg["id"] == command_id:
                return msg
            logger.error("rlcollect: dropped node %d's reply to command %d (waiting for %d)", rank - 1, msg["id"],
                         command_id)
        return None

    def forget(self, rank: int) -> None:
        """Close node ``rank``'s channels and drop what it sent that rank 0 has not taken (the
        node failed, or is relaunched)."""
        h = self.handles[rank]
        for wire in (h.endpoint.wire if h.endpoint is not None else None, h.watcher):
            if wire is not None:
                wire.close()
        h.endpoint = h.watcher = h.watch = None
        if self.store is not None:
            self.store.forget(rank, h.incarnation)
        kept = [msg for msg in self.notices if msg.rank != rank]
        self.notices.clear()
        self.notices.extend(kept)
        self._replies[rank].clear()
        self.started.pop(rank, None)
        self.closed.pop(rank, None)
        self.byes.discard(rank)

    def close(self) -> None:
        self.listener.close()
        while True:  # attaches the main thread never took
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                break
            if event[0] in ("attach", "hello"):
                event[1].close()
        for waiting in self.hellos.values():
            while waiting:
                waiting.popleft()[0].close()
        for rank in self.ranks:
            h = self.handles[rank]
            for wire in (h.endpoint.wire if h.endpoint is not None else None, h.watcher):
                if wire is not None:
                    wire.close()


class NodeInbox:
    """A node's side of its channel: a reader thread that checks what rank 0 sends (MAC,
    session, growing counter), notes rank 0's news for ``watch`` (``NodeWatch``), hands the
    answers to the pair group's store calls to ``store`` (``channel_store.ChannelStore``, once
    set) and queues the rest for the main thread (``get``).  When the channel closes before
    rank 0 said "close", rank 0 is gone: ``watch.lost`` ends the node.

    Args:
        wire: the channel (already connected).
        keys: the run's keys; ``rank``: this node's; ``token``: its session.
        watch: the node's ``NodeWatch``.
        last: the counter of the last message of rank 0 taken already (its "config").
    """

    def __init__(self, wire: Wire, keys: Keys, rank: int, token: str, watch: Any, last: int = 0):
        self.wire, self._key, self.rank, self.token, self._watch = wire, keys.to_node, rank, token, watch
        self.drops = DropLog(f"rlcollect node {rank}")
        self._messages: queue.Queue = queue.Queue()
        self._last = last
        self.closing = False  # rank 0 said "close": the channel's end is expected
        self._error: str | None = None
        self.store: Any = None
        self._reader = Reader(wire, self._on_message, self._on_close, f"rlcollect-inbox-{rank}")

    def _on_message(self, data: bytes, at: float) -> None:
        try:
            msg = P.decode(data, self._key, kinds=("setup", "command", "beat", "stored"), to=self.rank,
                           rank=P.MASTER_RANK, token=self.token, after=self._last)
        except P.ProtocolError as err:  # checked before anything of it is used: never acted upon
            self.drops.drop("its channel", P.claimed_sender(data), str(err))
            return
        self._last = msg.n
        self._watch.news()
        if msg.kind == "beat":
            return
        if msg.kind == "stored":
            if self.store is not None:
                self.store.deliver(msg)
            return
        if msg.kind == "command" and msg["name"] == "close":
            self.closing = True
        self._messages.put(msg)

    def _on_close(self, err: BaseException) -> None:
        self._error = _first_line(err)
        self._messages.put(None)
        if self.store is not None:
            self.store.lost(self._error)
        if not self.closing:
            self._watch.lost(f"lost rank 0's channel ({self._error})")

    def get(self, timeout: float | None) -> P.Message | None:
        """The next message, waiting up to ``timeout`` seconds (0: do not wait); None if there
        is none.  Raises ``RuntimeError`` once the channel is closed."""
        try:
            msg = self._messages.get(timeout=timeout) if timeout else self._messages.get_nowait()
        except queue.Empty:
            return None
        if msg is None:
            self._messages.put(None)
            raise RuntimeError(f"lost rank 0's channel: {self._error}")
        return msg

    def close(self) -> None:
        self.closing = True
        self.wire.close()
        self._reader.join(2.0)


def _cap_of(started: P.Message) -> int:
    """``message_cap`` of a node's "started" report (its layout and policy); the base cap if
    they are malformed (the handshake reports that)."""
    try:
        weights = started["weights"]
        spec = P.weights_from_json(weights) if weights is not None else {}
        return message_cap(transport.weights_nbytes(spec), field_bytes(P.layout_from_json(started["layout"]))[1])
    except (P.ProtocolError, KeyError, TypeError, ValueError):
        return message_cap()


def _first_line(err: BaseException | None) -> str:
    text = str(err).strip().splitlines() if err is not None else []
    return text[0] if text else type(err).__name__
