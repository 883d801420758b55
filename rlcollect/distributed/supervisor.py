"""Rank 0's supervision of its nodes: what it holds (store, heartbeat, launcher, control channel,
one pair process group per node), the liveness check every wait runs, the relaunch and rejoin of
a failed node (``on_node_failure="restart"``), and the bounded release at shutdown.

The ``Supervisor`` holds no reference to the collector, so that garbage collection and
interpreter exit can release everything too.

A node's failure is raised as an exception marked with ``failed_node`` (see
``protocol.mark_failed``): the collector decides, by its ``on_node_failure``, whether to raise it
or to ``drop`` the node (and ``relaunch`` it).  A relaunched node goes through the same handshake
as at start-up (hello, configuration, started, joining a new pair group), advanced by the
liveness check while rank 0 keeps serving the other nodes; once joined it waits in ``joined``
until the collector admits it.
"""

from __future__ import annotations

import collections
import contextlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

from rlcollect.distributed import protocol as P
from rlcollect.distributed import transport
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


@dataclass
class _Joining:
    """A relaunched node on its way back: its configuration and how far its handshake got."""

    payload: bytes
    deadline: float
    configured: bool = False


class Supervisor:
    """Everything rank 0 must watch and release, for ``world_size - 1`` nodes.

    ``address`` is rank 0's numeric address (pair groups bind to it); ``timeout`` bounds the
    start-up (and rejoin) of a node and every transfer set-up."""

    def __init__(self, world_size: int, heartbeat_timeout: float, timeout: float):
        self.world_size, self.heartbeat_timeout, self.timeout = world_size, heartbeat_timeout, timeout
        self.address = ""
        self.store: Any = None
        self.heartbeat: Heartbeat | None = None
        self.launcher: Launcher | None = None
        self.channel: Channel | None = None
        ranks = range(1, world_size)
        self.pgs: dict[int, Any] = {}  # rank -> its pair group with rank 0
        self.tokens: dict[int, str] = {rank: secrets.token_hex(8) for rank in ranks}  # per incarnation
        self.incarnations: dict[int, int] = {rank: 0 for rank in ranks}
        self.configured: set[int] = set()  # ranks sent their configuration (this incarnation)
        self.failed: set[int] = set()  # ranks found dead or silent: not waited for at shutdown
        self.dropped: set[int] = set()  # ranks given up for good ("continue"): no longer watched
        self.joining: dict[int, _Joining] = {}
        self.joined: list[tuple[int, dict]] = []  # rejoined ranks and their "started" info, to admit
        self.serving = False  # every node has joined its pair group and serves commands
        self.weight_sends: list[collections.deque] = [collections.deque() for _ in ranks]
        self._silence: Silence | None = None

    # -- the handshake ---------------------------------------------------------------------------
    def answer_hello(self, rank: int, data: bytes, payload: bytes) -> None:
        """Send node ``rank`` (which said ``data``) its configuration ``payload``; from now on
        its heartbeat is watched.  A node started for another world size is refused."""
        try:
            msg = P.decode(data, kinds=("hello",), rank=rank)
        except P.ProtocolError as err:
            raise P.ProtocolError(f"node rank {rank}'s hello: {err}") from None
        if msg["world_size"] != self.world_size:
            reason = (f"started with --world-size {msg['world_size']}, but this collector has {self.world_size} "
                      f"(num_nodes={self.world_size - 1} + 1)")
            self.store.set(P.config_key(rank), P.encode("reject", P.MASTER_RANK, reason=reason))
            raise ValueError(f"node rank {rank} (host {msg['host']}, pid {msg['pid']}) was {reason}")
        self.store.set(P.config_key(rank), P.encode("config", P.MASTER_RANK, self.tokens[rank], payload,
                                                    node_index=rank - 1, incarnation=self.incarnations[rank]))
        self.configured.add(rank)
        if self._silence is None:
            self._silence = Silence(self.store, [rank], self.heartbeat_timeout)
        else:
            self._silence.add(rank)

    def read_started(self, rank: int, data: bytes) -> dict:
        """What node ``rank`` reported once built: ``{"layout", "weights", "pid", "host"}``; its
        start-up error is re-raised (never recovered: a replacement would fail alike)."""
        msg = P.decode(data, kinds=("started", "failed"), rank=rank, token=self.tokens[rank])
        if msg.kind == "failed":
            raise P.rebuild_error(msg["error"], rank - 1, "start-up")
        weights = None if msg["weights"] is None else P.weights_from_json(msg["weights"])
        return {"layout": P.layout_from_json(msg["layout"]), "weights": weights, "pid": msg["pid"], "host": msg["host"]}

    def connect_pairs(self, ranks: list[int]) -> None:
        """Build rank 0's side of the pair groups of ``ranks`` (whose nodes have started) and
        connect them (the nodes connect theirs right after reporting "started")."""
        groups = {rank: transport.pair_group(self.store, rank, self.incarnations[rank], True, self.address,
                                             self.timeout) for rank in ranks}
        self.pgs.update(groups)
        transport.join(list(groups.values()), True, self.timeout)

    # -- liveness --------------------------------------------------------------------------------------
    def check_alive(self) -> None:
        """Raise for a node whose process ended (its own error first, if it reported one) or
        that stopped beating; advance the handshake of relaunched nodes."""
        for rank, cause in sorted(self.launcher.dead().items()):
            if rank in self.dropped:
                continue
            if rank in self.configured and self.store.check([P.started_key(rank)]):
                msg = P.decode(self.store.get(P.started_key(rank)), kinds=("started", "failed"), rank=rank)
                if msg.kind == "failed":
                    raise P.rebuild_error(msg["error"], rank - 1, "start-up")
            if self.channel is not None:
                self.channel.pump()
            self.failed.add(rank)
            process = getattr(self.launcher, "processes", {}).get(rank)
            raise P.mark_failed(node_error(f"node {rank - 1} {cause}", rank - 1,
                                           None if process is None else process.returncode), rank - 1)
        for rank, seconds in self._silence.silent() if self._silence is not None else ():
            self.failed.add(rank)
            raise P.mark_failed(node_error(f"node {rank - 1} stopped answering: no heartbeat for {seconds:.1f} s "
                                           f"(heartbeat_timeout={self.heartbeat_timeout:g})", rank - 1), rank - 1)
        if self.joining:
            self._advance_joins()

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
        return P.mark_failed(node_error(f"node {rank - 1} lost its connection {what}: {str(err).splitlines()[0]}",
                                        rank - 1), rank - 1)

    # -- failure and relaunch -----------------------------------------------------------------------
    def drop(self, rank: int, for_good: bool) -> None:
        """Stop node ``rank`` (killed when the launcher owns it, else told to close) and forget
        its messages, its pair group and its weight sends; ``for_good``: never watch it again."""
        with contextlib.suppress(Exception):
            if not self.launcher.owns_processes and rank in self.configured:
                self.channel.command(rank, "close")  # an external node that still listens leaves
        self.launcher.kill(rank)
        if self.channel is not None:
            self.channel.retired.add(self.tokens[rank])
        self.tokens[rank] = secrets.token_hex(8)  # whatever it still sends is stale now
        pg = self.pgs.pop(rank, None)
        if pg is not None:
            transport.close_group(pg)
        self.weight_sends[rank - 1].clear()
        self.configured.discard(rank)
        self.joining.pop(rank, None)
        self.joined = [(r, info) for r, info in self.joined if r != rank]
        if self._silence is not None:
            self._silence.forget(rank)
        if self.channel is not None:
            self.channel.forget(rank)
        if for_good:
            self.dropped.add(rank)

    def relaunch(self, rank: int, payload: bytes) -> None:
        """Start node ``rank`` again (after ``drop``) as its next incarnation, configured with
        ``payload``; it rejoins through ``check_alive`` within ``timeout`` seconds."""
        store = self.store
        for key in P.incarnation_keys(rank):
            store.delete_key(key)
        queue = P.command_queue(rank)
        for _ in range(store.queue_len(queue)):  # commands the failed incarnation never read
            store.queue_pop(queue, False)
        self.incarnations[rank] += 1
        self.failed.discard(rank)
        self.launcher.relaunch(rank)
        self.joining[rank] = _Joining(payload, time.monotonic() + self.timeout)

    def _advance_joins(self) -> None:
        store = self.store
        for rank, join in list(self.joining.items()):
            if not join.configured:
                if store.check([P.hello_key(rank)]):
                    self.answer_hello(rank, store.get(P.hello_key(rank)), join.payload)
                    join.configured = True
            elif store.check([P.started_key(rank)]):
                info = self.read_started(rank, store.get(P.started_key(rank)))
                try:
                    self.connect_pairs([rank])
                except RuntimeError as err:
                    raise self.lost(rank, "while rejoining", err) from None
                del self.joining[rank]
                self.joined.append((rank, info))
                continue
            if time.monotonic() > join.deadline:
                self.failed.add(rank)
                raise P.mark_failed(node_error(
                    f"node {rank - 1} was relaunched but did not rejoin within timeout={self.timeout:g} s "
                    f"({'configured' if join.configured else 'no hello yet'})", rank - 1), rank - 1)

    # -- shutdown ---------------------------------------------------------------------------------------
    def release(self, timeout: float = 10.0) -> None:
        """Close every node, stop those rank 0 started, free the store and the process groups."""
        store, channel = self.store, self.channel
        if store is not None and channel is not None:
            reject = P.encode("reject", P.MASTER_RANK, reason="rank 0 is shutting down")
            for rank in range(1, self.world_size):
                if rank in self.dropped:
                    continue
                with contextlib.suppress(Exception):
                    if rank in self.configured:
                        channel.command(rank, "close")
                    else:
                        store.set(P.config_key(rank), reject)
        launcher = self.launcher
        if launcher is not None:
            if store is not None and not launcher.owns_processes and self.serving:
                _wait_byes(store, self.configured - self.failed - set(self.joining), 0.6 * timeout)
            # Nodes still starting cannot read "close" (they may be blocked joining the process
            # group): stop them at once rather than wait for them.
            starting = set(self.joining) if self.serving else set(range(1, self.world_size))
            with contextlib.suppress(Exception):
                launcher.stop(timeout, self.failed | starting)
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.weight_sends = []
        for pg in self.pgs.values():
            transport.close_group(pg)
        self.pgs = {}
        if channel is not None:
            with contextlib.suppress(Exception):
                channel.close()
            channel.store = None  # a traceback that holds the channel must not hold the store
        self.channel = self.store = self.heartbeat = self.launcher = self._silence = None


def _wait_byes(store: Any, ranks: set[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    waiting = set(ranks)
    with contextlib.suppress(Exception):
        while waiting and time.monotonic() < deadline:
            waiting = {r for r in waiting if not store.check([P.bye_key(r)])}
            time.sleep(0.05)
