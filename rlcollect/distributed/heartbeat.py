"""Liveness in both directions.

Every process (rank 0 and each node) writes a signed beat (``protocol.encode("beat")``: its
session token and a growing counter) to its own store key every ``PERIOD_S``, from a thread
with its own store connection (so a long blocking call on the main connection never delays a
beat).  Counters, not timestamps: hosts' clocks need not agree; the watcher times how long it
has seen no *new* authentic beat on its own clock.  Beats are written with ``set`` and read with
``get``: nothing a foreign process writes to a beat key can make a store call fail (an integer
``add`` on a key someone overwrote would), and a beat that does not verify is "no news".

- Rank 0 checks its nodes' beats while it waits (``Silence``): a node silent for
  ``heartbeat_timeout`` seconds has stopped answering.
- A node watches rank 0 (``NodeWatch``): it ends when rank 0's store connection breaks (rank 0
  died: its sockets close at once), when rank 0 has not beaten for ``rank0_timeout`` seconds (a
  frozen or unreachable rank 0; a watchdog thread times it, so a store call that blocks on a
  frozen rank 0 cannot delay it), or, for nodes rank 0 started itself, when that parent process
  is gone.  Rank 0's first authentic beats also tell a node the run's nonce (``run``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rlcollect.distributed import protocol as P
from rlcollect.distributed.auth import DropLog, Keys

logger = logging.getLogger("rlcollect")

PERIOD_S = 0.5
#: Rank 0's beat is for every node.
EVERYONE = -1
_WATCHDOG_S = 0.1


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def _is_timeout(err: BaseException) -> bool:
    return "timeout" in str(err).lower() or "timed out" in str(err).lower()


class _Beater:
    """A daemon thread that writes ``rank``'s signed beat every ``PERIOD_S`` (and, in
    subclasses, reads something after each beat)."""

    def __init__(self, connect: Callable[[], Any], rank: int, key: bytes, token: str):
        self._connect, self.rank, self._key, self.token = connect, rank, key, token
        self._stop = threading.Event()
        self._count = 0
        self._thread = threading.Thread(target=self._run, name=f"rlcollect-heartbeat-{rank}", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def beat(self, store: Any) -> None:
        self._count += 1
        to = EVERYONE if self.rank == P.MASTER_RANK else P.MASTER_RANK
        store.set(P.heartbeat_key(self.rank), P.encode("beat", self.rank, self._key, self.token, self._count, to=to))

    def _run(self) -> None:
        try:
            store = self._connect()
        except Exception as err:  # noqa: BLE001
            self._store_error(err, connecting=True)
            return
        try:
            while not self._stop.is_set():
                try:
                    self.beat(store)
                    self.after_beat(store)
                except Exception as err:  # noqa: BLE001
                    if self._store_error(err, connecting=False):
                        return
                self._stop.wait(PERIOD_S)
        finally:
            del store

    def after_beat(self, store: Any) -> None:
        pass

    def _store_error(self, err: BaseException, connecting: bool) -> bool:
        """Handle a failed store call; True to end the thread."""
        logger.warning("rlcollect rank %d: heartbeat store call failed: %s", self.rank, _first_line(err))
        return False


class Rank0Beat(_Beater):
    """Rank 0's beat (its token: the run's nonce).  A failing store call never ends it: it
    logs and beats again."""

    def __init__(self, connect: Callable[[], Any], keys: Keys, run: str):
        super().__init__(connect, P.MASTER_RANK, keys.to_node, run)
        self._warned = False

    def _store_error(self, err: BaseException, connecting: bool) -> bool:
        if not self._warned and not self._stop.is_set():
            self._warned = True
            logger.warning("rlcollect: rank 0's heartbeat could not be written: %s", _first_line(err))
        return connecting


class NodeWatch(_Beater):
    """A node's beat, and its watch on rank 0.

    Args:
        connect: returns a new store connection (called in the thread).
        rank: this node's rank; ``token``: its session token.
        keys: the run's keys.
        rank0_timeout: seconds without a new authentic beat of rank 0 before ``on_lost``.
        on_lost: called once, from a watcher thread, with the reason rank 0 is gone.
        parent_alive: for nodes rank 0 started itself: False once that process is gone.
    """

    def __init__(self, connect: Callable[[], Any], rank: int, keys: Keys, token: str, rank0_timeout: float,
                 on_lost: Callable[[str], None], parent_alive: Callable[[], bool] | None = None):
        super().__init__(connect, rank, keys.to_rank0, token)
        self._check_key, self.rank0_timeout = keys.to_node, rank0_timeout
        self._on_lost, self._parent_alive = on_lost, parent_alive
        self._drops = DropLog(f"rlcollect node {rank}")
        self.run: str | None = None  # the run's nonce, once two authentic beats of rank 0 showed it
        self.run_known = threading.Event()
        self._candidate: tuple[str, int] | None = None
        self._last_n = 0
        self._last_news = time.monotonic()
        self._lost_once = threading.Lock()
        self._watchdog = threading.Thread(target=self._watch, name=f"rlcollect-watchdog-{rank}", daemon=True)

    def start(self) -> NodeWatch:
        super().start()
        self._watchdog.start()
        return self

    def after_beat(self, store: Any) -> None:
        key = P.heartbeat_key(P.MASTER_RANK)
        if not store.check([key]):
            return
        data = store.get(key)
        try:
            msg = P.decode(data, self._check_key, kinds=("beat",), to=EVERYONE, rank=P.MASTER_RANK)
        except P.ProtocolError as err:
            hint = " (is this node's secret the run's? see --secret-file)" if isinstance(err, P.AuthError) else ""
            self._drops.drop("rank 0's heartbeat key", P.claimed_sender(data), f"{err}{hint}")
            return
        if self.run is None:
            # A beat seen once may be a replay of another run's; one that moves is rank 0's.
            if self._candidate is not None and self._candidate[0] == msg.token and msg.n > self._candidate[1]:
                self.run, self._last_n, self._last_news = msg.token, msg.n, time.monotonic()
                self.run_known.set()
            else:
                self._candidate = (msg.token, msg.n)
        elif msg.token == self.run and msg.n > self._last_n:
            self._last_n, self._last_news = msg.n, time.monotonic()

    def _store_error(self, err: BaseException, connecting: bool) -> bool:
        if self._stop.is_set():
            return True
        if not connecting and _is_timeout(err):
            return False  # rank 0 is slow or frozen: no news; the watchdog decides
        self._lost(f"lost rank 0's store: {_first_line(err)}")
        return True

    def _watch(self) -> None:
        while not self._stop.wait(_WATCHDOG_S):
            if self._parent_alive is not None and not self._parent_alive():
                self._lost("the process that started this node (rank 0) is gone")
                return
            silent = time.monotonic() - self._last_news
            if silent > self.rank0_timeout:
                what = "has not beaten" if self.run is not None else "has not shown an authentic heartbeat"
                self._lost(f"rank 0 {what} for {silent:.0f} s (rank0_timeout={self.rank0_timeout:g}): it is frozen, "
                           "unreachable, or runs with another secret")
                return

    def _lost(self, reason: str) -> None:
        if not self._stop.is_set() and self._lost_once.acquire(blocking=False):
            self._on_lost(reason)


class Silence:
    """Rank 0's view of its nodes' beats: how long each has shown no new authentic beat.

    ``handles`` is the pool's ``{rank: NodeHandle}``: a beat of another session than the
    handle's (its ``token``, updated when a node is configured) is no news."""

    def __init__(self, store: Any, keys: Keys, handles: dict[int, Any], timeout: float):
        self.store, self.timeout, self._key, self._handles = store, timeout, keys.to_rank0, handles
        self._seen: dict[int, tuple[int, float]] = {}
        self._drops = DropLog("rlcollect")

    def silent(self) -> list[tuple[int, float]]:
        """``(rank, seconds)`` for each node with no new beat for ``timeout`` s."""
        now, out = time.monotonic(), []
        for rank, (last, since) in list(self._seen.items()):
            if self._news(rank, last):
                continue
            if now - since > self.timeout:
                out.append((rank, now - since))
        return out

    def _news(self, rank: int, last: int) -> bool:
        key = P.heartbeat_key(rank)
        if not self.store.check([key]):
            return False
        data = self.store.get(key)
        try:
            msg = P.decode(data, self._key, kinds=("beat",), to=P.MASTER_RANK, rank=rank,
                           token=self._handles[rank].token, after=last)
        except P.ProtocolError as err:
            if "replay" not in str(err) and "another session" not in str(err):  # an unchanged beat is no news
                self._drops.drop(f"node rank {rank}'s heartbeat key", P.claimed_sender(data), str(err))
            return False
        self._seen[rank] = (msg.n, time.monotonic())
        return True

    def add(self, rank: int) -> None:
        """Watch ``rank`` too, from now (a node configured after the others, or relaunched)."""
        self._seen[rank] = (0, time.monotonic())

    def forget(self, rank: int) -> None:
        self._seen.pop(rank, None)
