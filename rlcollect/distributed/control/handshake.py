"""Rank 0's side of a node's handshake: its hello (the first message on its connection to rank
0's listener: authentic, for this run, repeating the connection's challenge, a session never
seen), rank 0's answer on that connection (its configuration, or a refusal), then its spec
(sent by ``NodePool`` once it is configured) and the "started" report the node sends once its
collector is built.  The same handshake runs at start-up and when a relaunched node rejoins;
``NodePool`` drives it.

Nothing a node sends is used before it verifies (``protocol.decode``: MAC, run, challenge,
session, counter: in the listener's thread, see ``channel.py``); what does not is dropped and
logged once (``auth.DropLog``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from rlcollect.distributed.control import protocol as P
from rlcollect.distributed.control.auth import DropLog, Keys

if TYPE_CHECKING:  # a type hint only: control/ imports none of the collector's parts
    from rlcollect.distributed.nodes import NodeHandle

logger = logging.getLogger("rlcollect")


class Handshake:
    """Hello -> configuration -> started, for the nodes of one run.

    Args:
        keys: the run's keys; ``run``: its nonce (a hello for another run is a replay).
        world_size: rank 0 plus the nodes (a node started for another is refused).
        channel: rank 0's ``Channel`` (the hellos come on it, the answers go back on it).
    """

    def __init__(self, keys: Keys, run: str, world_size: int, channel: Any):
        self.keys, self.run, self.world_size = keys, run, world_size
        self.channel = channel
        self.drops = channel.drops if channel is not None else DropLog("rlcollect")
        self.seen_tokens: set[str] = set()  # every session ever configured or refused: a replayed hello is stale
        self.turned_away: list[str] = []  # authentic hellos refused (a second node for a taken rank)

    def poll_hello(self, node: NodeHandle, payload: bytes | None) -> bool:
        """Answer ``node``'s authentic hellos that came: with ``payload`` (the node's
        configuration) when the rank is free, with a refusal when it is taken.  True once the
        node is configured."""
        rank = node.rank
        while (got := self.channel.take_hello(rank)) is not None:
            endpoint, msg = got
            if msg.token in self.seen_tokens:  # a session saying hello twice: answered already
                self.channel.refuse(endpoint, msg, "this session said hello already")
                continue
            self.seen_tokens.add(msg.token)
            if node.configured or payload is None:
                reason = f"rank {rank} is already taken by another node of this collector"
                self.channel.refuse(endpoint, msg, reason)
                self.turned_away.append(f"pid {msg['pid']} on {msg['host']}")
                logger.error("rlcollect: refused a second node for rank %d (pid %s on %s): %s", rank, msg["pid"],
                             msg["host"], reason)
                continue
            self._answer(node, endpoint, msg, payload)
        return node.configured

    def _answer(self, node: NodeHandle, endpoint: P.Endpoint, msg: P.Message, payload: bytes) -> None:
        """Answer ``node`` (which said ``msg`` on ``endpoint``): its channel from now on; its
        configuration ``payload`` follows.  A node started for another world size is refused."""
        rank = node.rank
        if msg["world_size"] != self.world_size:
            reason = (f"started with --world-size {msg['world_size']}, but this collector has {self.world_size} "
                      f"(num_nodes={self.world_size - 1} + 1)")
            self.channel.refuse(endpoint, msg, reason, linger=True)  # rank 0 raises: the node reads why first
            raise ValueError(f"node rank {rank} (host {msg['host']}, pid {msg['pid']}) was {reason}")
        node.token, node.sent, node.received, node.setup = msg.token, 0, 0, payload
        node.configured = True
        self.channel.adopt(node, endpoint, msg, node_index=node.index, incarnation=node.incarnation)

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
        """A new incarnation of ``rank``: hellos that came before it was relaunched are stale."""
        while self.channel is not None and (got := self.channel.take_hello(rank)) is not None:
            self.channel.refuse(*got, "this rank is being relaunched; the hello came before")

    def said_bye(self, node: NodeHandle) -> bool:
        """Whether ``node``'s session said goodbye on its channel (at shutdown)."""
        return node.rank in self.channel.byes
