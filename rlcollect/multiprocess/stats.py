"""The statistics of the multi-process collectors: what each batch's worker replies tell
(frames, versions, env-step latency; rlcollect/metrics.py), gathered for ``stats()``."""

from __future__ import annotations

import time
from typing import Any

from rlcollect.metrics import BatchClock, batch_meta, merge_meta, policy_lag, stats_keys, worker_keys


class WorkerStats:
    """Per-worker accounting of one multi-process collector's batches.

    Example:
        >>> stats = WorkerStats(2)
        >>> meta = batch_meta(4, 1, 1, (0.001, 0.002))
        >>> stats.note_batch([(0, {"frames": 4, "version": 1, "meta": meta})], version=1)
        >>> stats.worker_frames, stats.worker_versions, stats.lag
        ([4, 0], [1, 0], (0.0, 0))
    """

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.frames = 0  # frames collected (delivered, or written by the workers)
        self.batches = 0  # batches yielded (or written)
        self.worker_frames = [0] * num_workers
        self.worker_versions = [0] * num_workers
        self.pushed = [0] * num_workers  # the version last pushed to each worker
        self.worker_steps: list[tuple[float | None, float | None]] = [(None, None)] * num_workers  # env-step mean, p95
        self.lag = (0.0, 0)  # policy lag of the last batch delivered: mean, max
        self.last_meta = batch_meta(0, 0, 0.0, (None, None))  # the last batch, for an outer collector
        self.wait = BatchClock()  # the main process blocked waiting for the workers' batches
        self.dropped = 0  # frames dropped by preemptive_threshold
        self.lag_dropped = [0] * num_workers  # frames dropped for being more than max_policy_lag behind
        self.lag_dropped_since = 0  # ... since the last batch delivered (its metadata)
        self.lost = [0] * num_workers  # batches a failed worker was filling
        self.started_at = time.perf_counter()
        self.last_batch_s = 0.0
        self.last_batch_frames = 0
        self.first_batch: tuple[int, float] | None = None  # (frames, seconds since started_at): fps_steady

    def note_batch(self, parts: list[tuple[int, dict]], version: int, waited: float | None = None, *,
                   started: float | None = None, kept: list[int] | None = None) -> None:
        """Account for the worker replies ``(worker, info)`` one batch is made of: the frames
        collected and delivered, per-worker frames, versions and env-step latency, the batch's
        policy lag behind ``version``, and ``waited``: the seconds the main process waited for
        it (None: not counted). ``started``: when the main process began the batch (its
        seconds, for ``fps_recent``; None: not timed). ``kept``: the frames of each part
        delivered when fewer than collected (``preemptive_threshold`` cut the batch): the rest
        count as dropped, and the lag is over the frames kept."""
        metas = []
        for i, info in parts:
            self.note_worker(i, info)
            metas.append(info["meta"])
        if waited is not None:
            self.wait.add(waited)
        self.last_meta = merge_meta(metas)
        self.lag = policy_lag(version, metas if kept is None else [{**m, "frames": k} for m, k in zip(metas, kept)])
        collected = sum(info["frames"] for _, info in parts)
        delivered = collected if kept is None else sum(kept)
        self.dropped += collected - delivered  # counted out: only delivered frames count
        self.frames += delivered
        self.last_batch_frames = delivered
        if self.first_batch is None:
            self.first_batch = (collected, time.perf_counter() - self.started_at)
        if started is not None:
            self.last_batch_s = time.perf_counter() - started

    def note_worker(self, index: int, info: dict) -> None:
        """A reply of worker ``index`` (a batch, or what it wrote while running free)."""
        meta = info["meta"]
        self.worker_frames[index] += info["frames"]
        self.worker_versions[index] = info["version"]
        self.worker_steps[index] = (meta["step_mean_s"], meta["step_p95_s"])

    def note_frames(self, index: int, frames: int) -> None:
        """Frames worker ``index`` wrote before it failed (no reply of it tells them)."""
        self.worker_frames[index] += frames

    def note_lag_dropped(self, index: int, info: dict) -> None:
        """Worker ``index``'s batch ``info`` was dropped: too far behind the trainer."""
        self.lag_dropped[index] += info["frames"]
        self.lag_dropped_since += info["frames"]

    def take_lag_dropped(self) -> int:
        """The frames dropped for lag since the last call (what the batch delivered now reports)."""
        dropped, self.lag_dropped_since = self.lag_dropped_since, 0
        return dropped

    def note_lost(self, index: int, batches: int) -> None:
        """Worker ``index`` failed while filling ``batches`` batches."""
        self.lost[index] += batches

    def note_pushed(self, workers: Any, version: int) -> None:
        """Weights ``version`` went to ``workers``."""
        for i in workers:
            self.worker_versions[i] = version
            self.pushed[i] = version

    def batch_info(self) -> dict:
        """The last batch filled for an outer collector (this one nested in a worker or node):
        its frames' versions, and the env-step latency over every worker (the mean of their
        means, the largest of their p95s)."""
        steps = merge_meta([batch_meta(0, 0, 0.0, step) for step in self.worker_steps])
        return {**self.last_meta, "step_mean_s": steps["step_mean_s"], "step_p95_s": steps["step_p95_s"]}

    def summary(self, *, frames: int, batches: int, version: int, alive: list[bool], restarts: list[int],
                replay_buffer: Any, written: list[int] | None = None) -> dict[str, Any]:
        """``stats()``'s dict (docs/observability.md defines every key). ``written``: what each
        worker running free has written and not yet reported (added to the frames)."""
        elapsed = time.perf_counter() - self.started_at
        written = written or [0] * self.num_workers
        frames += sum(written)
        workers = [worker_keys(i, frames=self.worker_frames[i] + written[i], alive=alive[i], restarts=restarts[i],
                               version=self.worker_versions[i], step=self.worker_steps[i],
                               lag_dropped_frames=self.lag_dropped[i], lost_batches=self.lost[i])
                   for i in range(self.num_workers)]
        return stats_keys(
            frames=frames, batches=batches, elapsed=elapsed,
            recent_fps=self.last_batch_frames / self.last_batch_s if self.last_batch_s else 0.0,
            version=version, workers=workers, restarts=sum(restarts), dropped_frames=self.dropped,
            replay_buffer_write_count=getattr(replay_buffer, "write_count", None), lag=self.lag, wait=self.wait,
            first_batch=self.first_batch, lag_dropped_frames=sum(self.lag_dropped), lost_batches=sum(self.lost))
