"""Rank 0's side of the control plane: commands out to the nodes, replies and "batch ready"
notices in, through the store (formats in ``protocol.py``).

Every wait here polls the store with a short backoff (a blocking store wait that times out
logs a warning from C++ each time) and, every ``CHECK_S``, runs the liveness check it was
given, which raises ``WorkerError`` for a node that died or stopped answering.  So no wait
hangs on a dead node, and each has a deadline in seconds where it can have one.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

from rlcollect.distributed import protocol as P
from rlcollect.multiprocess.protocol import WorkerError

logger = logging.getLogger("rlcollect")

CHECK_S = 0.25


class Backoff:
    """Sleeps between polls: short while things move, longer once a wait has lasted (a batch
    that takes seconds does not need to be noticed within microseconds)."""

    def __init__(self, first: float = 50e-6, cap: float = 1e-3, slow_after: float = 1.0, slow_cap: float = 10e-3):
        self.first, self.cap, self.slow_after, self.slow_cap = first, cap, slow_after, slow_cap
        self.reset()

    def reset(self) -> None:
        self._delay = self.first
        self._since = time.monotonic()

    def sleep(self) -> None:
        time.sleep(self._delay)
        cap = self.slow_cap if time.monotonic() - self._since > self.slow_after else self.cap
        self._delay = min(self._delay * 2, cap)


class Channel:
    """Commands to nodes, their replies, and the shared queue of "batch ready" notices.

    Args:
        store: a client of rank 0's store.
        world_size: rank 0 plus the nodes.
        token: this run's token; messages carrying another are dropped.
        check: the liveness check, run every ``CHECK_S`` while waiting.
    """

    def __init__(self, store: Any, world_size: int, token: str, check: Callable[[], None]):
        self.store, self.token, self._check = store, token, check
        self.ranks = range(1, world_size)
        self._ids = [0] * world_size
        self.notices: collections.deque[P.Message] = collections.deque()
        self._next_check = 0.0

    def command(self, rank: int, name: str, payload: bytes = b"", **args: Any) -> int:
        """Queue a command for node ``rank``; returns its id (to wait for its reply)."""
        P.check_command(name, args)
        self._ids[rank] += 1
        self.store.queue_push(P.command_queue(rank), P.encode(
            "command", P.MASTER_RANK, self.token, payload, id=self._ids[rank], name=name, args=args))
        return self._ids[rank]

    def check_now(self) -> None:
        self._next_check = time.monotonic() + CHECK_S
        self._check()

    def maybe_check(self) -> None:
        """Run the liveness check if the last one is older than ``CHECK_S``."""
        if time.monotonic() >= self._next_check:
            self.check_now()

    # -- batch notices --------------------------------------------------------------------------------
    def pump(self) -> bool:
        """Move every waiting notice into ``notices``; raise a node's reported failure."""
        got = False
        while self.store.queue_len(P.READY_QUEUE) > 0:
            data = self.store.queue_pop(P.READY_QUEUE, False)
            try:
                msg = P.decode(data, kinds=("ready", "failed"), ranks=self.ranks, token=self.token)
            except P.ProtocolError as err:
                logger.error("rlcollect: dropped a malformed or foreign batch notice: %s", err)
                continue
            if msg.kind == "failed":
                raise P.rebuild_error(msg["error"], msg.rank - 1, "collection")
            self.notices.append(msg)
            got = True
        return got

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float | None = None) -> None:
        """Pump notices until ``predicate()`` holds; liveness is checked throughout, and
        ``timeout`` (seconds, None: none besides liveness) bounds the wait."""
        backoff = Backoff()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not predicate():
            if self.pump():
                backoff.reset()
                continue
            self.maybe_check()
            if deadline is not None and time.monotonic() > deadline:
                raise WorkerError(f"{what} took more than {timeout:g} s")
            backoff.sleep()

    # -- replies ------------------------------------------------------------------------------------------
    def reply(self, rank: int, command_id: int, what: str, timeout: float) -> tuple[Any, bytes]:
        """Wait (up to ``timeout`` s) for node ``rank``'s reply to command ``command_id``:
        ``(value, payload)``; a node's exception is re-raised here."""
        queue = P.reply_queue(rank)
        backoff = Backoff()
        deadline = time.monotonic() + timeout
        while True:
            if self.store.queue_len(queue) > 0:
                data = self.store.queue_pop(queue, False)
                try:
                    msg = P.decode(data, kinds=("reply",), rank=rank, token=self.token)
                except P.ProtocolError as err:
                    logger.error("rlcollect: dropped a malformed reply on node %d's queue: %s", rank - 1, err)
                    continue
                if msg["id"] != command_id:
                    logger.error("rlcollect: dropped node %d's reply to command %d (waiting for %d)", rank - 1,
                                 msg["id"], command_id)
                    continue
                if not msg["ok"]:
                    raise P.rebuild_error(msg["error"] or {}, rank - 1, what)
                return msg["value"], msg.payload
            self.pump()
            self.maybe_check()
            if time.monotonic() > deadline:
                raise WorkerError(f"node {rank - 1} did not answer {what} within {timeout:g} s", rank - 1)
            backoff.sleep()
