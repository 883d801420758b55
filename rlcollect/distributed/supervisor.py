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
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any

from rlcollect.distributed import protocol as P
from rlcollect.distributed import transport
from rlcollect.distributed.channel import Channel
from rlcollect.distributed.auth import DropLog, Keys, remove_secret_file
from rlcollect.distributed.heartbeat import Silence
from rlcollect.distributed.launchers import Launcher
from rlcollect.multiprocess.protocol import WorkerError

logger = logging.getLogger("rlcollect")

#: How long a node whose connection broke may take to be reported dead by its launcher.
_DEATH_NOTICE_S = 1.0
#: How long rank 0 waits for a node it refused to read the refusal, before raising.
_REFUSAL_READ_S = 2.0
#: How often rank 0 looks for a second node claiming a taken rank, once serving.
_HELLO_POLL_S = 0.5


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

    ``address`` is rank 0's numeric address (pair groups bind to it); ``timeout`` bounds every
    transfer set-up, ``start_timeout`` the start-up (and rejoin) of a node; ``keys`` and ``run``
    are the run's keys and nonce (``auth.py``)."""

    def __init__(self, world_size: int, heartbeat_timeout: float, timeout: float, keys: Keys, run: str,
                 start_timeout: float | None = None):
        self.world_size, self.heartbeat_timeout, self.timeout = world_size, heartbeat_timeout, timeout
        self.start_timeout = timeout if start_timeout is None else start_timeout
        self.keys, self.run = keys, run
        self.address = ""
        self.store: Any = None
        self.heartbeat: Any = None
        self.launcher: Launcher | None = None
        self.channel: Channel | None = None
        ranks = range(1, world_size)
        self.pgs: dict[int, Any] = {}  # rank -> its pair group with rank 0
        # Each node's current session token ("": none yet), from its authenticated hello, and
        # the counters of the last message sent to / taken from that session.
        self.tokens: dict[int, str] = {rank: "" for rank in ranks}
        self.sent: dict[int, int] = {rank: 0 for rank in ranks}
        self.received: dict[int, int] = {rank: 0 for rank in ranks}
        self.seen_tokens: set[str] = set()  # every session ever configured or refused: a replayed hello is stale
        self.drops = DropLog("rlcollect")
        self.turned_away: list[str] = []  # authentic hellos refused (a second node for a taken rank)
        self._hello_seen: dict[int, bytes] = {}
        self._started_seen: dict[int, bytes] = {}
        self._next_hello_poll = 0.0
        self.incarnations: dict[int, int] = {rank: 0 for rank in ranks}
        self.configured: set[int] = set()  # ranks sent their configuration (this incarnation)
        self.failed: set[int] = set()  # ranks found dead or silent: not waited for at shutdown
        self.dropped: set[int] = set()  # ranks given up for good ("continue"): no longer watched
        self.joining: dict[int, _Joining] = {}
        self.joined: list[tuple[int, dict]] = []  # rejoined ranks and their "started" info, to admit
        self.serving = False  # every node has joined its pair group and serves commands
        self.weight_sends: list[collections.deque] = [collections.deque() for _ in ranks]
        self._silence: Silence | None = None
        self.secret = b""
        self.own_secret_file: Any = None  # a secret file rank 0 wrote for external nodes: removed at release

    # -- the handshake ---------------------------------------------------------------------------
    def poll_hello(self, rank: int, payload: bytes | None) -> bool:
        """Read node ``rank``'s hello key; answer a new authentic hello (with ``payload``, the
        node's configuration, when the rank is free; with a refusal when it is taken).  What
        does not verify is dropped and logged once.  True once the rank is configured."""
        key = P.hello_key(rank)
        if not self.store.check([key]):
            return rank in self.configured
        data = self.store.get(key)
        if data == self._hello_seen.get(rank):
            return rank in self.configured
        self._hello_seen[rank] = data
        try:
            msg = P.decode(data, self.keys.to_rank0, kinds=("hello",), to=P.MASTER_RANK, rank=rank)
            if msg["run"] != self.run:
                raise P.ProtocolError("it is for another run (a replay, or a node of an earlier collector)")
            if len(msg.token) < 16:
                raise P.ProtocolError("its session token is too short")
        except P.ProtocolError as err:
            self.drops.drop(f"node rank {rank}'s hello key", P.claimed_sender(data), str(err))
            return rank in self.configured
        if msg.token in self.seen_tokens:
            return rank in self.configured  # a node saying its hello again, or a replay: answered already
        self.seen_tokens.add(msg.token)
        if rank in self.configured or payload is None:
            reason = f"rank {rank} is already taken by another node of this collector"
            self._refuse(rank, msg, reason)
            self.turned_away.append(f"pid {msg['pid']} on {msg['host']}")
            logger.error("rlcollect: refused a second node for rank %d (pid %s on %s): %s", rank, msg["pid"],
                         msg["host"], reason)
            return rank in self.configured
        self.answer_hello(rank, msg, payload)
        return True

    def _refuse(self, rank: int, msg: P.Message, reason: str) -> None:
        self.store.set(P.config_key(rank, msg.token), P.encode("reject", P.MASTER_RANK, self.keys.to_node, msg.token, 0,
                                                               to=rank, reason=reason))

    def answer_hello(self, rank: int, msg: P.Message, payload: bytes) -> None:
        """Send node ``rank`` (which said ``msg``) its configuration ``payload``; from now on
        its heartbeat is watched.  A node started for another world size is refused."""
        if msg["world_size"] != self.world_size:
            reason = (f"started with --world-size {msg['world_size']}, but this collector has {self.world_size} "
                      f"(num_nodes={self.world_size - 1} + 1)")
            self._refuse(rank, msg, reason)
            # Rank 0 raises and goes away: give the node a moment to read why (its exit code 4).
            deadline = time.monotonic() + _REFUSAL_READ_S
            while time.monotonic() < deadline and not self.store.check([P.refused_key(rank, msg.token)]):
                time.sleep(0.02)
            raise ValueError(f"node rank {rank} (host {msg['host']}, pid {msg['pid']}) was {reason}")
        self.tokens[rank], self.sent[rank], self.received[rank] = msg.token, 0, 0
        self.store.set(P.config_key(rank, msg.token), P.encode(
            "config", P.MASTER_RANK, self.keys.to_node, msg.token, 0, payload, to=rank, node_index=rank - 1,
            incarnation=self.incarnations[rank]))
        self.configured.add(rank)
        if self._silence is None:
            self._silence = Silence(self.store, self.keys, self.tokens, self.heartbeat_timeout)
        self._silence.add(rank)

    def poll_started(self, rank: int) -> dict | None:
        """What configured node ``rank`` reported once built (``{"layout", "weights", "pid",
        "host"}``), or None while it has not; its start-up error is re-raised (never recovered:
        a replacement would fail alike)."""
        msg = self._started_message(rank)
        if msg is None:
            return None
        if msg.kind == "failed":
            raise P.rebuild_error(msg["error"], rank - 1, "start-up")
        self.received[rank] = msg.n
        weights = None if msg["weights"] is None else P.weights_from_json(msg["weights"])
        return {"layout": P.layout_from_json(msg["layout"]), "weights": weights, "pid": msg["pid"], "host": msg["host"]}

    def _started_message(self, rank: int) -> P.Message | None:
        key = P.started_key(rank)
        if rank not in self.configured or not self.store.check([key]):
            return None
        data = self.store.get(key)
        try:
            msg = P.decode(data, self.keys.to_rank0, kinds=("started", "failed"), to=P.MASTER_RANK, rank=rank,
                           token=self.tokens[rank], after=0)
            if msg.n != 1:
                raise P.ProtocolError(f"a {msg.kind!r} message with counter {msg.n} is not a start-up report (a replay)")
        except P.ProtocolError as err:
            if self._started_seen.get(rank) != data:
                self._started_seen[rank] = data
                self.drops.drop(f"node rank {rank}'s started key", P.claimed_sender(data), str(err))
            return None
        return msg

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
            msg = self._started_message(rank)
            if msg is not None and msg.kind == "failed":
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
        if self.serving and time.monotonic() >= self._next_hello_poll:
            # A second node started for a taken rank is told so (it would wait in vain).
            self._next_hello_poll = time.monotonic() + _HELLO_POLL_S
            for rank in range(1, self.world_size):
                if rank in self.configured and rank not in self.dropped:
                    self.poll_hello(rank, None)

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
        with contextlib.suppress(Exception):
            self.store.delete_key(P.config_key(rank, self.tokens[rank]))
        self.tokens[rank] = ""  # whatever it still sends is stale now
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
        self._hello_seen.pop(rank, None)
        self._started_seen.pop(rank, None)
        self.joining[rank] = _Joining(payload, time.monotonic() + self.start_timeout)

    def _advance_joins(self) -> None:
        store = self.store
        for rank, join in list(self.joining.items()):
            if not join.configured:
                join.configured = self.poll_hello(rank, join.payload)
            elif (info := self.poll_started(rank)) is not None:
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
                    f"node {rank - 1} was relaunched but did not rejoin within start_timeout={self.start_timeout:g} s "
                    f"({'configured' if join.configured else 'no hello yet'})", rank - 1), rank - 1)

    # -- shutdown ---------------------------------------------------------------------------------------
    def _said_bye(self, rank: int) -> bool:
        key = P.bye_key(rank)
        if not self.store.check([key]):
            return False
        try:
            P.decode(self.store.get(key), self.keys.to_rank0, kinds=("bye",), to=P.MASTER_RANK, rank=rank,
                     token=self.tokens[rank])
        except P.ProtocolError:
            return False  # not this node's goodbye: a foreign write, no news
        return True

    def _wait_byes(self, ranks: set[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        waiting = set(ranks)
        with contextlib.suppress(Exception):
            while waiting and time.monotonic() < deadline:
                waiting = {r for r in waiting if not self._said_bye(r)}
                time.sleep(0.05)

    def release(self, timeout: float | None = None) -> None:
        """Close every node, stop those rank 0 started, free the store and the process groups.
        ``timeout`` (None: 10 s, or 1 s when the interpreter exits after a Ctrl-C) bounds it."""
        if timeout is None:
            interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
            timeout = 1.0 if interrupted else 10.0
        store, channel = self.store, self.channel
        if store is not None and channel is not None:
            # Nodes not configured yet need no word: they end when the store goes away.
            for rank in sorted(self.configured - self.dropped):
                with contextlib.suppress(Exception):
                    channel.command(rank, "close")
        launcher = self.launcher
        if launcher is not None:
            if store is not None and not launcher.owns_processes and self.serving:
                self._wait_byes(self.configured - self.failed - set(self.joining), 0.6 * timeout)
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
        remove_secret_file(self.own_secret_file, folder_too=True)
        self.own_secret_file = None
