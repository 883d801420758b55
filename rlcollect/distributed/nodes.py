"""One ``NodeHandle`` per node: everything rank 0 knows about that node, in one place, with an
explicit state.

A node's life on rank 0::

    LAUNCHING --(joined its pair group)--> SERVING --(died, silent, raised, hung)--> FAILED
    FAILED --(on_node_failure="restart")--> RELAUNCHING --(rejoined, admitted)--> SERVING
    FAILED --(on_node_failure="continue")--> DROPPED
    any --(shutdown)--> CLOSED

Only a SERVING node is given commands and credits.  The handle also holds the node's current
session (token, message counters), its incarnation, its pair group and receive buffer, its
credits and batches in flight, and the counters ``stats()`` reports.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Any

from rlcollect.errors import WorkerError


class NodeState(enum.Enum):
    """Where a node is in its life (see the module's docstring)."""

    LAUNCHING = "launching"
    SERVING = "serving"
    FAILED = "failed"
    RELAUNCHING = "relaunching"
    DROPPED = "dropped"
    CLOSED = "closed"


@dataclass
class Rejoin:
    """A relaunched node on its way back: its configuration and how far its handshake got
    (``info``: what it reported once started, waiting to be admitted)."""

    payload: bytes
    deadline: float
    configured: bool = False
    info: dict | None = None


@dataclass
class NodeHandle:
    """Rank 0's view of node ``index`` (rank ``index + 1``).

    Example:
        >>> handle = NodeHandle(0)
        >>> handle.rank, handle.state.value, handle.outstanding
        (1, 'launching', 0)
    """

    index: int
    state: NodeState = NodeState.LAUNCHING
    # -- its session and incarnation -------------------------------------------------------------
    token: str = ""  # the current session's token ("": none), from its authenticated hello
    sent: int = 0  # counter of the last message sent to this session
    received: int = 0  # counter of the last message taken from it
    incarnation: int = 0  # how many times it was relaunched
    configured: bool = False  # sent its configuration (this incarnation)
    rejoin: Rejoin | None = None  # RELAUNCHING: its handshake
    info: dict = field(default_factory=dict)  # what it reported once started: layout, weights, pid, host
    endpoint: Any = None  # rank 0's side of its channel (protocol.Endpoint), once it attached
    watcher: Any = None  # the wire of its watcher's channel, once that attached
    setup: bytes | None = None  # its spec, sent when it attaches
    last_beat: float = 0.0  # when its last authentic beat came (monotonic; the channel's reader stamps it)
    watch: tuple[str, float] | None = None  # its watcher's last report: (state, when)
    pg: Any = None  # its pair process group with rank 0
    recv: Any = None  # the flat buffer its batches are received into
    receives: list = field(default_factory=list)  # batch receives posted and not finished (transport.post_recv)
    # -- credits and batches in flight -------------------------------------------------------------
    outstanding: int = 0  # batches granted and not received yet
    expected_seq: int = 0  # the sequence number of its next batch notice
    batch_started: float | None = None  # when its oldest unannounced batch started (node_timeout)
    weight_sends: collections.deque = field(default_factory=collections.deque)  # (version, work) not yet taken
    last_weights: tuple[int, Any] | None = None  # (version, packed): what a relaunched node starts from
    # -- counters --------------------------------------------------------------------------------
    version: int = 0  # the weights version it acts with (from its next batch on)
    since_update: int = 0  # batches received since its last weights
    step: tuple[float | None, float | None] = (None, None)  # env-step latency: mean, p95 (seconds)
    lost_batches: int = 0

    @property
    def rank(self) -> int:
        return self.index + 1

    @property
    def serving(self) -> bool:
        return self.state is NodeState.SERVING

    def stats_state(self) -> str:
        """The state ``stats()`` names: "collecting", "rejoining", "dropped" or "closed"."""
        if self.state is NodeState.CLOSED:
            return "closed"
        if self.state is NodeState.DROPPED:
            return "dropped"
        return "collecting" if self.serving else "rejoining"


def node_error(message: str, node: int, exitcode: int | None = None) -> WorkerError:
    """A ``WorkerError`` about node ``node`` (0-based), also as ``node_index``.

    Example:
        >>> err = node_error("node 1 stopped answering", 1)
        >>> err.worker_index, err.node_index
        (1, 1)
    """
    err = WorkerError(message, node, exitcode)
    err.node_index = node
    return err
