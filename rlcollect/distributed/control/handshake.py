"""Rank 0's side of a node's handshake: its hello (authenticated, for this run, a session never
seen) read from the store, rank 0's answer there (where to attach its channel, or a refusal),
then, on the channel, its spec (sent by ``NodePool`` when it attaches) and the "started" report
the node sends once its collector is built.  The same handshake runs at start-up and when a relaunched
node rejoins; ``NodePool`` drives it.

Nothing a node writes is used before it verifies (``protocol.decode``: MAC, run, session,
counter); what does not is dropped and logged once (``auth.DropLog``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from rlcollect.distributed.control import protocol as P
from rlcollect.distributed.control.auth import DropLog, Keys

if TYPE_CHECKING:  # a type hint only: control/ imports none of the collector's parts
    from rlcollect.distributed.nodes import NodeHandle

logger = logging.getLogger("rlcollect")

#: How long rank 0 waits for a node it refused to read the refusal, before raising.
_REFUSAL_READ_S = 2.0


class Handshake:
    """Hello -> configuration -> started, for the nodes of one run.

    Args:
        store: rank 0's store.
        keys: the run's keys; ``run``: its nonce (a hello for another run is a replay).
        world_size: rank 0 plus the nodes (a node started for another is refused).
        channel: rank 0's ``Channel`` (its port is in the answer; the reports come on it).
    """

    def __init__(self, store: Any, keys: Keys, run: str, world_size: int, channel: Any):
        self.store, self.keys, self.run, self.world_size = store, keys, run, world_size
        self.channel = channel
        self.drops = DropLog("rlcollect")
        self.seen_tokens: set[str] = set()  # every session ever configured or refused: a replayed hello is stale
        self.turned_away: list[str] = []  # authentic hellos refused (a second node for a taken rank)
        self._hello_seen: dict[int, bytes] = {}

    def poll_hello(self, node: NodeHandle, payload: bytes | None) -> bool:
        """Read ``node``'s hello key; answer a new authentic hello (with ``payload``, the node's
        configuration, when the rank is free; with a refusal when it is taken).  What does not
        verify is dropped and logged once.  True once the node is configured."""
        rank = node.rank
        key = P.hello_key(rank)
        if not self.store.check([key]):
            return node.configured
        data = self.store.get(key)
        if data == self._hello_seen.get(rank):
            return node.configured
        self._hello_seen[rank] = data
        try:
            msg = P.decode(data, self.keys.to_rank0, kinds=("hello",), to=P.MASTER_RANK, rank=rank)
            if msg["run"] != self.run:
                raise P.ProtocolError("it is for another run (a replay, or a node of an earlier collector)")
            if len(msg.token) < 16:
                raise P.ProtocolError("its session token is too short")
        except P.ProtocolError as err:
            self.drops.drop(f"node rank {rank}'s hello key", P.claimed_sender(data), str(err))
            return node.configured
        if msg.token in self.seen_tokens:
            return node.configured  # a node saying its hello again, or a replay: answered already
        self.seen_tokens.add(msg.token)
        if node.configured or payload is None:
            reason = f"rank {rank} is already taken by another node of this collector"
            self._refuse(rank, msg, reason)
            self.turned_away.append(f"pid {msg['pid']} on {msg['host']}")
            logger.error("rlcollect: refused a second node for rank %d (pid %s on %s): %s", rank, msg["pid"],
                         msg["host"], reason)
            return node.configured
        self._answer(node, msg, payload)
        return True

    def _refuse(self, rank: int, msg: P.Message, reason: str) -> None:
        self.store.set(P.config_key(rank, msg.token), P.encode("reject", P.MASTER_RANK, self.keys.to_node, msg.token, 0,
                                                               to=rank, reason=reason))

    def _answer(self, node: NodeHandle, msg: P.Message, payload: bytes) -> None:
        """Answer ``node`` (which said ``msg``): where to attach; its configuration ``payload``
        is sent on the channel once it attached.  A node started for another world size is
        refused."""
        rank = node.rank
        if msg["world_size"] != self.world_size:
            reason = (f"started with --world-size {msg['world_size']}, but this collector has {self.world_size} "
                      f"(num_nodes={self.world_size - 1} + 1)")
            self._refuse(rank, msg, reason)
            # Rank 0 raises and goes away: give the node a moment to read why (its exit code 4).
            deadline = time.monotonic() + _REFUSAL_READ_S
            while time.monotonic() < deadline and not self.store.check([P.refused_key(rank, msg.token)]):
                time.sleep(0.02)
            raise ValueError(f"node rank {rank} (host {msg['host']}, pid {msg['pid']}) was {reason}")
        node.token, node.sent, node.received, node.setup = msg.token, 0, 0, payload
        self.store.set(P.config_key(rank, msg.token), P.encode(
            "config", P.MASTER_RANK, self.keys.to_node, msg.token, 0, to=rank, node_index=node.index,
            incarnation=node.incarnation, port=self.channel.port))
        node.configured = True

    def poll_started(self, node: NodeHandle) -> dict | None:
        """What configured ``node`` reported once built (``{"layout", "weights", "pid",
        "host"}``), or None while it has not; its start-up error is re-raised (never recovered:
        a replacement would fail alike)."""
        msg = self.started_message(node)
        if msg is None:
            return None
        if msg.kind == "failed":
            raise P.rebuild_error(msg["error"], node.index, "start-up")
        weights = None if msg["weights"] is None else P.weights_from_json(msg["weights"])
        return {"layout": P.layout_from_json(msg["layout"]), "weights": weights, "pid": msg["pid"], "host": msg["host"]}

    def started_message(self, node: NodeHandle) -> P.Message | None:
        """``node``'s authentic "started" (or "failed") report of this session, if it came."""
        return self.channel.started.get(node.rank) if node.configured else None

    def forget(self, rank: int) -> None:
        """A new incarnation of ``rank``: what its keys held before is news again."""
        self._hello_seen.pop(rank, None)

    def said_bye(self, node: NodeHandle) -> bool:
        """Whether ``node``'s session said goodbye on its channel (at shutdown)."""
        return node.rank in self.channel.byes
