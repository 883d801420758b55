"""``MultiSyncCollector``: every batch holds one contribution from every worker, all collected
with the same weights.

When the workers' batches have the same layout and are stacked (or concatenated along their
first dim), the workers write into one *stacked* shared slot and the delivered batch is a view
of it: nothing is copied in the main process. The user's batch is never overwritten: two
stacked slots take turns, and a slot is reused only once nothing outside the collector refers to
its memory any more. When the user still holds both, the workers write into a third, reserve
slot and the batch is copied out of it, as every batch was before (a slot is one file
descriptor: batches kept by the hundred must not each hold one).
"""

from __future__ import annotations

import gc
import math
import time

import torch
from tensordict import TensorDict

from rlcollect.data import MASK, BatchBuffer, BatchLayout, SlotPart, slot_buffer, stacked_tensors
from rlcollect.errors import WorkerError
from rlcollect.metrics import policy_lag
from rlcollect.multiprocess import protocol as P
from rlcollect.multiprocess.base import MultiCollectorBase
from rlcollect.multiprocess import shm
from rlcollect.multiprocess.shm import allocate_stacked, check_free_space, references, slot_bytes

#: Stacked slots kept: the batch the user holds while the next one is collected, and that one.
STACKED_SLOTS = 2


class MultiSyncCollector(MultiCollectorBase):
    """Run a collector in each of ``num_workers`` processes and yield their batches together.

    Each batch holds exactly one contribution from every worker, collected with the same
    weights (an update made between batches is seen by every frame of the next batch).
    Workers write into shared memory allocated once; only short messages cross the pipes.

    With ``cat_results="stack"`` (default) a batch has shape ``(N, *env_batch, T)``; ``0``
    concatenates the workers' batches along the first dim, ``-1`` along time.
    ``preemptive_threshold=p``: once a fraction ``p`` of the workers delivered, the others stop
    at their next step; their unfilled frames are masked (``("collector", "mask")`` False,
    traj id -1) with "stack", or dropped with an int ``cat_results`` (counted in
    ``stats()["dropped_frames"]``).

    Takes every ``Collector`` argument (per-worker lists allowed for devices, env kwargs,
    policy factories and ``frames_per_batch``) plus the multi-process options of docs/multiprocess.md.

    Example:
        >>> from rlcollect import MultiSyncCollector
        >>> with MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=200, total_frames=400) as c:
        ...     shapes = [batch.shape for batch in c]
        >>> shapes
        [torch.Size([2, 100]), torch.Size([2, 100])]
    """

    _sync = True
    _slots_per_worker = 1

    def _allocate_slots(self) -> None:
        self._check_layouts()  # before anything is allocated
        first = self.layouts[0]
        # A view needs one layout for all and a gather that is a stack (or a cat along dim 0);
        # workers that write into a replay buffer deliver nothing.
        self._stacked = (shm.can_count_references() and not self._workers_write
                         and all(lay == first for lay in self.layouts[1:])
                         and (self.cat_results == "stack" or (self._cat_dim == 0 and self.preemptive_threshold is None
                                                               and len(first.batch_size) > 0)))
        self._set = 0  # the slot (of each worker) the next batch is collected into
        if not self._stacked:
            super()._allocate_slots()
            return
        n = self.num_workers
        check_free_space(STACKED_SLOTS * n * slot_bytes(first),
                         f"the batch slots of {n} workers ({STACKED_SLOTS} shared stacked slots)")
        self._slots = [[] for _ in range(n)]
        self._buffers = [[] for _ in range(n)]
        self._sets: list[tuple[torch.Tensor, int]] = []  # (flat slot, its references in the collector)
        for _ in range(STACKED_SLOTS):
            self._new_set()

    def _new_set(self) -> None:
        """Allocate one more stacked slot (index ``len(self._sets)``) for every worker."""
        layout, n = self.layouts[0], self.num_workers
        flat = allocate_stacked(layout, n)
        for i in range(n):
            part = SlotPart(flat, i, n)
            self._slots[i].append(part)
            self._buffers[i].append(slot_buffer(part, layout))
        self._sets.append((flat, references(flat)))

    def _pick_set(self) -> None:
        """Choose the stacked slot the next batch goes into: one no delivered batch refers to."""
        order = [(self._set + k) % STACKED_SLOTS for k in range(1, STACKED_SLOTS + 1)]  # the other one first
        for attempt in range(2):
            for s in order:
                flat, own = self._sets[s]
                if references(flat) <= own:
                    self._set = s
                    return
            if attempt == 0:
                gc.collect()  # a batch in a reference cycle is only freed by the collector
        # The user holds every slot: collect into the reserve (handed to the workers once) and copy.
        if len(self._sets) == STACKED_SLOTS:
            check_free_space(self.num_workers * slot_bytes(self.layouts[0]), "the reserve batch slot")
            self._new_set()
            for i in range(self.num_workers):
                try:
                    self._attach_worker(i)
                except WorkerError as err:  # it died meanwhile: its replacement is attached to the reserve too
                    if err.worker_index != i:
                        raise
                    self._restarts.recover(i, err)
        self._set = STACKED_SLOTS

    def _check_layouts(self) -> None:
        shapes = {(tuple(lay.batch_size), lay.time) for lay in self.layouts}
        keys = {tuple(sorted(map(str, lay.fields))) for lay in self.layouts}
        if len(keys) > 1:
            raise ValueError("the workers' batches hold different keys; they cannot be combined into one batch")
        if self.cat_results == "stack" and len(shapes) > 1:
            raise ValueError(
                f"cat_results='stack' needs every worker's batch to have the same shape, got {sorted(shapes)}; "
                "use cat_results=0 (same T) or -1 (same env batch size)"
            )
        self._cat_dim = None
        if self.cat_results != "stack":
            dims = {len(b) + 1 for b, _ in shapes}
            ndim = min(dims)
            if len(dims) > 1 or not -ndim <= self.cat_results < ndim:
                raise ValueError(f"cat_results={self.cat_results} is not a dim of the workers' batches (shapes "
                                 f"{sorted(shapes)}, {ndim} dims: give one in {-ndim}..{ndim - 1})")
            dim = self.cat_results % ndim
            # 0 keeps its meaning of "along the first dim, same T"; the last dim is time
            self._cat_dim = -1 if dim == ndim - 1 and self.cat_results != 0 else dim
            full = {(*b, t) for b, t in shapes}
            if len({s[:dim] + s[dim + 1:] for s in full}) > 1:
                raise ValueError(f"cat_results={self.cat_results} needs the workers' batches to agree on every dim "
                                 f"but dim {dim}, got {sorted(shapes)}")

    def _next_batch(self) -> TensorDict | None:
        with self._guard():
            if self.update_at_each_batch and self._weight_source is not None:
                self.update_policy_weights_()
            started = time.perf_counter()
            infos = self._collect_all(self._random_now())
            self._stats.wait.add(time.perf_counter() - started)
            if self._workers_write:  # the workers put their parts into the replay buffer
                self._account(infos)
                self._stats.last_batch_s = time.perf_counter() - started
                self._iter += 1
                return None
            batch = self._gather(infos)
            self._stats.last_batch_s = time.perf_counter() - started
        self._iter += 1
        return self._deliver(batch, stacked_workers=self.cat_results == "stack")

    def _account(self, infos: list[dict]) -> int:
        valid = sum(info["frames"] for info in infos)
        self._stats.note_batch(list(enumerate(infos)), self._version)
        self._frames += valid
        self._stats.last_batch_frames = valid
        return valid

    def _collect_all(self, random: bool) -> list[dict]:
        """One batch from every worker (acting randomly when ``random``). A worker that fails is
        restarted (when allowed) and its share is collected again, so a batch never mixes
        frames from before and after."""
        pool, n = self._pool, self.num_workers
        if self._stacked:
            self._pick_set()
        for stop in self._stops:
            stop[0] = 0
        deadlines: dict[int, float] = {}

        def start(i: int) -> None:
            pool.send(i, P.COLLECT, self._set, random)
            if self.worker_timeout is not None:
                deadlines[i] = time.monotonic() + self.worker_timeout

        def start_or_recover(i: int) -> None:
            """``start(i)``; a worker found dead by it (killed since its last batch) is replaced
            first, as often as the restart policy allows."""
            while True:
                try:
                    start(i)
                    return
                except WorkerError as err:
                    if err.worker_index != i:
                        raise
                    self._restarts.recover(i, err)

        for i in range(n):
            start_or_recover(i)
        need = n if self.preemptive_threshold is None else max(1, math.ceil(self.preemptive_threshold * n))
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
                    raise pool.timed_out(late, self.worker_timeout)
                for i in ready:
                    infos[i] = pool.receive(i)
                    waiting.remove(i)
            except Exception as err:
                index = getattr(err, "worker_index", None)
                if index not in waiting:
                    raise
                self._restarts.recover(index, err)
                start_or_recover(index)
            if self.preemptive_threshold is not None and n - len(waiting) >= need:
                for i in waiting:
                    self._stops[i][0] = 1
        return infos

    def _gather(self, infos: list[dict]) -> TensorDict:
        valid = self._account(infos)
        if self._stacked:  # the batch is a view of the stacked slot the workers wrote
            layout, n = self.layouts[0], self.num_workers
            flat = self._sets[self._set][0]
            size = (n, *layout.batch_size) if self.cat_results == "stack" else \
                (n * layout.batch_size[0], *layout.batch_size[1:])
            batch = BatchBuffer(BatchLayout(layout.fields, torch.Size(size), layout.time),
                                tensors=stacked_tensors(flat, layout, n)).td
            if self._set == STACKED_SLOTS:  # the reserve: the batch is copied out
                batch = batch.clone()
            batch.names = [None] * (batch.batch_dims - 1) + ["time"]
            return batch
        tds = [buffers[self._set].td for buffers in self._buffers]
        if self.cat_results == "stack":
            batch = torch.stack(tds, 0)
        else:
            if self.preemptive_threshold is not None:
                steps = [int(info["frames"] // max(1, lay.rows)) for info, lay in zip(infos, self.layouts)]
                if self._cat_dim != -1:
                    keep = min(steps)
                    dropped = valid - sum(keep * lay.rows for lay in self.layouts)
                    self._stats.dropped += dropped  # counted out: only delivered frames count
                    self._frames -= dropped
                    self._stats.last_batch_frames -= dropped
                    steps = [keep] * len(steps)
                    # the lag over the frames delivered: the first `keep` steps of each worker
                    self._stats.lag = policy_lag(self._version, [{**info["meta"], "frames": keep * lay.rows}
                                                           for info, lay in zip(infos, self.layouts)])
                tds = [td[..., :s] for td, s in zip(tds, steps)]
                tds = [td.exclude(MASK) for td in tds]
            batch = torch.cat(tds, self._cat_dim)
        batch.names = [None] * (batch.batch_dims - 1) + ["time"]
        return batch

    def _shutdown(self, timeout: float) -> None:
        super()._shutdown(timeout)
        self._sets = []  # (a delivered batch the user still holds keeps its own slot alive)

    # -- nesting: a MultiSyncCollector running inside another collector's worker ------------------
    @property
    def layout(self) -> BatchLayout:
        """The layout of one stacked batch (only for ``cat_results="stack"``)."""
        if self.cat_results != "stack":
            raise ValueError("a nested MultiSyncCollector needs cat_results='stack'")
        first = self.layouts[0]
        return BatchLayout(dict(first.fields), (self.num_workers, *first.batch_size), first.time)

    def collect_into(self, buf, random: bool = False, stop=None) -> int:
        """Collect one stacked batch straight into ``buf`` (the outer worker's shared slot);
        ``stop`` is not watched (each inner worker has its own)."""
        with self._guard():
            infos = self._collect_all(random)
            rows = self.layouts[0].rows
            for i, buffers in enumerate(self._buffers):
                for key, tensor in buffers[self._set].tensors.items():
                    buf.tensors[key][i * rows:(i + 1) * rows].copy_(tensor)
            valid = sum(info["frames"] for info in infos)
            self._stats.note_batch(list(enumerate(infos)), self._version)
        self._frames += valid
        self._iter += 1
        return valid

