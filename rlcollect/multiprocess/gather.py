"""How a multi-process collector gathers its workers' batches: ``SyncGather`` (one batch from
every worker, all collected with the same weights) and ``AsyncGather`` (first ready, first
served, each batch one worker's: gather_async.py), over what both hold (``GatherBase``).

Each gets its collaborators in its constructor (the worker pool, the slots, the statistics)
and calls none of them back but through those: the collector's ``Members`` (rlcollect/members.py)
asks it for the next batch, it answers with the batch and where it is delivered. A gather never
repairs a failure: it raises ``MemberFailed`` and keeps what it gathered; ``Members`` has the
worker replaced (``multiprocess/recovery.py``), tells the gather (``recovered``) and asks again,
and the failed worker's share is collected again, so a batch never mixes frames from before and
after.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from tensordict import TensorDict

from rlcollect.data import MASK, BatchLayout
from rlcollect.errors import WorkerError
from rlcollect.members import MemberFailed, MemberStats
from rlcollect.multiprocess import protocol as P
from rlcollect.multiprocess.slots import StackedSlots, WorkerSlots, can_count_references, check_layouts
from rlcollect.torchrl_args import frames_written

if TYPE_CHECKING:
    from rlcollect.multiprocess.config import MultiConfig

#: ``update(index)``: the collector's weight update with each batch (``update_at_each_batch``;
#: ``index`` None: before a sync batch; an async batch's worker after it), returning the version
#: acting from then on.
Update = Callable[[Any], int]

#: ``("collector", "lag_dropped_frames")`` (with ``max_policy_lag``): the frames dropped for
#: lag since the previous batch was delivered, in every frame of an async batch.
LAG_DROPPED = ("collector", "lag_dropped_frames")


class Pool(Protocol):
    """What a gather asks of its pool (``WorkerPool``, pool.py): commands and replies, one
    worker at a time, and who has replied."""

    def __len__(self) -> int: ...

    def send(self, index: int, command: str, *args: Any) -> None: ...

    def receive(self, index: int, timeout: float | None = None) -> Any: ...

    def ready(self, indices: list[int], timeout: float | None) -> list[int]: ...

    def busy(self, index: int) -> bool: ...

    def next_reply(self, index: int) -> str: ...

    def timed_out(self, index: int, seconds: float | None) -> WorkerError: ...


class Lock(Protocol):
    """The lock the collector's version moves under (``hold``)."""

    def acquire(self) -> Any: ...

    def release(self) -> None: ...


def name_time(batch: TensorDict) -> TensorDict:
    """``batch`` with its last dim named "time"."""
    batch.names = [None] * (batch.batch_dims - 1) + ["time"]
    return batch


class GatherBase:
    """What both gathers hold.

    Args:
        config: the collector's ``MultiConfig``.
        pool: the ``WorkerPool``.
        slots: the batch slots (slots.py).
        attach: ``attach(i)`` hands worker ``i`` its slots again (the sync reserve slot).
        stats: ``MemberStats``: the counters (``frames``) and statistics.
        stops: each worker's shared stop flag.
        trainer_version: returns the collector's policy version now (None: the version
            ``next_batch`` is given): what ``max_policy_lag`` is checked against when a batch
            is about to be delivered (running free, the trainer updates meanwhile).
        hold: a lock the collector's version moves under: with ``max_policy_lag``, held from
            the check of a batch's lag to its delivery (``release()``, the caller's, once the
            batch is written), so no update slips in between.
    """

    def __init__(self, config: MultiConfig, pool: Pool, slots: StackedSlots | WorkerSlots,
                 attach: Callable[[int], None], stats: MemberStats, stops: list[torch.Tensor],
                 trainer_version: Callable[[], int] | None = None, hold: Lock | None = None):
        self.config, self.pool, self.slots, self.attach = config, pool, slots, attach
        self.stats, self.stops = stats, stops
        self.trainer_version, self.hold = trainer_version, hold
        self.held = False
        self.owed: tuple[int, BaseException] | None = None  # a failure met after a batch was taken
        self.num_workers = len(pool)
        self.layouts = slots.layouts if isinstance(slots, WorkerSlots) else [slots.layout] * self.num_workers

    def random_now(self) -> bool:
        """Whether the next batch acts randomly (``init_random_frames``)."""
        limit = self.config.init_random_frames
        return limit > 0 and frames_written(self.config.replay_buffer, self.stats.frames) < limit

    def release(self) -> None:
        """The batch ``next_batch`` returned is delivered: versions may move again."""
        if self.held:
            self.held = False
            self.hold.release()

    def take_owed(self) -> tuple[int, BaseException]:
        """The failure met after the batch was taken (``owed``), handed to ``Members``."""
        owed, self.owed = self.owed, None
        return owed  # type: ignore[return-value]

    def recovered(self, index: int) -> None:
        """Worker ``index`` was replaced (``Members``): collect again what it lost."""

    def abandon(self) -> None:
        """A failure was not repaired (raised): forget the step in progress."""

    def rejoin(self) -> None:
        """(no worker is ever on its way back: a failed one is replaced before the next step)"""

    def quiesce(self) -> None:
        """Wait for the replies workers still owe."""

    def discard(self) -> None:
        """Drop the batches collected and not yet delivered (``set_seed``, ``reset``, ...)."""
        self.quiesce()

    def note_seed(self, seed: int) -> None:
        """``set_seed(seed)`` was called (recorded, or checked against the recording)."""

    def close(self) -> None:
        """At shutdown: close the schedule being recorded."""


@dataclass
class _Round:
    """One sync batch being collected, kept across a worker's restart (``MemberFailed``)."""

    version: int
    started: float
    random: bool
    current: int = 0  # the stacked slot the workers write
    view: Any = None  # its batch, as a view (stacked slots: made when picked)
    infos: list | None = None  # each worker's reply (None: not asked yet)
    waiting: list[int] = field(default_factory=list)  # asked, not replied
    reattach: list[int] = field(default_factory=list)  # still to be handed the reserve slot
    asked: bool = False  # every worker was asked once
    dead: list[tuple[int, WorkerError]] = field(default_factory=list)  # found dead when asked
    resend: list[int] = field(default_factory=list)  # replaced: to be asked again
    lost: list[int] = field(default_factory=list)  # failed while collecting its share
    deadlines: dict[int, float] = field(default_factory=dict)


class SyncGather(GatherBase):
    """One batch from every worker (``MultiSyncCollector``)."""

    @staticmethod
    def make_slots(config: Any, layouts: list[BatchLayout]) -> StackedSlots | WorkerSlots:
        """The slots for ``layouts``: stacked when the delivered batch can be a view of them."""
        cat_dim = check_layouts(layouts, config.cat_results)  # before anything is allocated
        first = layouts[0]
        # A view needs one layout for all and a gather that is a stack (or a cat along dim 0);
        # workers that write into a replay buffer deliver nothing.
        stacked = (can_count_references() and not config.workers_write
                   and all(lay == first for lay in layouts[1:])
                   and (config.cat_results == "stack" or (cat_dim == 0 and config.preemptive_threshold is None
                                                          and len(first.batch_size) > 0)))
        if stacked:
            return StackedSlots(first, len(layouts), stacked=config.cat_results == "stack")
        return WorkerSlots(layouts, 1)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.stacked = isinstance(self.slots, StackedSlots)
        self.cat_dim = check_layouts(self.layouts, self.config.cat_results)
        self.round: _Round | None = None

    @property
    def current(self) -> int:
        return self.slots.current if self.stacked else 0

    def next_batch(self, version: int, update: Update) -> tuple[TensorDict | None, dict]:
        """``(batch, where)``: the next batch (None when the workers wrote it into the replay
        buffer) and the keyword arguments of its delivery. A worker that fails raises
        ``MemberFailed``; once it is replaced (``recovered``), the same call goes on with the
        batch where it stopped."""
        round_ = self.round
        if round_ is None:  # (not again when this batch resumes after a restart)
            if self.config.update_at_each_batch:
                version = update(None)
            round_ = self.round = _Round(version, time.perf_counter(), self.random_now())
        infos = self.collect_all(round_.random)
        version, started = round_.version, round_.started
        waited = time.perf_counter() - started
        if self.config.workers_write:  # the workers put their parts into the replay buffer
            return None, {"report": (list(enumerate(infos)), version, waited, started)}
        batch, kept = self._gather(infos, round_.view)
        # The batch's report goes back with it (``Members`` notes it: MemberStats.note_batch).
        return batch, {"storing_device": self.config.storing_devices[0],
                       "stacked_workers": self.config.cat_results == "stack",
                       "report": (list(enumerate(infos)), version, waited, started, kept)}

    def collect_all(self, random: bool) -> list[dict]:
        """One batch from every worker (acting randomly when ``random``). A worker that fails
        raises ``MemberFailed`` (its share, and those of the others, kept in ``round``); called
        again once it is replaced, its share is collected again, so a batch never mixes frames
        from before and after."""
        pool, n, timeout_s = self.pool, self.num_workers, self.config.worker_timeout
        r = self.round
        if r is None:
            r = self.round = _Round(0, time.perf_counter(), random)
        if r.infos is None:  # a new batch
            if self.stacked:
                made, r.view = self.slots.pick()
                if made:
                    r.reattach = list(range(n))
            for stop in self.stops:
                stop[0] = 0
            r.current = self.slots.current if self.stacked else 0
            r.infos = [None] * n
            r.waiting = list(range(n))
        while r.reattach:  # hand every worker its part of the reserve slot just made
            i = r.reattach.pop(0)
            try:
                self.attach(i)
            except WorkerError as err:  # died meanwhile: its replacement is attached to the reserve too
                if err.worker_index != i:
                    raise
                raise MemberFailed(i, err) from None
        if not r.asked:
            # Every worker asked in one pass (no call of ours between two sends); those found dead
            # are replaced and asked after the others have started.
            r.asked = True
            for i in range(n):
                try:
                    pool.send(i, P.COLLECT, r.current, random)
                except WorkerError as err:
                    if err.worker_index != i:
                        raise
                    r.dead.append((i, err))
            if timeout_s is not None:
                r.deadlines = dict.fromkeys(range(n), time.monotonic() + timeout_s)
        while r.resend or r.dead:
            if not r.resend:
                i, err = r.dead.pop(0)
                r.resend.append(i)
                raise MemberFailed(i, err)
            i = r.resend[0]  # replaced: asked for its share
            try:
                pool.send(i, P.COLLECT, r.current, random)
            except WorkerError as err:  # its replacement died too
                if err.worker_index != i:
                    raise
                raise MemberFailed(i, err) from None
            r.resend.pop(0)
            if timeout_s is not None:
                r.deadlines[i] = time.monotonic() + timeout_s
        threshold = self.config.preemptive_threshold
        need = n if threshold is None else max(1, math.ceil(threshold * n))
        infos, waiting, deadlines = r.infos, r.waiting, r.deadlines
        while waiting:
            try:
                timeout = None if not deadlines else max(0.0, min(deadlines[i] for i in waiting) - time.monotonic())
                ready = pool.ready(waiting, timeout)
                if not ready and not deadlines:
                    continue  # woken without a reply (pool.ready reports deaths): wait again
                if not ready:
                    late = min(waiting, key=lambda i: deadlines[i])
                    raise pool.timed_out(late, timeout_s)
                for i in ready:
                    infos[i] = pool.receive(i)
                    waiting.remove(i)
            except Exception as err:
                index = getattr(err, "worker_index", None)
                if index not in waiting:
                    raise
                r.lost.append(index)  # counted once it is replaced
                r.resend.append(index)
                raise MemberFailed(index, err) from None
            if threshold is not None and n - len(waiting) >= need:
                for i in waiting:
                    self.stops[i][0] = 1
        self.round = None
        return infos  # type: ignore[return-value]

    def recovered(self, index: int) -> None:
        """Worker ``index`` was replaced: a share it was collecting is counted lost (asked again
        when the batch goes on)."""
        r = self.round
        if r is not None and index in r.lost:
            r.lost.remove(index)
            self.stats.note_lost(index, 1)

    def abandon(self) -> None:
        """A failure was not repaired: the batch in progress is forgotten."""
        self.round = None

    def _gather(self, infos: list[dict], view: TensorDict | None = None) -> tuple[TensorDict, list[int] | None]:
        """The batch of the workers' parts ``infos`` (``view``: the stacked slot's, made when it
        was picked), and the frames of each part it delivers when fewer than collected (None:
        all of them)."""
        if self.stacked:  # the batch is a view of the stacked slot the workers wrote (named)
            return (self.slots.batch() if view is None else view), None
        tds = [self.slots.buffer(i, 0).td for i in range(self.num_workers)]
        if self.config.cat_results == "stack":
            return name_time(torch.stack(tds, 0)), None
        kept = None
        if self.config.preemptive_threshold is not None:
            steps = [int(info["frames"] // max(1, lay.rows)) for info, lay in zip(infos, self.layouts)]
            if self.cat_dim != -1:  # cut to the shortest part: the first `keep` steps of each worker
                keep = min(steps)
                steps = [keep] * len(steps)
                kept = [keep * lay.rows for lay in self.layouts]
            tds = [td[..., :s] for td, s in zip(tds, steps)]
            tds = [td.exclude(MASK) for td in tds]
        return name_time(torch.cat(tds, self.cat_dim)), kept

    # -- nesting: a MultiSyncCollector running inside another collector's worker ------------------
    def layout(self) -> BatchLayout:
        """The layout of one stacked batch (only for ``cat_results="stack"``)."""
        if self.config.cat_results != "stack":
            raise ValueError("a nested MultiSyncCollector needs cat_results='stack'")
        first = self.layouts[0]
        return BatchLayout(dict(first.fields), (self.num_workers, *first.batch_size), first.time)

    def collect_into(self, buf: Any, random: bool, version: int) -> int:
        """Collect one stacked batch straight into ``buf``; returns its valid frames."""
        infos = self.collect_all(random)
        rows = self.layouts[0].rows
        for i in range(self.num_workers):
            for key, tensor in self.slots.buffer(i, self.current).tensors.items():
                buf.tensors[key][i * rows:(i + 1) * rows].copy_(tensor)
        self.stats.note_batch(list(enumerate(infos)), version)
        return sum(info["frames"] for info in infos)
