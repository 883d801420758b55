"""The control plane's waiting: ``Inbox`` (a thread blocked on one store queue) on both sides,
and ``Channel``, rank 0's side: commands out to the nodes; replies, "batch ready" notices and
failures in, through the store (formats in ``protocol.py``).

Why a thread: a store queue can be waited on efficiently only by blocking on it, and a blocking
store call that times out logs a C++ warning each time.  So one thread per process blocks on
its queue (with its own store connection and a timeout of days) and hands each message to the
main thread through a ``queue.Queue``; the main thread waits on that with short timeouts, runs
its liveness check in between, and never polls the store in a loop.
"""

from __future__ import annotations

import collections
import datetime
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from rlcollect.distributed import protocol as P
from rlcollect.distributed.auth import DropLog
from rlcollect.multiprocess.protocol import WorkerError

logger = logging.getLogger("rlcollect")

#: Seconds between two liveness checks while waiting.
CHECK_S = 0.25
#: A blocking store wait this long is not expected to end by timing out.
_BLOCK = datetime.timedelta(days=7)


class Inbox:
    """A daemon thread that pops messages from one store queue and hands them over.

    Args:
        connect: returns a new store connection (used only by the thread).
        key: the store queue to read.
        stop_word: the message that ends the thread (sent by ``close``).
    """

    def __init__(self, connect: Callable[[], Any], key: str, stop_word: bytes = b""):
        self.key, self._stop_word = key, stop_word
        self._messages: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._store = connect()
        self._store.set_timeout(_BLOCK)
        self._thread = threading.Thread(target=self._run, name=f"rlcollect-inbox-{key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        store = self._store
        try:
            while True:
                try:
                    data = store.queue_pop(self.key, True)
                except RuntimeError as err:
                    if "timeout" in str(err).lower():  # idle for days: wait again
                        continue
                    raise
                if self._stop_word and data == self._stop_word:
                    return
                self._messages.put(data)
        except BaseException as err:  # noqa: BLE001  (the store is gone: handed to the main thread)
            self._error = err
            self._messages.put(None)
        finally:
            self._store = None

    def get(self, timeout: float | None) -> bytes | None:
        """The next message, waiting up to ``timeout`` seconds (0: do not wait); None if there
        is none.  Raises ``RuntimeError`` once the store connection is lost."""
        try:
            data = self._messages.get(timeout=timeout) if timeout else self._messages.get_nowait()
        except queue.Empty:
            return None
        if data is None:
            raise RuntimeError(f"lost the store connection: {_first_line(self._error)}")
        return data

    def close(self, store: Any, timeout: float = 2.0) -> None:
        """End the thread (``store``: any connection to push the stop word with)."""
        if self._thread.is_alive() and self._stop_word:
            try:
                store.queue_push(self.key, self._stop_word)
            except Exception:  # noqa: BLE001  (the store is already gone, and the thread with it)
                pass
            self._thread.join(timeout)


class Channel:
    """Rank 0's control plane.

    Args:
        store: a connection to rank 0's store (commands go out on it).
        connect: returns a new connection (for the inbox thread).
        world_size: rank 0 plus the nodes.
        tokens: ``{rank: token}`` of each node's current session (the caller updates it when
            it configures a node); a message carrying another token is dropped.
        check: the liveness check, run every ``CHECK_S`` while waiting.
        stop_word: ends the inbox thread; secret to rank 0, so no node can stop it.
        keys: the run's keys (``auth.Keys``): commands are signed, what comes in is checked.
        sent, received: ``{rank: counter}`` of the last message sent to / taken from each
            node's session (the caller resets them when it configures a node).
    """

    def __init__(self, store: Any, connect: Callable[[], Any], world_size: int, tokens: dict[int, str],
                 check: Callable[[], None], stop_word: bytes, keys: Any, sent: dict[int, int],
                 received: dict[int, int]):
        self.store, self.tokens, self._check = store, tokens, check
        self.keys, self.sent, self.received = keys, sent, received
        self.drops = DropLog("rlcollect")
        self.retired: set[str] = set()  # tokens of node incarnations that failed and were replaced
        self.ranks = range(1, world_size)
        self._ids = [0] * world_size
        self.notices: collections.deque[P.Message] = collections.deque()
        self._replies: dict[int, collections.deque[P.Message]] = {rank: collections.deque() for rank in self.ranks}
        self._next_check = 0.0
        self.inbox = Inbox(connect, P.INBOX, stop_word)

    def command(self, rank: int, name: str, payload: bytes = b"", **args: Any) -> int:
        """Queue a command for node ``rank``; returns its id (to wait for its reply)."""
        P.check_command(name, args)
        self._ids[rank] += 1
        self.sent[rank] += 1
        self.store.queue_push(P.command_queue(rank), P.encode(
            "command", P.MASTER_RANK, self.keys.to_node, self.tokens[rank], self.sent[rank], payload, to=rank,
            id=self._ids[rank], name=name, args=args))
        return self._ids[rank]

    def forget(self, rank: int) -> None:
        """Drop what node ``rank`` sent and rank 0 has not taken yet (the node failed)."""
        kept = [msg for msg in self.notices if msg.rank != rank]
        self.notices.clear()
        self.notices.extend(kept)
        self._replies[rank].clear()

    def check_now(self) -> None:
        self._next_check = time.monotonic() + CHECK_S
        self._check()

    def maybe_check(self) -> None:
        """Run the liveness check if the last one is older than ``CHECK_S``."""
        if time.monotonic() >= self._next_check:
            self.check_now()

    def pump(self, timeout: float = 0.0) -> bool:
        """Sort every waiting message (waiting up to ``timeout`` s for the first); raise a
        node's reported failure.  True if a message was taken."""
        got = False
        data = self.inbox.get(timeout)
        while data is not None:
            got = True
            self._sort(data)
            data = self.inbox.get(0)
        return got

    def _sort(self, data: bytes) -> None:
        try:
            msg = P.decode(data, self.keys.to_rank0, kinds=("ready", "failed", "reply"), to=P.MASTER_RANK,
                           ranks=self.ranks)
        except P.ProtocolError as err:
            self.drops.drop("rank 0's inbox", P.claimed_sender(data), str(err))
            return
        if msg.token != self.tokens.get(msg.rank):
            if msg.token in self.retired:  # a late message of a node incarnation that failed
                logger.info("rlcollect: dropped a %r message of a replaced incarnation of node %d", msg.kind,
                            msg.rank - 1)
            else:
                self.drops.drop("rank 0's inbox", f"rank {msg.rank}", "it belongs to another session")
            return
        if msg.n <= self.received.get(msg.rank, 0):
            self.drops.drop("rank 0's inbox", f"rank {msg.rank}", f"a replay (counter {msg.n})")
            return
        self.received[msg.rank] = msg.n
        if msg.kind == "failed":
            raise P.mark_failed(P.rebuild_error(msg["error"], msg.rank - 1, "collection"), msg.rank - 1)
        (self.notices if msg.kind == "ready" else self._replies[msg.rank]).append(msg)

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        """Sort messages until ``predicate()`` holds; liveness is checked throughout, and
        ``timeout`` (seconds, None: none besides liveness) bounds the wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            self.maybe_check()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"{what} took more than {timeout:g} s")
            self.pump(max(1e-3, self._next_check - time.monotonic()))

    def reply(self, rank: int, command_id: int, what: str, timeout: float) -> tuple[Any, bytes]:
        """Wait (up to ``timeout`` s) for node ``rank``'s reply to command ``command_id``:
        ``(value, payload)``; a node's exception is re-raised here."""
        replies = self._replies[rank]
        found: list[P.Message] = []

        def arrived() -> bool:
            while replies and not found:
                msg = replies.popleft()
                if msg["id"] == command_id:
                    found.append(msg)
                else:
                    logger.error("rlcollect: dropped node %d's reply to command %d (waiting for %d)", rank - 1,
                                 msg["id"], command_id)
            return bool(found)

        try:
            self.wait_for(arrived, f"node {rank - 1}'s answer to {what}", timeout)
        except WorkerError as err:
            if err.worker_index is None:
                err.worker_index = err.node_index = rank - 1
            raise
        msg = found[0]
        if not msg["ok"]:
            raise P.rebuild_error(msg["error"] or {}, rank - 1, what)
        return msg["value"], msg.payload

    def close(self) -> None:
        self.inbox.close(self.store)


def _first_line(err: BaseException | None) -> str:
    text = str(err).strip().splitlines() if err is not None else []
    return text[0] if text else type(err).__name__
