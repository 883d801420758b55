"""The statistics of the multi-process collectors: what each batch's worker replies tell
(frames, versions, env-step latency; rlcollect/metrics.py) and ``stats()``."""

from __future__ import annotations

import time
from typing import Any

from rlcollect.metrics import batch_meta, merge_meta, policy_lag, stats_keys, worker_keys


class WorkerStats:
    """Mixin of ``MultiCollectorBase``: per-batch accounting of the workers' replies and ``stats()``."""

    def _note_batch(self, parts: list[tuple[int, dict]]) -> None:
        """Account for the worker replies ``(worker, info)`` one batch is made of: per-worker
        frames, versions and env-step latency, and the batch's policy lag."""
        metas = []
        for i, info in parts:
            meta = info["meta"]
            self._worker_frames[i] += info["frames"]
            self._worker_versions[i] = info["version"]
            self._worker_steps[i] = (meta["step_mean_s"], meta["step_p95_s"])
            metas.append(meta)
        self._last_meta = merge_meta(metas)
        self._lag = policy_lag(self._version, metas)

    def batch_info(self) -> dict:
        """The last batch filled for an outer collector (this one nested in a worker or node):
        its frames' versions, and the env-step latency over every worker (the mean of their
        means, the largest of their p95s)."""
        steps = merge_meta([batch_meta(0, 0, 0.0, step) for step in self._worker_steps])
        return {**self._last_meta, "step_mean_s": steps["step_mean_s"], "step_p95_s": steps["step_p95_s"]}

    def stats(self) -> dict[str, Any]:
        """JSON-serialisable statistics: frames, rates, per-worker frames, liveness, restarts,
        versions and env-step latency, the last batch's policy lag, time blocked waiting for the
        workers (docs/observability.md defines every key).

        Example:
            >>> from rlcollect import MultiSyncCollector
            >>> with MultiSyncCollector("CartPole-v1", num_workers=2, frames_per_batch=20, total_frames=20) as c:
            ...     _ = list(c)
            ...     s = c.stats()
            >>> s["frames"], s["policy_lag_mean"], [w["env_step_p95_s"] > 0 for w in s["workers"]]
            (20, 0.0, [True, True])
        """
        if self._running_free and not self._closed:
            with self._guard():
                self._check_running_free()
        elapsed = time.perf_counter() - self._started_at
        alive = self._pool.alive() if self._pool is not None and not self._closed else [False] * self.num_workers
        workers = [worker_keys(i, frames=self._worker_frames[i], alive=alive[i], restarts=self._restart.counts[i],
                               version=self._worker_versions[i], step=self._worker_steps[i])
                   for i in range(self.num_workers)]
        return stats_keys(
            frames=self._frames, batches=self._iter, elapsed=elapsed,
            recent_fps=self._last_batch_frames / self._last_batch_s if self._last_batch_s else 0.0,
            version=self._version, workers=workers, restarts=sum(self._restart.counts), dropped_frames=self._dropped,
            replay_buffer_write_count=getattr(self.replay_buffer, "write_count", None), lag=self._lag, wait=self._wait)
