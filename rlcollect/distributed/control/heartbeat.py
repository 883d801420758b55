"""Liveness in both directions.

Every process sends a signed beat (``encode("beat")``: its session token and a growing
counter) every ``PERIOD_S`` from a thread of its own, on its channel (``wire.py``): rank 0 to
each node, each node to rank 0.  Counters, not timestamps: hosts' clocks need not agree; the
receiver times how long it has seen no *new* authentic beat on its own clock.  A beat is sent
only when that cannot wait (``Wire.try_send``): never while a large message is on its way (the
transfer shows life by itself), never into a peer that stopped reading.

- Rank 0 watches its nodes (``Silence``): a node silent for ``heartbeat_timeout`` seconds has
  failed, unless its watcher (``watcher.py``: a tiny process beside the node that reports the
  node process's state from ``/proc``) still reports it running or sleeping: then the node is
  busy (an env step holding the GIL, say), not frozen.  A node whose watcher reports it stopped
  (SIGSTOP: state ``T``) or gone has failed; so has a node whose watcher is silent too.
- A node watches rank 0 (``NodeWatch``): it ends when rank 0's channel closes (rank 0 died: its
  sockets close at once), when rank 0 has not beaten for ``rank0_timeout`` seconds (a frozen or
  unreachable rank 0; a watchdog thread times it), or, for nodes rank 0 started itself, when
  that parent process is gone.  Rank 0 beats on a node's connection from the moment its hello
  verified, while the node waits for its answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from rlcollect.distributed.control import protocol as P

logger = logging.getLogger("rlcollect")

PERIOD_S = 0.5
_WATCHDOG_S = 0.1


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


class _Beater:
    """A daemon thread that calls ``beat()`` every ``PERIOD_S``."""

    def __init__(self, rank: int):
        self.rank = rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rlcollect-heartbeat-{rank}", daemon=True)

    def start(self):
        self._thread.start()
        return self

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def beat(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except Exception as err:  # noqa: BLE001  (a beat never ends the thread)
                logger.warning("rlcollect rank %d: a heartbeat failed: %s", self.rank, _first_line(err))
            self._stop.wait(PERIOD_S)


class Rank0Beat(_Beater):
    """Rank 0's beat: ``beat_channels()`` (on every node's channel, and to every node waiting
    for its answer)."""

    def __init__(self, beat_channels: Callable[[], None]):
        super().__init__(P.MASTER_RANK)
        self.beat = beat_channels


class NodeWatch(_Beater):
    """A node's beat, and its watch on rank 0 (started once rank 0's port answered).

    Args:
        rank: this node's rank.
        rank0_timeout: seconds without an authentic message of rank 0 before ``on_lost``.
        on_lost: called once, from a watcher thread, with the reason rank 0 is gone.
        parent_alive: for nodes rank 0 started itself: False once that process is gone.
    """

    def __init__(self, rank: int, rank0_timeout: float, on_lost: Callable[[str], None],
                 parent_alive: Callable[[], bool] | None = None):
        super().__init__(rank)
        self.rank0_timeout = rank0_timeout
        self._on_lost, self._parent_alive = on_lost, parent_alive
        self._last_news = time.monotonic()
        self.heard = False  # an authentic word of rank 0 came
        self._endpoint: Any = None
        self._lost_once = threading.Lock()
        self._watchdog = threading.Thread(target=self._watch, name=f"rlcollect-watchdog-{rank}", daemon=True)

    def start(self) -> NodeWatch:
        self._last_news = time.monotonic()
        super().start()
        self._watchdog.start()
        return self

    def attach(self, endpoint: Any) -> None:
        """From now on beat on ``endpoint`` (this node's channel, once configured)."""
        self._endpoint = endpoint

    def news(self) -> None:
        """An authentic message of rank 0 came."""
        self._last_news = time.monotonic()
        self.heard = True

    def beat(self) -> None:
        if self._endpoint is not None:
            self._endpoint.try_send("beat")

    def _watch(self) -> None:
        while not self._stop.wait(_WATCHDOG_S):
            if self._parent_alive is not None and not self._parent_alive():
                self._lost("the process that started this node (rank 0) is gone")
                return
            silent = time.monotonic() - self._last_news
            if silent > self.rank0_timeout:
                what = "has not beaten" if self.heard else "has not shown an authentic heartbeat"
                self._lost(f"rank 0 {what} for {silent:.0f} s (rank0_timeout={self.rank0_timeout:g}): it is frozen, "
                           "unreachable, or runs with another secret")
                return

    def lost(self, reason: str) -> None:
        """Rank 0 is gone (its channel closed): ``on_lost``, once."""
        self._lost(reason)

    def _lost(self, reason: str) -> None:
        if not self._stop.is_set() and self._lost_once.acquire(blocking=False):
            self._on_lost(reason)


#: A watcher's report of its node process (a ``/proc`` state letter) that means "busy, alive".
BUSY_STATES = frozenset("RSDIW")


class Silence:
    """Rank 0's view of its nodes' beats: how long each has shown no new authentic beat, and
    what its watcher says about it.

    ``handles`` is the pool's ``{rank: NodeHandle}``; the channel's readers stamp each
    handle's ``last_beat`` and ``watch`` (``(state, when)``) as beats and reports arrive."""

    def __init__(self, handles: dict[int, Any], timeout: float):
        self.timeout, self._handles = timeout, handles
        self._watched: set[int] = set()
        self._busy_logged: set[tuple[int, str]] = set()

    def silent(self) -> list[tuple[int, float, str]]:
        """``(rank, seconds, why)`` for each node with no new beat for ``timeout`` s that its
        watcher does not vouch for (running or sleeping, reported within ``timeout`` s)."""
        now, out = time.monotonic(), []
        for rank in sorted(self._watched):
            h = self._handles[rank]
            quiet = now - h.last_beat
            if quiet <= self.timeout:
                continue
            watch = h.watch
            fresh = watch is not None and now - watch[1] <= self.timeout
            if fresh and watch[0] in BUSY_STATES:
                if (rank, h.token) not in self._busy_logged:
                    self._busy_logged.add((rank, h.token))
                    logger.warning("rlcollect: node %d has not beaten for %.1f s but its process is busy (state %s): "
                                   "not counted as frozen (a long env step holding the GIL?)", rank - 1, quiet,
                                   watch[0])
                continue
            if watch is None:
                why = "no watcher report"
            elif not fresh:
                why = f"its watcher is silent too (last report {now - watch[1]:.1f} s ago)"
            else:
                why = f"its process is {describe_state(watch[0])}"
            out.append((rank, quiet, why))
        return out

    def add(self, rank: int) -> None:
        """Watch ``rank`` too, from now (a node attached after the others, or relaunched)."""
        self._handles[rank].last_beat = time.monotonic()
        self._watched.add(rank)

    def forget(self, rank: int) -> None:
        self._watched.discard(rank)


def describe_state(state: str) -> str:
    """A ``/proc`` state letter (or a watcher's word) in words."""
    words = {"T": "stopped (SIGSTOP or a debugger: state T)", "t": "stopped by a debugger (state t)",
             "Z": "dead (a zombie)", "X": "dead", "gone": "gone (it exited or was killed)"}
    return words.get(state, f"in state {state}")
