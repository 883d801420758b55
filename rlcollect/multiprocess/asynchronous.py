"""``MultiAsyncCollector``: batches arrive first-ready-first-served, each from one worker."""

from __future__ import annotations

import collections
import time

import torch
from tensordict import TensorDict

import numpy as np

from rlcollect.data import WORKER_ID, BatchLayout, slot_buffer
from rlcollect.envs.base import ArraySpec
from rlcollect.errors import WorkerError
from rlcollect.multiprocess import protocol as P
from rlcollect.multiprocess import shm
from rlcollect.multiprocess.base import MultiCollectorBase
from rlcollect.multiprocess.shm import references


class MultiAsyncCollector(MultiCollectorBase):
    """Run a collector in each of ``num_workers`` processes and yield each worker's batch as
    soon as it is ready.

    Each worker has three shared-memory slots: the batch you get is a view of the slot the
    worker wrote (nothing is copied), lent to you until you let go of it, while the worker fills
    the other two, so it never waits for the trainer. A worker's slot is never overwritten while
    you hold its batch: when you already hold one batch of that worker, the next one is copied
    out of its slot instead. Every yielded batch is one worker's ``frames_per_batch`` frames
    with ``("collector", "worker_id")``.
    ``set_seed``, ``reset`` and ``load_state_dict`` discard the batches in flight.

    Example:
        >>> from rlcollect import MultiAsyncCollector
        >>> with MultiAsyncCollector("CartPole-v1", num_workers=2, frames_per_batch=100, total_frames=300) as c:
        ...     shapes = [batch.shape for batch in c]
        >>> shapes
        [torch.Size([100]), torch.Size([100]), torch.Size([100])]
    """

    _sync = False
    _slots_per_worker = 3

    def _attach(self) -> None:
        super()._attach()
        self._ready: collections.deque[tuple[int, dict]] = collections.deque()
        self._in_flight: list[set[int]] = [set() for _ in range(self.num_workers)]
        # When each worker last showed progress (a reply, or being given work while idle):
        # worker_timeout is judged per worker, so a hung worker is caught while others deliver.
        self._progress: list[float] = [time.monotonic()] * self.num_workers
        self._armed = False
        self._rotation = 0
        # Batches delivered as views: {slot: the slot's references in the collector}, per worker.
        self._views = shm.can_count_references() and not self._workers_write
        self._own_refs = [[references(flat) for flat in slots] for slots in self._slots]
        self._lent: list[set[int]] = [set() for _ in range(self.num_workers)]

    def _arm(self, random: bool | None) -> None:
        for i in range(self.num_workers):
            for slot in range(self._slots_per_worker):
                if slot not in self._lent[i]:
                    self._collect(i, slot, random)
        self._armed = True

    def _reclaim(self, random: bool | None) -> None:
        """Give the workers back the slots whose batches nothing refers to any more."""
        for i, lent in enumerate(self._lent):
            for slot in list(lent):
                if references(self._slots[i][slot]) <= self._own_refs[i][slot]:
                    lent.discard(slot)
                    if self._armed:
                        self._collect(i, slot, random)

    def _collect(self, index: int, slot: int, random: bool | None, needed_only: bool = True) -> None:
        """Have worker ``index`` fill ``slot``, acting randomly when ``random`` (None: when
        ``init_random_frames`` says so now; a nested collector is told by its worker)."""
        if needed_only and not self._needed():
            return
        if not self._pool.handles[index].pending:
            self._progress[index] = time.monotonic()  # the worker starts working now
        self._in_flight[index].add(slot)
        try:
            self._pool.send(index, P.COLLECT, slot, self._random_now() if random is None else random)
        except WorkerError as err:  # it died since its last batch: replaced, and asked again, as in _poll
            if err.worker_index != index:
                raise
            self._fail(err, random)

    def _needed(self) -> bool:
        """Whether another batch is needed to reach ``total_frames``: the workers never run past
        it (with a replay buffer they write what they collect, so that would write extra)."""
        if self.total_frames < 0:
            return True
        # per worker: frames_per_batch may be one size per worker (torchrl's list)
        sizes = self.config.worker_frames
        coming = sum(len(slots) * sizes[i] for i, slots in enumerate(self._in_flight))
        coming += sum(sizes[index] for index, _ in self._ready)
        return self._frames + coming < self.total_frames

    def _next_batch(self) -> TensorDict | None:
        with self._guard():
            if not self._armed:
                self._arm(None)
            self._reclaim(None)
            started = time.perf_counter()
            while not self._ready:
                self._poll(None)
            self._stats.wait.add(time.perf_counter() - started)
            index, info = self._ready.popleft()
            if self._workers_write:  # the worker put its batch into the replay buffer
                self._account(index, info, started)
                self._collect(index, info["slot"], None)
                self._iter += 1
                return None
            slot = info["slot"]
            # A view of the slot when none of this worker's is lent already (it keeps two filling).
            lend = self._views and not self._lent[index]
            # (fresh views each time: the collector's own views of a slot must not change in number)
            batch = slot_buffer(self._slots[index][slot], self.layouts[index]).td
            if not lend:
                batch = batch.clone()
            batch.set(WORKER_ID, torch.full(batch.shape, index, dtype=torch.int64))
            batch.names = [None] * (batch.batch_dims - 1) + ["time"]
            self._account(index, info, started)
            if self.update_at_each_batch and self._weight_source is not None:
                self._push_to(index)
            if lend:
                self._lent[index].add(slot)
            else:
                self._collect(index, slot, None)
        self._iter += 1
        return self._deliver(batch, worker=index)

    def _account(self, index: int, info: dict, started: float) -> None:
        self._frames += info["frames"]
        self._stats.note_batch([(index, info)], self._version)
        self._stats.last_batch_frames = info["frames"]
        self._stats.last_batch_s = time.perf_counter() - started

    def _push_to(self, index: int) -> None:
        if self._weights.backend == "shared":
            self.update_policy_weights_()
        else:
            self.update_policy_weights_(worker_ids=[index])

    def _poll(self, random: bool | None) -> None:
        """Read every reply that is waiting (workers in rotating order, for fairness), so that
        a failure surfaces at once. A failed worker is restarted when allowed; the batches it
        was filling are lost and collected anew (``random``: acting randomly), the ones it had
        finished stay queued."""
        pool, n = self._pool, self.num_workers
        busy = [i for i in range(n) if pool.handles[i].pending]
        if not busy:
            raise RuntimeError("no worker is collecting")
        timeout = None
        if self.worker_timeout is not None:
            first_deadline = min(self._progress[i] for i in busy) + self.worker_timeout
            timeout = max(0.0, first_deadline - time.monotonic())
        try:
            ready = pool.ready(busy, timeout)
            if self.worker_timeout is not None:
                now = time.monotonic()
                late = [i for i in busy if i not in ready and now - self._progress[i] > self.worker_timeout]
                if late:
                    raise pool.timed_out(late[0], self.worker_timeout)
        except Exception as err:
            self._fail(err, random)
            return
        ready.sort(key=lambda i: (i - self._rotation) % n)
        if ready:
            self._rotation = ready[0] + 1
        for index in ready:
            command = pool.handles[index].pending[0]
            try:
                value = pool.receive(index)
            except Exception as err:
                self._fail(err, random)
                continue
            self._progress[index] = time.monotonic()
            if command == P.COLLECT:
                self._in_flight[index].discard(value["slot"])
                self._ready.append((index, value))

    def _fail(self, err: Exception, random: bool | None) -> None:
        index = getattr(err, "worker_index", None)
        if index is None or not 0 <= index < self.num_workers:
            raise err
        lost = sorted(self._in_flight[index])
        self._in_flight[index].clear()
        self._restarts.recover(index, err)
        for slot in lost:
            self._collect(index, slot, random, needed_only=False)

    def _quiesce(self) -> None:
        """Collect every reply still owed; finished batches stay queued for delivery."""
        while any(h.pending for h in self._pool.handles):
            self._poll(None)

    def _discard_in_flight(self) -> None:
        self._quiesce()
        self._ready.clear()
        for slots in self._in_flight:
            slots.clear()
        self._armed = False

    # -- nesting: a MultiAsyncCollector running inside another collector's worker -----------------
    @property
    def layout(self) -> BatchLayout:
        """The layout of one delivered batch (every worker's batches must have the same shape)."""
        if len({(tuple(lay.batch_size), lay.time) for lay in self.layouts}) > 1:
            raise ValueError("a nested MultiAsyncCollector needs every worker's batch to have the same shape")
        first = self.layouts[0]
        return BatchLayout({**first.fields, WORKER_ID: ArraySpec((), np.dtype(np.int64))}, first.batch_size, first.time)

    def collect_into(self, buf, random: bool = False, stop=None) -> int:
        """Copy the next ready batch straight into ``buf`` (the outer worker's shared slot);
        ``stop`` is not watched (each inner worker has its own)."""
        with self._guard():
            if not self._armed:
                self._arm(random)
            started = time.perf_counter()
            while not self._ready:
                self._poll(random)
            index, info = self._ready.popleft()
            for key, tensor in self._buffers[index][info["slot"]].tensors.items():
                buf.tensors[key].copy_(tensor)
            buf.tensors[WORKER_ID].fill_(index)
            self._account(index, info, started)
            self._collect(index, info["slot"], random)
        self._iter += 1
        return info["frames"]

