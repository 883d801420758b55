"""``StatsLogger``: the interface the TensorBoard, Weights & Biases and MLflow loggers share.

A logger turns a collector's ``stats()`` into scalars named by tag (:func:`scalars`: the
numeric keys under ``<prefix>/``, per worker or node under ``<prefix>/worker<i>/``) and writes
them with a step (the frames collected so far, unless given). Each backend only says how one
point of scalars is written (``write``) and how its run ends (``close``); reading the stats,
checking the arguments and choosing the step happen here, once for all of them.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

#: The ``stats()`` keys written as scalars (each only where the collector has it).
SCALAR_KEYS = (
    "frames", "batches", "fps", "fps_steady", "fps_recent", "policy_version", "restarts", "dropped_frames",
    "replay_buffer_write_count", "policy_lag_mean", "policy_lag_max", "batch_wait_s", "wait_s", "lost_batches",
)
#: The per-worker keys written as scalars.
WORKER_SCALAR_KEYS = ("frames", "alive", "restarts", "policy_version", "env_step_mean_s", "env_step_p95_s")


def scalars(stats: dict[str, Any], prefix: str = "collector") -> dict[str, float]:
    """The scalars a logger writes for one ``stats()`` dict, by tag: keys that are not numbers
    (the launcher, an address) and values not known yet (None) are left out.

    Example:
        >>> from rlcollect import Collector
        >>> c = Collector("CartPole-v1", frames_per_batch=10, total_frames=10)
        >>> _ = list(c)
        >>> tags = scalars(c.stats())
        >>> tags["collector/frames"], "collector/worker0/env_step_p95_s" in tags
        (10.0, True)
        >>> c.shutdown()
    """
    out = {}

    def put(tag: str, value: Any) -> None:
        if isinstance(value, bool):
            value = float(value)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out[tag] = float(value)

    for key in SCALAR_KEYS:
        put(f"{prefix}/{key}", stats.get(key))
    for worker in stats.get("workers", []):
        for key in WORKER_SCALAR_KEYS:
            put(f"{prefix}/worker{worker['index']}/{key}", worker.get(key))
    return out


def check_prefix(prefix: Any) -> str:
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
    return prefix


def read_stats(collector_or_stats: Any) -> dict[str, Any]:
    """A ``stats()`` dict, or the ``stats()`` of a collector (anything with that method)."""
    if isinstance(collector_or_stats, dict):
        return collector_or_stats
    if callable(getattr(collector_or_stats, "stats", None)):
        return collector_or_stats.stats()
    raise TypeError("log() takes a collector (anything with stats()) or a stats() dict, got "
                    f"{type(collector_or_stats).__name__}")


class StatsLogger(ABC):
    """What every rlcollect logger does: ``log(collector)`` writes one point of the collector's
    ``stats()`` scalars; ``watch(collector)`` does it every few seconds from a thread of its own
    (for a collector running free after ``start()``, where no loop of yours sees each batch);
    ``close()`` ends the run (also on leaving a ``with`` block). ``write(values, step)`` writes
    your own scalars (``{"train/loss": 0.1}``) into the same run.

    A backend subclasses it and defines ``write(values, step)`` and ``close()`` (``flush()`` if
    it buffers); :class:`~rlcollect.TensorBoardLogger`, :class:`~rlcollect.WandbLogger` and
    :class:`~rlcollect.MLflowLogger` are the three rlcollect has.

    Args:
        prefix: the tag prefix of every scalar (default ``"collector"``).

    Example:
        >>> from rlcollect import Collector
        >>> from rlcollect.loggers import StatsLogger
        >>> class PrintLogger(StatsLogger):
        ...     def write(self, values, step):
        ...         print(step, values["collector/frames"])
        ...     def close(self):
        ...         pass
        >>> collector = Collector("CartPole-v1", frames_per_batch=100, total_frames=200)
        >>> with PrintLogger() as logger:
        ...     for batch in collector:
        ...         _ = logger.log(collector)
        100 100.0
        200 200.0
        >>> collector.shutdown()
    """

    def __init__(self, *, prefix: str = "collector"):
        self.prefix = check_prefix(prefix)

    def log(self, collector_or_stats: Any, step: int | None = None) -> dict[str, float]:
        """Write one point of every scalar of ``collector_or_stats`` (a collector, whose
        ``stats()`` is read, or a ``stats()`` dict) at ``step`` (an int; default: the frames
        collected so far); returns what was written, by tag."""
        stats = read_stats(collector_or_stats)
        if step is None:
            step = stats.get("frames", 0)
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int (default: the frames collected), got {step!r}")
        values = scalars(stats, self.prefix)
        self.write(values, step)
        return values

    def watch(self, collector: Any, every_s: float = 10.0) -> Any:
        """Log ``collector`` every ``every_s`` seconds from a daemon thread until the returned
        :class:`~rlcollect.loggers.watch.StatsWatcher` is stopped (``stop()``, or leaving it as
        a ``with`` block; it logs one last point then): stop it before closing this logger and
        before shutting the collector down. The collector's ``stats()`` is read from that
        thread."""
        from rlcollect.loggers.watch import StatsWatcher

        return StatsWatcher(self, collector, every_s=every_s)

    @abstractmethod
    def write(self, values: dict[str, float], step: int) -> None:
        """Write one point: ``values`` by tag, at ``step``."""

    def flush(self) -> None:  # noqa: B027  (optional: only a buffering backend has something to do)
        """Push what is buffered to its destination (nothing to do for an unbuffered backend)."""

    @abstractmethod
    def close(self) -> None:
        """End the run and release what it holds. Idempotent."""

    def __enter__(self) -> StatsLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
