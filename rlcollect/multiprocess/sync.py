"""``MultiSyncCollector``: every batch holds one contribution from every worker, all collected
with the same weights."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from tensordict import TensorDict

from rlcollect.data import MASK, BatchLayout
from rlcollect.metrics import policy_lag
from rlcollect.multiprocess import protocol as P
from rlcollect.multiprocess.base import MultiCollectorBase


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
    policy factories and ``frames_per_batch``) plus the multi-process options of SPEC 5.

    Example:
        >>> from rlcollect import MultiSyncCollector
        >>> with MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=200, total_frames=400) as c:
        ...     shapes = [batch.shape for batch in c]
        >>> shapes
        [torch.Size([2, 100]), torch.Size([2, 100])]
    """

    _sync = True
    _slots_per_worker = 1

    def _check_cat_results(self, value: Any) -> str | int:
        if value is None:
            return "stack"
        if value == "stack" or (isinstance(value, int) and not isinstance(value, bool)):
            return value  # an int dim is checked against the workers' batch dims once they report them
        raise ValueError(f"cat_results must be 'stack' or an int dim of the workers' batches (0, -1, ...), got {value!r}")

    def _attach(self) -> None:
        super()._attach()
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
            infos = self._collect_all()
            self._wait.add(time.perf_counter() - started)
            if self._workers_write:  # the workers put their parts into the replay buffer
                self._account(infos)
                self._last_batch_s = time.perf_counter() - started
                self._iter += 1
                return None
            batch = self._gather(infos)
            self._last_batch_s = time.perf_counter() - started
        self._iter += 1
        return self._deliver(batch, stacked_workers=self.cat_results == "stack")

    def _account(self, infos: list[dict]) -> int:
        valid = sum(info["frames"] for info in infos)
        self._note_batch(list(enumerate(infos)))
        self._frames += valid
        self._last_batch_frames = valid
        return valid

    def _collect_all(self) -> list[dict]:
        """One batch from every worker. A worker that fails is restarted (when allowed) and its
        share is collected again, so a batch never mixes frames from before and after."""
        pool, n = self._pool, self.num_workers
        random = self._random_now()
        for stop in self._stops:
            stop[0] = 0
        deadlines: dict[int, float] = {}

        def start(i: int) -> None:
            pool.send(i, P.COLLECT, 0, random)
            if self.worker_timeout is not None:
                deadlines[i] = time.monotonic() + self.worker_timeout

        for i in range(n):
            start(i)
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
                self._recover(index, err)
                start(index)
            if self.preemptive_threshold is not None and n - len(waiting) >= need:
                for i in waiting:
                    self._stops[i][0] = 1
        return infos

    def _gather(self, infos: list[dict]) -> TensorDict:
        tds = [buffers[0].td for buffers in self._buffers]
        valid = self._account(infos)
        if self.cat_results == "stack":
            batch = torch.stack(tds, 0)
        else:
            if self.preemptive_threshold is not None:
                steps = [int(info["frames"] // max(1, lay.rows)) for info, lay in zip(infos, self.layouts)]
                if self._cat_dim != -1:
                    keep = min(steps)
                    dropped = valid - sum(keep * lay.rows for lay in self.layouts)
                    self._dropped += dropped  # counted out: only delivered frames count
                    self._frames -= dropped
                    self._last_batch_frames -= dropped
                    steps = [keep] * len(steps)
                    # the lag over the frames delivered: the first `keep` steps of each worker
                    self._lag = policy_lag(self._version, [{**info["meta"], "frames": keep * lay.rows}
                                                           for info, lay in zip(infos, self.layouts)])
                tds = [td[..., :s] for td, s in zip(tds, steps)]
                tds = [td.exclude(MASK) for td in tds]
            batch = torch.cat(tds, self._cat_dim)
        batch.names = [None] * (batch.batch_dims - 1) + ["time"]
        return batch

    # -- nesting: a MultiSyncCollector running inside another collector's worker ------------------
    @property
    def layout(self) -> BatchLayout:
        """The layout of one stacked batch (only for ``cat_results="stack"``)."""
        if self.cat_results != "stack":
            raise ValueError("a nested MultiSyncCollector needs cat_results='stack'")
        first = self.layouts[0]
        return BatchLayout(dict(first.fields), (self.num_workers, *first.batch_size), first.time)

    def _collect_into(self, buf, random: bool = False, stop=None) -> int:
        """Collect one stacked batch straight into ``buf`` (the outer worker's shared slot)."""
        with self._guard():
            self.init_random_frames = self._frames + 1 if random else 0
            infos = self._collect_all()
            rows = self.layouts[0].rows
            for i, buffers in enumerate(self._buffers):
                for key, tensor in buffers[0].tensors.items():
                    buf.tensors[key][i * rows:(i + 1) * rows].copy_(tensor)
            valid = sum(info["frames"] for info in infos)
            self._note_batch(list(enumerate(infos)))
        self._frames += valid
        self._iter += 1
        return valid

