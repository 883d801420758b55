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
from collections.abc import Callable
from typing import Any

from rlcollect.distributed import protocol as P
from rlcollect.distributed.auth import DropLog

logger = logging.getLogger("rlcollect")

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
    """Rank 0's control plane: commands out, and what the nodes send sorted into batch notices
    and replies.  It never waits by itself: ``NodePool.wait_for`` pumps it between liveness
    checks.

    Args:
        store: a connection to rank 0's store (commands go out on it).
        connect: returns a new connection (for the inbox thread).
        handles: ``{rank: NodeHandle}``: each node's current session (token, message
            counters), which the pool updates when it configures a node; a message carrying
            another token is dropped.
        stop_word: ends the inbox thread; secret to rank 0, so no node can stop it.
        keys: the run's keys (``auth.Keys``): commands are signed, what comes in is checked.
    """

    def __init__(self, store: Any, connect: Callable[[], Any], handles: dict[int, Any], stop_word: bytes,
                 keys: Any):
        self.store, self.handles, self.keys = store, handles, keys
        self.drops = DropLog("rlcollect")
        self.retired: set[str] = set()  # tokens of node incarnations that failed and were replaced
        self.ranks = range(1, len(handles) + 1)
        self._ids = {rank: 0 for rank in self.ranks}
        self.notices: collections.deque[P.Message] = collections.deque()
        self._replies: dict[int, collections.deque[P.Message]] = {rank: collections.deque() for rank in self.ranks}
        self.inbox = Inbox(connect, P.INBOX, stop_word)

    def command(self, rank: int, name: str, payload: bytes = b"", **args: Any) -> int:
        """Queue a command for node ``rank``; returns its id (to wait for its reply)."""
        P.check_command(name, args)
        handle = self.handles[rank]
        self._ids[rank] += 1
        handle.sent += 1
        self.store.queue_push(P.command_queue(rank), P.encode(
            "command", P.MASTER_RANK, self.keys.to_node, handle.token, handle.sent, payload, to=rank,
            id=self._ids[rank], name=name, args=args))
        return self._ids[rank]

    def forget(self, rank: int) -> None:
        """Drop what node ``rank`` sent and rank 0 has not taken yet (the node failed)."""
        kept = [msg for msg in self.notices if msg.rank != rank]
        self.notices.clear()
        self.notices.extend(kept)
        self._replies[rank].clear()

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
        handle = self.handles[msg.rank]
        if msg.token != handle.token:
            if msg.token in self.retired:  # a late message of a node incarnation that failed
                logger.info("rlcollect: dropped a %r message of a replaced incarnation of node %d", msg.kind,
                            msg.rank - 1)
            else:
                self.drops.drop("rank 0's inbox", f"rank {msg.rank}", "it belongs to another session")
            return
        if msg.n <= handle.received:
            self.drops.drop("rank 0's inbox", f"rank {msg.rank}", f"a replay (counter {msg.n})")
            return
        handle.received = msg.n
        if msg.kind == "failed":
            raise P.mark_failed(P.rebuild_error(msg["error"], msg.rank - 1, "collection"), msg.rank - 1)
        (self.notices if msg.kind == "ready" else self._replies[msg.rank]).append(msg)

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

    def close(self) -> None:
        self.inbox.close(self.store)


def _first_line(err: BaseException | None) -> str:
    text = str(err).strip().splitlines() if err is not None else []
    return text[0] if text else type(err).__name__
