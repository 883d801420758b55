"""How a multi-process collector gathers its workers' batches: ``SyncGather`` (one batch from
every worker, all collected with the same weights) and ``AsyncGather`` (first ready, first
served, each batch one worker's).

Each gets its collaborators in its constructor (the worker pool, the slots, the restarts, the
statistics) and calls none of them back but through those: the collector asks it for the next
batch, it answers with the batch and where it is delivered. A worker that fails is restarted
(when allowed) and its share collected again, so a batch never mixes frames from before and
after.
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from rlcollect.data import MASK, WORKER_ID, BatchLayout
from rlcollect.envs.base import ArraySpec
from rlcollect.errors import WorkerError
from rlcollect.metrics import policy_lag
from rlcollect.multiprocess import protocol as P
from rlcollect.multiprocess.slots import StackedSlots, WorkerSlots, can_count_references, check_layouts
from rlcollect.torchrl_args import frames_written, random_batches

#: ``update(index)``: the collector's weight update with each batch (``update_at_each_batch``;
#: ``index`` None: before a sync batch; an async batch's worker after it), returning the version
#: acting from then on.
Update = Callable[[Any], int]

#: ``("collector", "lag_dropped_frames")`` (with ``max_policy_lag``): the frames dropped for
#: lag since the previous batch was delivered, in every frame of an async batch.
LAG_DROPPED = ("collector", "lag_dropped_frames")


def _name_time(batch: TensorDict) -> TensorDict:
    batch.names = [None] * (batch.batch_dims - 1) + ["time"]
    return batch


class _Gather:
    """What both gathers hold.

    Args:
        config: the collector's ``MultiConfig``.
        pool: the ``WorkerPool``.
        slots: the batch slots (slots.py).
        attach: ``attach(i)`` hands worker ``i`` its slots again (the sync reserve slot).
        restarts: ``WorkerRestarts``: replaces a failed worker or re-raises its error.
        stats: ``WorkerStats``: the counters (``frames``) and statistics.
        stops: each worker's shared stop flag.
        trainer_version: returns the collector's policy version now (None: the version
            ``next_batch`` is given): what ``max_policy_lag`` is checked against when a batch
            is about to be delivered (running free, the trainer updates meanwhile).
        hold: a lock the collector's version moves under: with ``max_policy_lag``, held from
            the check of a batch's lag to its delivery (``release()``, the caller's, once the
            batch is written), so no update slips in between.
    """

    def __init__(self, config: Any, pool: Any, slots: Any, attach: Callable[[int], None], restarts: Any,
                 stats: Any, stops: list[torch.Tensor], trainer_version: Callable[[], int] | None = None,
                 hold: Any = None):
        self.config, self.pool, self.slots, self.attach = config, pool, slots, attach
        self.restarts, self.stats, self.stops = restarts, stats, stops
        self.trainer_version, self.hold = trainer_version, hold
        self.held = False
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

    def quiesce(self) -> None:
        """Wait for the replies workers still owe."""

    def discard(self) -> None:
        """Drop the batches collected and not yet delivered (``set_seed``, ``reset``, ...)."""
        self.quiesce()

    def note_seed(self, seed: int) -> None:
        """``set_seed(seed)`` was called (recorded, or checked against the recording)."""

    def close(self) -> None:
        """At shutdown: close the schedule being recorded."""


class SyncGather(_Gather):
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

    @property
    def current(self) -> int:
        return self.slots.current if self.stacked else 0

    def next_batch(self, version: int, update: Update) -> tuple[TensorDict | None, dict]:
        """``(batch, where)``: the next batch (None when the workers wrote it into the replay
        buffer) and the keyword arguments of its delivery."""
        if self.config.update_at_each_batch:
            version = update(None)
        started = time.perf_counter()
        infos = self.collect_all(self.random_now())
        waited = time.perf_counter() - started
        if self.config.workers_write:  # the workers put their parts into the replay buffer
            self.stats.note_batch(list(enumerate(infos)), version, waited, started=started)
            return None, {}
        batch, kept = self._gather(infos)
        self.stats.note_batch(list(enumerate(infos)), version, waited, started=started, kept=kept)
        return batch, {"storing_device": self.config.storing_devices[0],
                       "stacked_workers": self.config.cat_results == "stack"}

    def _reattach(self) -> None:
        """Hand every worker its part of the reserve slot just made."""
        for i in range(self.num_workers):
            try:
                self.attach(i)
            except WorkerError as err:  # it died meanwhile: its replacement is attached to the reserve too
                if err.worker_index != i:
                    raise
                self.restarts.recover(i, err)

    def collect_all(self, random: bool) -> list[dict]:
        """One batch from every worker (acting randomly when ``random``). A worker that fails is
        restarted (when allowed) and its share is collected again, so a batch never mixes
        frames from before and after."""
        pool, n, timeout_s = self.pool, self.num_workers, self.config.worker_timeout
        if self.stacked and self.slots.pick():
            self._reattach()
        for stop in self.stops:
            stop[0] = 0
        deadlines: dict[int, float] = {}
        current = self.slots.current if self.stacked else 0

        def start_or_recover(i: int) -> None:
            """Ask worker ``i`` for its share; one found dead (killed since its last batch) is
            replaced first, as often as the restart policy allows."""
            while True:
                try:
                    pool.send(i, P.COLLECT, current, random)
                    break
                except WorkerError as err:
                    if err.worker_index != i:
                        raise
                    self.restarts.recover(i, err)
            if timeout_s is not None:
                deadlines[i] = time.monotonic() + timeout_s

        # Every worker asked in one pass (no call of ours between two sends); those found dead
        # are replaced and asked after the others have started.
        dead: list[tuple[int, WorkerError]] = []
        for i in range(n):
            try:
                pool.send(i, P.COLLECT, current, random)
            except WorkerError as err:
                if err.worker_index != i:
                    raise
                dead.append((i, err))
        if timeout_s is not None:
            deadlines = dict.fromkeys(range(n), time.monotonic() + timeout_s)
        for i, err in dead:
            self.restarts.recover(i, err)
            start_or_recover(i)
        threshold = self.config.preemptive_threshold
        need = n if threshold is None else max(1, math.ceil(threshold * n))
        infos: list[dict | None] = [None] * n
        waiting = list(range(n))
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
                self.restarts.recover(index, err)
                self.stats.note_lost(index, 1)
                start_or_recover(index)
            if threshold is not None and n - len(waiting) >= need:
                for i in waiting:
                    self.stops[i][0] = 1
        return infos

    def _gather(self, infos: list[dict]) -> tuple[TensorDict, list[int] | None]:
        """The batch of the workers' parts ``infos``, and the frames of each part it delivers
        when fewer than collected (None: all of them)."""
        if self.stacked:  # the batch is a view of the stacked slot the workers wrote (named)
            return self.slots.batch(), None
        tds = [self.slots.buffer(i, 0).td for i in range(self.num_workers)]
        if self.config.cat_results == "stack":
            return _name_time(torch.stack(tds, 0)), None
        kept = None
        if self.config.preemptive_threshold is not None:
            steps = [int(info["frames"] // max(1, lay.rows)) for info, lay in zip(infos, self.layouts)]
            if self.cat_dim != -1:  # cut to the shortest part: the first `keep` steps of each worker
                keep = min(steps)
                steps = [keep] * len(steps)
                kept = [keep * lay.rows for lay in self.layouts]
            tds = [td[..., :s] for td, s in zip(tds, steps)]
            tds = [td.exclude(MASK) for td in tds]
        return _name_time(torch.cat(tds, self.cat_dim)), kept

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


class AsyncGather(_Gather):
    """Each worker's batches as soon as they are ready (``MultiAsyncCollector``): every worker
    keeps its three slots busy but the one whose batch is lent to the user."""

    SLOTS_PER_WORKER = 3

    @staticmethod
    def make_slots(config: Any, layouts: list[BatchLayout]) -> WorkerSlots:
        return WorkerSlots(layouts, AsyncGather.SLOTS_PER_WORKER)

    def __init__(self, *args: Any, schedule: Any = None, **kwargs: Any):
        """``schedule``: a ``ScheduleRecorder`` (``record``) or ``ScheduleReplay`` (``replay``)
        (schedule.py), or None; the other arguments are ``_Gather``'s."""
        super().__init__(*args, **kwargs)
        n = self.num_workers
        self.schedule = schedule
        self.replaying = schedule is not None and schedule.replaying
        self.sent_random: dict[tuple[int, int], bool] = {}  # (worker, slot): the batch acts randomly
        self.ready: collections.deque[tuple[int, dict]] = collections.deque()
        self.in_flight: list[set[int]] = [set() for _ in range(n)]
        # When each worker last showed progress (a reply, or being given work while idle):
        # worker_timeout is judged per worker, so a hung worker is caught while others deliver.
        self.progress: list[float] = [time.monotonic()] * n
        self.armed = False
        self.rotation = 0
        self.waited = 0.0  # the main process's wait for the batch being delivered (stats.wait)
        # init_random_frames as torchrl's MultiAsyncCollector counts it (random_batches): the
        # random batches asked for and those not delivered yet, which go out before any other.
        self.random_asked = 0
        self.random_pending: set[tuple[int, int]] = set()
        # Batches delivered as views of their slot (lent until nothing refers to them).
        self.views = can_count_references() and not self.config.workers_write
        # max_policy_lag: batches more than `bound` versions behind at delivery are dropped;
        # lag_policy="wait" (`waiting`) also keeps at most bound + 1 batches started (in
        # `order`, delivered in that order), the others `parked` until the next batch is asked
        # for, after the trainer's update.
        self.bound = getattr(self.config, "lag_bound", None)
        self.waiting = self.bound is not None and self.config.lag_policy == "wait"
        self.order: collections.deque[tuple[int, int]] = collections.deque()
        self.parked: collections.deque[tuple[int, int]] = collections.deque()

    def _arm(self, random: bool | None) -> None:
        for slot in range(self.SLOTS_PER_WORKER):  # slot-major: each worker's first batch first (the random ones)
            for i in range(self.num_workers):
                if not self.slots.is_lent(i, slot):
                    self._collect(i, slot, random)
        self.armed = True

    def _random(self, index: int, slot: int) -> bool:
        """Whether the batch asked of worker ``index`` in ``slot`` acts randomly: as many
        random batches as torchrl's MultiAsyncCollector asks for (``random_batches``); a lost
        random batch is asked for again as random."""
        if (index, slot) in self.random_pending:
            return True
        if self.random_asked >= random_batches(self.config.init_random_frames, self.config.worker_frames):
            return False
        self.random_asked += 1
        self.random_pending.add((index, slot))
        return True

    def _reclaim(self, random: bool | None) -> None:
        """Give the workers back the slots whose batches nothing refers to any more."""
        for i, slot in self.slots.reclaim():
            if self.armed:
                self._collect(i, slot, random)

    def _collect(self, index: int, slot: int, random: bool | None, needed_only: bool = True,
                 again: bool = False) -> None:
        """Have worker ``index`` fill ``slot``, acting randomly when ``random`` (None: when
        ``init_random_frames`` says so now; a nested collector is told by its worker).
        ``again``: a batch a failed worker lost, collected anew in its place (with "wait", it
        keeps its turn); otherwise, with "wait", the slot is parked until ``_start_parked``."""
        if needed_only and not self.replaying and not self._needed():
            return
        if (self.waiting or self.replaying) and not again:
            self.parked.append((index, slot))
            return
        if not self.pool.busy(index):
            self.progress[index] = time.monotonic()  # the worker starts working now
        self.in_flight[index].add(slot)
        randomly = self._random(index, slot) if random is None else random
        self.sent_random[(index, slot)] = randomly
        try:
            self.pool.send(index, P.COLLECT, slot, randomly)
        except WorkerError as err:  # it died since its last batch: replaced, and asked again, as in _poll
            if err.worker_index != index:
                raise
            self._fail(err, random, unsent=slot)

    def _start_parked(self, random: bool | None) -> None:
        """lag_policy="wait": start parked slots, with the weights of now, while fewer than
        ``max_policy_lag + 1`` batches are started and not delivered."""
        while self.parked and len(self.order) <= self.bound and self._needed():
            index, slot = self.parked.popleft()
            self.order.append((index, slot))
            self._collect(index, slot, random, needed_only=False, again=True)

    def _replay_start(self) -> None:
        """Replaying: start what the recording started by now (``ScheduleReplay.start_due``)."""
        self.schedule.start_due(self.parked, self.in_flight, self.stats.pushed,
                                lambda i, slot, random: self._collect(i, slot, random, needed_only=False, again=True),
                                lambda i: self.restarts.recover(i, WorkerError(
                                    f"worker {i} is restarted where the replayed run's was", i)))

    def _needed(self) -> bool:
        """Whether another batch is needed to reach ``total_frames``: the workers never run past
        it (with a replay buffer they write what they collect, so that would write extra)."""
        total = self.config.total_frames
        if total < 0:
            return True
        # per worker: frames_per_batch may be one size per worker (torchrl's list)
        sizes = self.config.worker_frames
        coming = sum(len(slots) * sizes[i] for i, slots in enumerate(self.in_flight))
        coming += sum(sizes[index] for index, _ in self.ready)
        return self.stats.frames + coming < total

    def _take(self, random: bool | None, lending: bool = True) -> tuple[int, dict, float]:
        """The next ready batch's ``(worker, reply, when the wait started)``; ``lending``: the
        batch may be lent (slots are reclaimed first, the wait is counted)."""
        if not self.armed:
            self._arm(random)
        if lending:
            self._reclaim(random)
        if self.waiting:
            self._start_parked(random)
        if self.replaying:
            self._replay_start()
        started = time.perf_counter()
        while (taken := self._pop_ready()) is None:
            self._poll(random)
        if lending:
            self.waited += time.perf_counter() - started  # (counted with the batch it delivers)
        index, info = taken
        self.random_pending.discard((index, info["slot"]))
        return index, info, started

    def _deliverable(self) -> list[tuple[int, dict]]:
        """The ready batches that may go out now: while random batches are owed, only those."""
        if not self.random_pending:
            return list(self.ready)
        return [(i, info) for i, info in self.ready if (i, info["slot"]) in self.random_pending]

    def _pop_ready(self) -> tuple[int, dict] | None:
        """The next ready batch: the first that came, or with "wait" the first started (None:
        not ready yet)."""
        if self.replaying:
            return self.schedule.take_ready(self.ready, self.in_flight, self._replay_start, self.stats.pushed)
        if not self.waiting or not self.order:
            deliverable = self._deliverable()
            if not deliverable:
                return None
            self.ready.remove(deliverable[0])
            return deliverable[0]
        first = self.order[0]
        for j, (index, info) in enumerate(self.ready):
            if (index, info["slot"]) == first:
                del self.ready[j]
                self.order.popleft()
                return index, info
        return None

    def _take_fresh(self, random: bool | None, version: int, lending: bool = True) -> tuple[int, dict, float]:
        """``_take``, dropping (and counting) the batches more than ``max_policy_lag`` versions
        behind ``version``; each dropped batch's slot is filled again. Recording, each batch
        handed in is written to the schedule; replaying, the recorded fate is its fate."""
        while True:
            index, info, started = self._take(random, lending)
            if self.replaying:
                outcome = self.schedule.next_event()[1]
                self.schedule.pop_event()
                if outcome == "deliver":
                    return index, info, started
                self.stats.note_lag_dropped(index, info)
                self._collect(index, info["slot"], random)
                continue
            if self.bound is None:
                self._record(index, info, "deliver")
                return index, info, started
            if self.hold is not None:
                self.hold.acquire()
                self.held = True
            now = version if self.trainer_version is None else self.trainer_version()
            if policy_lag(now, [info["meta"]])[1] <= self.bound:
                self._record(index, info, "deliver")
                return index, info, started
            self.release()
            self._record(index, info, "drop")
            self.stats.note_lag_dropped(index, info)
            self._collect(index, info["slot"], random)

    def next_batch(self, version: int, update: Update) -> tuple[TensorDict | None, dict]:
        """``(batch, where)``: the next worker's batch (None when it wrote it into the replay
        buffer) and the keyword arguments of its delivery."""
        index, info, started = self._take_fresh(None, version)
        slot = info["slot"]
        if self.config.workers_write:  # the worker put its batch into the replay buffer
            self._account(index, info, started, version)
            self._collect(index, slot, None)
            return None, {}
        # A view of the slot when none of this worker's is lent already (it keeps two filling).
        lend = self.views and not self.slots.lent(index)
        batch = self.slots.view(index, slot)
        if not lend:
            batch = batch.clone()
        batch.set(WORKER_ID, torch.full(batch.shape, index, dtype=torch.int64))
        if self.bound is not None:
            batch.set(LAG_DROPPED, torch.full(batch.shape, self.stats.take_lag_dropped(), dtype=torch.int64))
        _name_time(batch)
        self._account(index, info, started, version)
        if self.config.update_at_each_batch:
            update(index)
        if lend:
            self.slots.lend(index, slot)
        else:
            self._collect(index, slot, None)
        if self.replaying:  # what the recorded run started right after this delivery
            self._replay_start()
        return batch, {"storing_device": self.config.storing_devices[index]}

    def _record(self, index: int, info: dict, outcome: str) -> None:
        if self.schedule is not None:
            self.schedule.batch(index, version=info["meta"]["version_min"],
                                random=self.sent_random.get((index, info["slot"]), False), outcome=outcome)

    def note_seed(self, seed: int) -> None:
        if self.schedule is not None:
            self.schedule.seed(seed)

    def close(self) -> None:
        if self.schedule is not None:
            self.schedule.close()

    def _account(self, index: int, info: dict, started: float, version: int) -> None:
        self.stats.note_batch([(index, info)], version, self.waited, started=started)
        self.waited = 0.0

    def _poll(self, random: bool | None) -> None:
        """Read every reply that is waiting (workers in rotating order, for fairness), so that
        a failure surfaces at once. A failed worker is restarted when allowed; the batches it
        was filling are lost and collected anew (``random``: acting randomly), the ones it had
        finished stay queued."""
        pool, n, timeout_s = self.pool, self.num_workers, self.config.worker_timeout
        busy = [i for i in range(n) if pool.busy(i)]
        if not busy:
            raise RuntimeError("no worker is collecting")
        timeout = None
        if timeout_s is not None:
            first_deadline = min(self.progress[i] for i in busy) + timeout_s
            timeout = max(0.0, first_deadline - time.monotonic())
        try:
            ready = pool.ready(busy, timeout)
            if timeout_s is not None:
                now = time.monotonic()
                late = [i for i in busy if i not in ready and now - self.progress[i] > timeout_s]
                if late:
                    raise pool.timed_out(late[0], timeout_s)
        except Exception as err:
            self._fail(err, random)
            return
        ready.sort(key=lambda i: (i - self.rotation) % n)
        if ready:
            self.rotation = ready[0] + 1
        for index in ready:
            command = pool.next_reply(index)
            try:
                value = pool.receive(index)
            except Exception as err:
                self._fail(err, random)
                continue
            self.progress[index] = time.monotonic()
            if command == P.COLLECT:
                self.in_flight[index].discard(value["slot"])
                self.ready.append((index, value))

    def _fail(self, err: Exception, random: bool | None, unsent: int | None = None) -> None:
        """Worker ``index`` failed: restarted (when allowed) and the batches it was filling
        (all but ``unsent``, which it was never given) counted lost and collected anew."""
        index = getattr(err, "worker_index", None)
        if index is None or not 0 <= index < self.num_workers or self.replaying:
            raise err  # (replaying: only the recorded restarts can be replayed)
        if self.schedule is not None:
            self.schedule.restart(index, pending=sum(1 for i, _ in self.ready if i == index))
        lost = sorted(self.in_flight[index])
        self.in_flight[index].clear()
        self.restarts.recover(index, err)
        self.stats.note_lost(index, len([slot for slot in lost if slot != unsent]))
        for slot in lost:
            self._collect(index, slot, random, needed_only=False, again=True)

    def quiesce(self) -> None:
        """Collect every reply still owed; finished batches stay queued for delivery."""
        while any(self.pool.busy(i) for i in range(self.num_workers)):
            self._poll(None)

    def discard(self) -> None:
        self.quiesce()
        self.ready.clear()
        self.order.clear()
        self.parked.clear()
        for slots in self.in_flight:
            slots.clear()
        self.random_asked -= len(self.random_pending)  # asked again when the workers are armed
        self.random_pending.clear()
        self.armed = False

    # -- nesting: a MultiAsyncCollector running inside another collector's worker -----------------
    def layout(self) -> BatchLayout:
        """The layout of one delivered batch (every worker's batches must have the same shape)."""
        if len({(tuple(lay.batch_size), lay.time) for lay in self.layouts}) > 1:
            raise ValueError("a nested MultiAsyncCollector needs every worker's batch to have the same shape")
        first = self.layouts[0]
        return BatchLayout({**first.fields, WORKER_ID: ArraySpec((), np.dtype(np.int64))}, first.batch_size, first.time)

    def collect_into(self, buf: Any, random: bool, version: int) -> int:
        """Copy the next ready batch straight into ``buf``; returns its frames."""
        index, info, started = self._take_fresh(random, version, lending=False)
        for key, tensor in self.slots.buffer(index, info["slot"]).tensors.items():
            buf.tensors[key].copy_(tensor)
        buf.tensors[WORKER_ID].fill_(index)
        self.release()
        self._account(index, info, started, version)
        self._collect(index, info["slot"], random)
        return info["frames"]
