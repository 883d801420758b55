"""``AsyncGather``: a ``MultiAsyncCollector``'s workers' batches, first ready, first served, each
batch one worker's (gather.py holds what it shares with ``SyncGather``). Like every gather it
never repairs a failure: it raises ``MemberFailed`` and keeps its state, and the collector's
``Members`` (rlcollect/members.py) has the worker replaced and calls ``recovered``.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from rlcollect.data import WORKER_ID, BatchLayout
from rlcollect.envs.base import ArraySpec
from rlcollect.errors import WorkerError
from rlcollect.members import MemberFailed
from rlcollect.metrics import policy_lag
from rlcollect.multiprocess import protocol as P
from rlcollect.multiprocess.gather import LAG_DROPPED, GatherBase, Update, name_time
from rlcollect.multiprocess.slots import WorkerSlots, can_count_references
from rlcollect.torchrl_args import random_batches


class State(enum.Enum):
    """Where an ``AsyncGather`` is (PufferLib's vector envs keep one such flag)::

        IDLE --(a batch is asked for: every free slot given work)--> COLLECTING
        COLLECTING --(a worker failed: MemberFailed raised)--> RECOVERING
        RECOVERING --(replaced: recovered(), its lost batches asked again)--> COLLECTING
        any --(discard: set_seed, reset, load_state_dict, start)--> IDLE
        any --(close)--> CLOSED

    Only a gather past IDLE gives reclaimed slots work again (IDLE leaves them to the arming)."""

    IDLE = "idle"
    COLLECTING = "collecting"
    RECOVERING = "recovering"
    CLOSED = "closed"


class AsyncGather(GatherBase):
    """Each worker's batches as soon as they are ready (``MultiAsyncCollector``): every worker
    keeps its three slots busy but the one whose batch is lent to the user."""

    SLOTS_PER_WORKER = 3

    @staticmethod
    def make_slots(config: Any, layouts: list[BatchLayout]) -> WorkerSlots:
        return WorkerSlots(layouts, AsyncGather.SLOTS_PER_WORKER)

    def __init__(self, *args: Any, schedule: Any = None, **kwargs: Any):
        """``schedule``: a ``ScheduleRecorder`` (``record``) or ``ScheduleReplay`` (``replay``)
        (schedule.py), or None; the other arguments are ``GatherBase``'s."""
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
        self.state = State.IDLE
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
        # (worker, slot) pairs to give work (arming, reclaimed slots): taken one by one, so that
        # a failure met on the way (MemberFailed) leaves the rest for when the step goes on.
        self.starting: collections.deque[tuple[int, int]] = collections.deque()
        # A failed worker's batches to collect again once it is replaced (``recovered``):
        # ``[slots, lost batches to count, random]``.
        self.redo: dict[int, list] = {}

    def _arm(self, random: bool | None) -> None:
        self.state = State.COLLECTING
        self.starting.extend((i, slot) for slot in range(self.SLOTS_PER_WORKER)  # slot-major: each worker's
                             for i in range(self.num_workers)  # first batch first (the random ones)
                             if not self.slots.is_lent(i, slot))

    def _start(self, random: bool | None) -> None:
        """Give work to the slots ``starting`` holds."""
        while self.starting:
            i, slot = self.starting.popleft()
            self._collect(i, slot, random)

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
        freed = self.slots.reclaim()
        if self.state is not State.IDLE:
            self.starting.extend(freed)

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
                                self._replayed_restart)

    @staticmethod
    def _replayed_restart(index: int) -> None:
        """The recorded run restarted worker ``index`` here: ``Members`` has it replaced."""
        raise MemberFailed(index, WorkerError(f"worker {index} is restarted where the replayed run's was", index))

    def _later(self, step: Callable[..., None], *args: Any) -> None:
        """``step(*args)`` once the batch is taken: a failure it meets is owed (``owed``),
        repaired by ``Members`` before the batch is returned."""
        try:
            step(*args)
        except MemberFailed as failed:
            self.owed = (failed.index, failed.error)

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
        if self.state is State.IDLE:
            self._arm(random)
        if lending:
            self._reclaim(random)
        self._start(random)
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
            self._later(self._collect, index, slot, None)
            return None, {}
        # A view of the slot when none of this worker's is lent already (it keeps two filling).
        lend = self.views and not self.slots.lent(index)
        batch = self.slots.view(index, slot)
        if not lend:
            batch = batch.clone()
        batch.set(WORKER_ID, torch.full(batch.shape, index, dtype=torch.int64))
        if self.bound is not None:
            batch.set(LAG_DROPPED, torch.full(batch.shape, self.stats.take_lag_dropped(), dtype=torch.int64))
        name_time(batch)
        self._account(index, info, started, version)
        if self.config.update_at_each_batch:
            update(index)
        if lend:
            self.slots.lend(index, slot)
        else:
            self._later(self._collect, index, slot, None)
        if self.replaying and self.owed is None:  # what the recorded run started right after this delivery
            self._later(self._replay_start)
        return batch, {"storing_device": self.config.storing_devices[index]}

    def _record(self, index: int, info: dict, outcome: str) -> None:
        if self.schedule is not None:
            self.schedule.batch(index, version=info["meta"]["version_min"],
                                random=self.sent_random.get((index, info["slot"]), False), outcome=outcome)

    def note_seed(self, seed: int) -> None:
        if self.schedule is not None:
            self.schedule.seed(seed)

    def close(self) -> None:
        self.state = State.CLOSED
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
        """Worker ``index`` failed: ``MemberFailed`` is raised; once it is replaced
        (``recovered``) the batches it was filling (all but ``unsent``, which it was never
        given) are counted lost and collected anew."""
        index = getattr(err, "worker_index", None)
        if index is None or not 0 <= index < self.num_workers or self.replaying:
            raise err  # (replaying: only the recorded restarts can be replayed)
        if self.schedule is not None:
            self.schedule.restart(index, pending=sum(1 for i, _ in self.ready if i == index))
        lost = sorted(self.in_flight[index])
        self.in_flight[index].clear()
        again = self.redo.pop(index, None)  # (its replacement failed while given them again)
        slots = sorted({*lost, *(again[0] if again else ())})
        self.redo[index] = [slots, len([slot for slot in lost if slot != unsent]), random]
        self.state = State.RECOVERING
        raise MemberFailed(index, err) from None

    def recovered(self, index: int) -> None:
        """Worker ``index`` was replaced: the batches it was filling are counted lost and
        collected anew."""
        redo = self.redo.get(index)
        if redo is not None:
            slots, lost, random = redo
            redo[1] = 0
            self.stats.note_lost(index, lost)
            while slots:
                self._collect(index, slots.pop(0), random, needed_only=False, again=True)
            del self.redo[index]
        if not self.redo and self.state is State.RECOVERING:
            self.state = State.COLLECTING
        if self.replaying:  # (a recorded restart: what the recording started next)
            self._replay_start()

    def abandon(self) -> None:
        self.redo.clear()
        self.owed = None
        if self.state is State.RECOVERING:
            self.state = State.COLLECTING

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
        self.random_asked -= len(self.random_pending)  # asked again when the workers are given work
        self.random_pending.clear()
        self.starting.clear()
        self.state = State.IDLE

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
        self._later(self._collect, index, info["slot"], random)
        return info["frames"]
