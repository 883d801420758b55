"""Gathering the nodes' batches on rank 0: sync (one part from every node, stacked) and async
(each node's batch as it comes, tagged with its node), with the frames counted as they are
delivered.  The multi-process wing has a ``gather.py`` for the same role.

``Gather`` holds what is in flight between two deliveries: the parts of the sync batch being
assembled (kept across a node's relaunch, so only the failed node's part is collected again),
and the async batches received early (while draining before a command) that wait for
delivery.  It waits through the pool (``NodePool.wait_for``, liveness checked throughout) and
never handles a failure itself: it raises, and the collector's ``Members`` (rlcollect/members.py)
has ``Recovery`` repair it and asks again.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from tensordict import TensorDict

from rlcollect.distributed.control import protocol as P
from rlcollect.members import MemberStats
from rlcollect.metrics import batch_meta, policy_lag

#: ``("collector", "node_id")``: the node an async batch came from.
NODE_ID = ("collector", "node_id")
#: ``("collector", "lag_dropped_frames")`` (with ``max_policy_lag``): the frames dropped for
#: lag since the previous batch was delivered.
LAG_DROPPED = ("collector", "lag_dropped_frames")


class Options(Protocol):
    """What the gather reads of the collector's ``DistributedConfig`` (config.py)."""

    num_nodes: int
    sync: bool
    storing_device: object  # where the delivered batches go (applied by the delivery)
    slots: int  # batches each async node keeps in flight
    init_random_frames: int
    lag_bound: int | None  # max_policy_lag (async)
    timeout: float  # seconds the batches in flight may take to arrive, when drained


class Handle(Protocol):
    """What the gather reads of a node's ``NodeHandle`` (nodes.py)."""

    outstanding: int  # batches granted and not taken yet


class Nodes(Protocol):
    """What the gather asks of the ``NodePool`` (pool.py): waits (liveness checked throughout),
    credits, the nodes' batch notices and their batches."""

    @property
    def handles(self) -> Sequence[Handle]: ...

    def serving(self) -> list[int]: ...

    def maybe_check(self) -> None: ...

    def wait_for(self, predicate: Callable[[], bool], what: str, timeout: float | None = None) -> None: ...

    def admit(self) -> None: ...

    def settled(self) -> bool: ...

    def check_deadlines(self) -> None: ...

    def grant(self, i: int, credits: int, random: bool) -> None: ...

    def ready(self, i: int | None = None) -> P.Message | None: ...

    def take(self, msg: P.Message) -> TensorDict: ...


class Gather:
    """The batches of ``pool``'s nodes, gathered as ``config`` says (``sync``, ``slots``,
    ``init_random_frames``).

    Args:
        config: the collector's ``DistributedConfig``.
        pool: its ``NodePool``.
        push_due: ``push_due(nodes, yielded)`` pushes the automatic weight updates due before
            the next batch of ``nodes`` (the collector's ``NodeWeights`` decide which).
        version: returns the weights version rank 0 is at (for the policy lag).
        stats: the ``MemberStats`` each delivered batch is reported to (frames delivered,
            collector-wide and per node: what ``state_dict()["frames"]`` and ``total_frames``
            count; batches received and not delivered yet, in ``backlog`` or ``round``, are not
            counted until they are delivered), with the lag, the wait and the frames dropped.

    Example (needs running nodes)::

        gather = Gather(config, pool, push_due, lambda: version, MemberStats(config.num_nodes))
        batch = gather.next_sync(yielded=0)
    """

    def __init__(self, config: Options, pool: Nodes, push_due: Callable[[Sequence[int], int], None],
                 version: Callable[[], int], stats: MemberStats):
        self.config, self.pool, self._push_due, self._version, self.stats = config, pool, push_due, version, stats
        self.backlog: collections.deque[tuple[int, TensorDict, P.Message]] = collections.deque()
        self.round: dict[int, tuple[TensorDict, P.Message]] = {}
        self.round_open = False
        self.started = 0.0  # when the batch being gathered was first asked for
        # (Members' contract: a failure met after a batch was taken; never here, where a node's
        # failure is raised before its batch is taken)
        self.owed: tuple[int, BaseException] | None = None
        self.held = False  # (Members' contract: no version lock is held until a batch is delivered)

    # -- Members' contract (rlcollect/members.py) --------------------------------------------------
    def take_owed(self) -> tuple[int, BaseException]:
        """(never owed: ``owed`` stays None)"""
        raise AssertionError("a distributed gather owes no failure")

    def recovered(self, index: int) -> None:
        """Node ``index`` was dropped or relaunched: ``round`` keeps the other nodes' parts."""

    def abandon(self) -> None:
        """A failure was raised: what was gathered stays (the collector shuts down)."""

    def rejoin(self) -> None:
        """Wait until no node is on its way back (the relaunched ones rejoined, are admitted)."""
        pool = self.pool
        pool.wait_for(pool.settled, "waiting for relaunched nodes to rejoin")

    def quiesce(self) -> None:
        """Receive every batch still owed (within ``timeout``) into ``backlog``, where it stays
        queued for delivery, with no node on its way back before or after (before a command
        meant for every node)."""
        self.rejoin()
        self.pool.wait_for(self.drained, "waiting for the batches in flight", self.config.timeout)
        self.rejoin()  # a node that failed while draining was relaunched

    def note_seed(self, seed: int) -> None:
        """(nothing recorded: a distributed run has no schedule)"""

    def release(self) -> None:
        """(no version lock is ever held here)"""

    def next_batch(self, version: int, update: object = None) -> tuple[TensorDict, dict]:
        """``(batch, where)``: the next batch (``next_sync`` or ``next_async``) and the keyword
        arguments of its delivery; ``Members.next_batch`` runs it under recovery (the collector's
        ``_collect_next``). The policy lag is measured against the ``version`` callable this
        gather was built with, and the automatic weight pushes are ``push_due``'s: ``version``
        and ``update`` (the multi-process gathers') are not used."""
        self.pool.maybe_check()  # also when batches keep coming from the other nodes
        yielded = self.stats.batches
        batch = self.next_sync(yielded) if self.config.sync else self.next_async(yielded)
        return batch, {"storing_device": self.config.storing_device}

    def take(self, msg: P.Message) -> TensorDict:
        """The batch ``msg`` announced (counted when delivered: ``deliver``)."""
        return self.pool.take(msg)

    def deliver(self, msgs: list[P.Message], waited: float) -> None:
        """Report the batch of the parts ``msgs`` announced, delivered now, to the statistics
        (``waited``: the seconds rank 0 waited for it)."""
        parts = [(msg.rank - 1, {"frames": msg["frames"], "meta": _meta(msg)}) for msg in msgs]
        self.stats.note_batch(parts, self._version(), waited, started=self.started, workers=False)

    def grant(self, i: int, credits: int) -> None:
        self.pool.grant(i, credits, random=self.stats.frames < self.config.init_random_frames)

    def next_sync(self, yielded: int) -> TensorDict:
        """One part from every node (``yielded``: batches delivered so far).  Each part is
        received as soon as it is announced and kept in ``round``: when a node fails and is
        relaunched (this runs again), the parts of the others stay."""
        pool, parts, n = self.pool, self.round, self.config.num_nodes
        if not self.round_open:  # not again when this batch resumes after a relaunch
            self.started = time.perf_counter()
            self._push_due(range(n), yielded)
            self.round_open = True

        def all_ready() -> bool:
            pool.admit()
            pool.check_deadlines()
            for i in pool.serving():
                if i not in parts:
                    if pool.handles[i].outstanding == 0:
                        self.grant(i, 1)
                    elif (msg := pool.ready(i)) is not None:
                        parts[i] = (self.take(msg), msg)
            return len(parts) == n

        waited = time.perf_counter()
        pool.wait_for(all_ready, "waiting for the nodes' batches")
        self.deliver([msg for _, msg in parts.values()], time.perf_counter() - waited)
        batch = torch.stack([parts[i][0] for i in range(n)], 0)
        parts.clear()
        self.round_open = False
        batch.names = [None] * (batch.batch_dims - 1) + ["time"]
        return batch

    def next_async(self, yielded: int) -> TensorDict:
        """The first batch any node announced (or one received early), tagged with its node;
        that node is restarted at once. With ``max_policy_lag`` (``lag_policy="drop"``), a batch
        more than that many versions behind rank 0's is dropped (counted per node, and in the
        next batch's ``("collector", "lag_dropped_frames")``) and the next one taken."""
        bound = self.config.lag_bound
        self.started, waited = time.perf_counter(), 0.0
        while True:
            i, batch, msg, wait = self._next_announced(yielded)
            waited += wait
            if bound is None or policy_lag(self._version(), [_meta(msg)])[1] <= bound:
                break
            self.stats.note_lag_dropped(i, msg)
        batch.set(NODE_ID, torch.full(batch.shape, i, dtype=torch.int64))
        if bound is not None:
            batch.set(LAG_DROPPED, torch.full(batch.shape, self.stats.take_lag_dropped(), dtype=torch.int64))
        batch.names = [None] * (batch.batch_dims - 1) + ["time"]
        self.deliver([msg], waited)
        return batch

    def _next_announced(self, yielded: int) -> tuple[int, TensorDict, P.Message, float]:
        """The first batch any node announced (or one received early): ``(node, batch,
        notice, seconds waited)``; that node is restarted at once."""
        taken: list[P.Message] = []
        pool, slots = self.pool, self.config.slots

        def one_ready() -> bool:
            pool.admit()
            pool.check_deadlines()
            for i in pool.serving():
                self.grant(i, slots - pool.handles[i].outstanding)
            if not self.backlog and (msg := pool.ready()) is not None:
                taken.append(msg)
            return bool(self.backlog or taken)

        waited = time.perf_counter()
        pool.wait_for(one_ready, "waiting for a node's batch")
        waited = time.perf_counter() - waited
        if taken:
            msg = taken[0]
            i, batch = msg.rank - 1, self.take(msg).clone()
        else:
            i, batch, msg = self.backlog.popleft()
        self._push_due([i], yielded + 1)
        self.grant(i, slots - pool.handles[i].outstanding)  # restart that node at once
        return i, batch, msg, waited

    def drained(self) -> bool:
        """Receive the batches already announced into ``backlog``; True once no node owes one
        (the predicate of a wait before a command)."""
        pool = self.pool
        pool.check_deadlines()
        while (msg := pool.ready()) is not None:
            self.backlog.append((msg.rank - 1, self.take(msg).clone(), msg))
        return not any(h.outstanding for h in pool.handles)

    def discard(self) -> None:
        """Forget what was gathered and not delivered (``quiesce`` first): the async backlog,
        and the parts of a sync batch (never counted: only delivered frames are)."""
        self.quiesce()
        self.backlog.clear()
        self.round.clear()
        self.round_open = False


def _meta(msg: P.Message) -> dict:
    """A node's batch notice as rlcollect.metrics' batch metadata."""
    return batch_meta(msg["frames"], msg["version_min"], msg["version_mean"], (msg["step_mean_s"], msg["step_p95_s"]))
