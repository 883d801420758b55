"""Liveness in both directions.

Every process (rank 0 and each node) bumps a counter in the store every ``PERIOD_S`` from a
thread with its own store connection (so a long blocking call on the main connection never
delays a beat).  Counters, not timestamps: hosts' clocks need not agree; the watcher times how
long a counter has not moved on its own clock.

- Rank 0 checks its nodes' counters while it waits (``Silence``): a node silent for
  ``heartbeat_timeout`` seconds has stopped answering.
- A node's beat thread watches rank 0: it ends the node when the store becomes unreachable
  (rank 0 died: its sockets close at once), when rank 0's counter stalls for
  ``RANK0_SILENCE_S``, or, for nodes rank 0 started itself, when that parent process is gone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rlcollect.distributed.protocol import MASTER_RANK, heartbeat_key

logger = logging.getLogger("rlcollect")

PERIOD_S = 0.5
#: A rank 0 that is alive but frozen this long (its store still answering) is given up on.
RANK0_SILENCE_S = 60.0
_PARENT_CHECK_S = 0.1


class Heartbeat:
    """Beat ``rank``'s counter from a daemon thread; for a node, watch rank 0 (and the parent
    process) and call ``on_lost(reason)`` from that thread when it is gone.

    Args:
        connect: returns a new store connection (called in the thread).
        rank: whose counter to bump.
        on_lost: called once with the reason when the watched side is gone (nodes only).
        parent_alive: for nodes rank 0 started itself: False once that process is gone.
    """

    def __init__(self, connect: Callable[[], Any], rank: int, on_lost: Callable[[str], None] | None = None,
                 parent_alive: Callable[[], bool] | None = None):
        self._connect, self.rank = connect, rank
        self._on_lost, self._parent_alive = on_lost, parent_alive
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rlcollect-heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            store = self._connect()
        except Exception as err:  # noqa: BLE001
            self._lost(f"cannot reach rank 0's store: {_first_line(err)}")
            return
        watched = heartbeat_key(MASTER_RANK) if self._on_lost is not None and self.rank != MASTER_RANK else None
        last_seen, last_change = None, time.monotonic()
        next_beat = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if self._parent_alive is not None and not self._parent_alive():
                    self._lost("the process that started this node is gone")
                    return
                if now >= next_beat:
                    next_beat = now + PERIOD_S
                    store.add(heartbeat_key(self.rank), 1)
                    if watched is not None:
                        seen = store.add(watched, 0)
                        if seen != last_seen:
                            last_seen, last_change = seen, now
                        elif now - last_change > RANK0_SILENCE_S:
                            self._lost(f"rank 0 has not beaten for {now - last_change:.0f} s")
                            return
                self._stop.wait(_PARENT_CHECK_S if self._parent_alive is not None else PERIOD_S)
        except Exception as err:  # noqa: BLE001  (the store is gone: rank 0 died or the network did)
            if not self._stop.is_set():
                self._lost(f"lost rank 0's store: {_first_line(err)}")
        finally:
            del store

    def _lost(self, reason: str) -> None:
        if self._on_lost is not None and not self._stop.is_set():
            self._on_lost(reason)


class Silence:
    """Rank 0's view of its nodes' heartbeats: how long each counter has not moved."""

    def __init__(self, store: Any, ranks: list[int], timeout: float):
        self.store, self.timeout = store, timeout
        now = time.monotonic()
        self._seen: dict[int, tuple[int, float]] = {rank: (-1, now) for rank in ranks}

    def silent(self) -> list[tuple[int, float]]:
        """``(rank, seconds)`` for each node whose counter has not moved for ``timeout`` s."""
        now, out = time.monotonic(), []
        for rank, (value, since) in self._seen.items():
            current = self.store.add(heartbeat_key(rank), 0)
            if current != value:
                self._seen[rank] = (current, now)
            elif now - since > self.timeout:
                out.append((rank, now - since))
        return out

    def add(self, rank: int) -> None:
        """Watch ``rank`` too, from now (a node configured after the others, or relaunched)."""
        self._seen[rank] = (-1, time.monotonic())

    def forget(self, rank: int) -> None:
        self._seen.pop(rank, None)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__
