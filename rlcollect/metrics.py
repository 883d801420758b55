"""What the collectors measure for ``stats()`` beyond counting frames: env-step latency, policy
lag and time blocked waiting (docs/observability.md defines every key).

Env-step latency is measured where the env is stepped (the worker process, the node, or the
``Collector``'s own process): the rollout times each env step into one float of a per-batch
array (two ``perf_counter`` calls), and :class:`StepTimes` keeps the last ``STEP_WINDOW`` of
them. Its summary travels with the batch metadata the worker sends anyway, never in a message
of its own.

Policy lag compares the trainer's weights version when a batch is delivered with the version
each of its frames was collected with (what ``("collector", "policy_version")`` records). A
collector that fills a batch for an outer one (a worker's, a node's) reports the versions of
that batch's frames in :func:`batch_meta` form, so that the outer collector counts the frames'
real versions and not the version its inner collector holds now (an inner async collector
may deliver a batch it started before the last update).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

#: Env steps each latency summary covers: the most recent ones of that env.
STEP_WINDOW = 1024

#: The keys of :func:`batch_meta`, sent with each batch by workers and nodes.
META_KEYS = ("frames", "version_min", "version_mean", "step_mean_s", "step_p95_s")


class StepTimes:
    """The durations (seconds) of an env's last ``size`` steps, in a ring.

    Example:
        >>> import numpy as np
        >>> times = StepTimes(size=4)
        >>> times.add(np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
        >>> times.summary()
        (3.5, 5.0)
    """

    def __init__(self, size: int = STEP_WINDOW):
        self._ring = np.zeros(size, np.float64)
        self._next = 0
        self._count = 0
        self._summary: tuple[float | None, float | None] = (None, None)
        self._fresh = True

    def add(self, seconds) -> None:
        """Append one batch's step durations (a sequence of floats; the oldest fall out of the
        window)."""
        ring, size = self._ring, len(self._ring)
        if len(seconds) > size:
            seconds = seconds[len(seconds) - size:]  # only these stay: convert no more
        n = len(seconds)
        if not n:
            return
        seconds = np.asarray(seconds, np.float64)
        if n >= size:
            ring[:] = seconds[n - size:]
            self._next, self._count = 0, size
        else:
            first = min(n, size - self._next)
            ring[self._next:self._next + first] = seconds[:first]
            ring[:n - first] = seconds[first:]
            self._next = (self._next + n) % size
            self._count = min(size, self._count + n)
        self._fresh = False

    def summary(self) -> tuple[float | None, float | None]:
        """``(mean, p95)`` in seconds over the window (nearest-rank p95: the smallest duration
        that at least 95% of the steps do not exceed); ``(None, None)`` before the first step."""
        if self._fresh:
            return self._summary
        window = self._ring[:self._count]
        k = max(0, math.ceil(0.95 * self._count) - 1)
        self._summary = (float(window.mean()), float(np.partition(window, k)[k]))
        self._fresh = True
        return self._summary


def batch_meta(frames: int, version_min: int, version_mean: float,
               step: tuple[float | None, float | None]) -> dict:
    """The metadata of one collected batch that an outer collector accounts for: its valid
    frames, the lowest and the frame-weighted mean policy version of those frames, and the
    env-step latency ``(mean, p95)`` of the collector that filled it."""
    return {"frames": int(frames), "version_min": int(version_min), "version_mean": float(version_mean),
            "step_mean_s": step[0], "step_p95_s": step[1]}


def merge_meta(parts: Iterable[dict]) -> dict:
    """One batch made of ``parts`` (each a :func:`batch_meta`): versions over all their frames;
    latency: the mean of the parts' means and the largest of their p95s (a worker's window is
    not sent, so the exact p95 of the union is not known)."""
    parts = list(parts)
    frames = sum(p["frames"] for p in parts)
    weighted = [p for p in parts if p["frames"]] or parts
    weight = sum(p["frames"] for p in weighted)
    if weight:
        mean = sum(p["frames"] * p["version_mean"] for p in weighted) / weight
    else:
        mean = sum(p["version_mean"] for p in weighted) / max(1, len(weighted))
    means = [p["step_mean_s"] for p in parts if p["step_mean_s"] is not None]
    p95s = [p["step_p95_s"] for p in parts if p["step_p95_s"] is not None]
    return {"frames": frames, "version_min": min((p["version_min"] for p in weighted), default=0),
            "version_mean": float(mean), "step_mean_s": sum(means) / len(means) if means else None,
            "step_p95_s": max(p95s) if p95s else None}


def policy_lag(trainer_version: int, parts: Iterable[dict]) -> tuple[float, int]:
    """``(mean, max)`` over the valid frames of one delivered batch of ``trainer_version -
    frame version``; ``parts`` are the :func:`batch_meta` of the pieces it is made of (a part
    may carry fewer frames than it collected: only delivered frames count). ``(0.0, 0)`` for a
    batch without valid frames.

    Example:
        >>> parts = [batch_meta(4, 3, 3.0, (None, None)), batch_meta(12, 2, 2.0, (None, None))]
        >>> policy_lag(3, parts)
        (0.75, 1)
    """
    parts = [p for p in parts if p["frames"]]
    frames = sum(p["frames"] for p in parts)
    if not frames:
        return 0.0, 0
    mean = sum(p["frames"] * p["version_mean"] for p in parts) / frames
    return float(trainer_version - mean), int(trainer_version - min(p["version_min"] for p in parts))


class BatchClock:
    """Time the main process spent blocked waiting for batches: the last batch's and the total.

    Example:
        >>> clock = BatchClock()
        >>> clock.add(0.5); clock.add(0.25)
        >>> clock.last_s, clock.total_s
        (0.25, 0.75)
    """

    def __init__(self) -> None:
        self.last_s = 0.0
        self.total_s = 0.0

    def add(self, seconds: float) -> None:
        self.last_s = seconds
        self.total_s += seconds


def steady_fps(frames: int, elapsed: float, first_batch: tuple[int, float] | None) -> float | None:
    """Frames/s since the first batch was delivered: ``fps`` without the start-up (workers or
    nodes starting, their imports, the first batch's allocations). ``first_batch`` is
    ``(frames, elapsed)`` when it was delivered; None until a second batch has come.

    Example:
        >>> steady_fps(1000, 3.0, (100, 2.0)), steady_fps(100, 2.0, (100, 2.0)), steady_fps(0, 0.0, None)
        (900.0, None, None)
    """
    if first_batch is None or frames <= first_batch[0] or elapsed <= first_batch[1]:
        return None
    return (frames - first_batch[0]) / (elapsed - first_batch[1])


def stats_keys(*, frames: int, batches: int, elapsed: float, recent_fps: float, version: int,
               workers: list[dict], restarts: int, dropped_frames: int, replay_buffer_write_count: int | None,
               lag: tuple[float, int], wait: BatchClock, first_batch: tuple[int, float] | None = None,
               lag_dropped_frames: int = 0, lost_batches: int = 0) -> dict:
    """The keys every collector's ``stats()`` has (each adds its own after these). The books:
    ``collected_frames`` (every frame that reached the collector: delivered, or dropped for
    ``preemptive_threshold`` or for lag) = ``delivered_frames`` + ``dropped_frames`` +
    ``lag_dropped_frames``; ``lost_batches`` (batches a failed worker or node was filling,
    collected again); ``restarts``."""
    return {
        "frames": frames,
        "batches": batches,
        "elapsed_s": elapsed,
        "fps": frames / elapsed if elapsed else 0.0,
        "fps_steady": steady_fps(frames, elapsed, first_batch),
        "fps_recent": recent_fps,
        "policy_version": version,
        "workers": workers,
        "restarts": restarts,
        "dropped_frames": dropped_frames,
        "collected_frames": frames + dropped_frames + lag_dropped_frames,
        "delivered_frames": frames,
        "lag_dropped_frames": lag_dropped_frames,
        "lost_batches": lost_batches,
        "replay_buffer_write_count": replay_buffer_write_count,
        "policy_lag_mean": lag[0],
        "policy_lag_max": lag[1],
        "mean_policy_lag": lag[0],  # the older name of policy_lag_mean
        "batch_wait_s": wait.last_s,
        "wait_s": wait.total_s,
    }


def worker_keys(index: int, *, frames: int, alive: bool, restarts: int, version: int,
                step: tuple[float | None, float | None], lag_dropped_frames: int = 0, lost_batches: int = 0) -> dict:
    """The keys every entry of ``stats()["workers"]`` has."""
    return {"index": index, "frames": frames, "alive": alive, "restarts": restarts, "policy_version": version,
            "env_step_mean_s": step[0], "env_step_p95_s": step[1], "lag_dropped_frames": lag_dropped_frames,
            "lost_batches": lost_batches}
