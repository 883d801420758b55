"""Rank 0's supervision of its nodes: what it holds (store, heartbeat, launcher, control channel,
process group), the liveness check every wait runs, and the bounded release at shutdown.

The ``Supervisor`` holds no reference to the collector, so that garbage collection and
interpreter exit can release everything too.
"""

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any

from rlcollect.distributed import protocol as P
from rlcollect.distributed.channel import Channel
from rlcollect.distributed.heartbeat import Heartbeat, Silence
from rlcollect.distributed.launchers import Launcher
from rlcollect.multiprocess.protocol import WorkerError

#: How long a node whose connection broke may take to be reported dead by its launcher.
_DEATH_NOTICE_S = 1.0


def node_error(message: str, node: int, exitcode: int | None = None) -> WorkerError:
    """A ``WorkerError`` about node ``node`` (0-based), also as ``node_index``."""
    err = WorkerError(message, node, exitcode)
    err.node_index = node
    return err


class Supervisor:
    """Everything rank 0 must watch and release, for ``world_size - 1`` nodes."""

    def __init__(self, world_size: int, heartbeat_timeout: float):
        self.world_size, self.heartbeat_timeout = world_size, heartbeat_timeout
        self.store: Any = None
        self.heartbeat: Heartbeat | None = None
        self.launcher: Launcher | None = None
        self.channel: Channel | None = None
        self.pg: Any = None
        self.configured: set[int] = set()  # ranks sent their configuration
        self.failed: set[int] = set()  # ranks found dead or silent: not waited for at shutdown
        self.serving = False  # every node has joined the process group and serves commands
        self.weight_sends: list[collections.deque] = [collections.deque() for _ in range(world_size - 1)]
        self._silence: Silence | None = None

    def watch(self, rank: int) -> None:
        """Check node ``rank``'s heartbeat from now on."""
        self.configured.add(rank)
        self._silence = Silence(self.store, sorted(self.configured), self.heartbeat_timeout)

    # -- liveness --------------------------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise for a node whose process ended (its own error first, if it reported one) or
        that stopped beating."""
        for rank, cause in sorted(self.launcher.dead().items()):
            if rank in self.configured and self.store.check([P.started_key(rank)]):
                msg = P.decode(self.store.get(P.started_key(rank)), kinds=("started", "failed"), rank=rank)
                if msg.kind == "failed":
                    raise P.rebuild_error(msg["error"], rank - 1, "start-up")
            if self.channel is not None:
                self.channel.pump()
            self.failed.add(rank)
            process = getattr(self.launcher, "processes", {}).get(rank)
            raise node_error(f"node {rank - 1} {cause}", rank - 1, None if process is None else process.returncode)
        for rank, seconds in self._silence.silent() if self._silence is not None else ():
            self.failed.add(rank)
            raise node_error(f"node {rank - 1} stopped answering: no heartbeat for {seconds:.1f} s "
                             f"(heartbeat_timeout={self.heartbeat_timeout:g})", rank - 1)

    def lost(self, rank: int, what: str, err: BaseException) -> WorkerError:
        """The error for node ``rank``'s broken connection during ``what``: its launcher's
        account of its death when there is one (a killed process's sockets close a moment
        before it is reported dead), else the connection error."""
        self.channel.pump()
        deadline = time.monotonic() + _DEATH_NOTICE_S
        while time.monotonic() < deadline and rank not in self.launcher.dead():
            time.sleep(0.02)
        self.check_alive()
        self.failed.add(rank)
        return node_error(f"node {rank - 1} lost its connection {what}: {str(err).splitlines()[0]}", rank - 1)

    # -- shutdown ---------------------------------------------------------------------------------------
    def release(self, timeout: float = 10.0) -> None:
        """Close every node, stop those rank 0 started, free the store and the process group."""
        store, channel = self.store, self.channel
        if store is not None and channel is not None:
            reject = P.encode("reject", P.MASTER_RANK, reason="rank 0 is shutting down")
            for rank in range(1, self.world_size):
                with contextlib.suppress(Exception):
                    if rank in self.configured:
                        channel.command(rank, "close")
                    else:
                        store.set(P.config_key(rank), reject)
        launcher = self.launcher
        if launcher is not None:
            if store is not None and not launcher.owns_processes and self.serving:
                _wait_byes(store, self.configured - self.failed, 0.6 * timeout)
            # Nodes still starting cannot read "close" (they may be blocked joining the process
            # group): stop them at once rather than wait for them.
            starting = set() if self.serving else set(range(1, self.world_size))
            with contextlib.suppress(Exception):
                launcher.stop(timeout, self.failed | starting)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.weight_sends = []
        if self.pg is not None:
            with contextlib.suppress(Exception):
                self.pg.shutdown()
        if channel is not None:
            with contextlib.suppress(Exception):
                channel.close()
            channel.store = None  # a traceback that holds the channel must not hold the store
        self.pg = self.channel = self.store = self.heartbeat = self.launcher = self._silence = None


def _wait_byes(store: Any, ranks: set[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = set(ranks)
    with contextlib.suppress(Exception):
        while waiting and time.monotonic() < deadline:
            waiting = {r for r in waiting if not store.check([P.bye_key(r)])}
            time.sleep(0.05)
