"""``TensorBoardLogger``: a collector's ``stats()`` as TensorBoard scalars.

Needs the ``tensorboard`` package (``pip install 'rlcollect[tensorboard]'``); it writes through
``torch.utils.tensorboard.SummaryWriter``. The scalar names are the ``stats()`` keys
(docs/observability.md) under ``collector/``, and per worker (or node) under
``collector/worker<i>/``; keys that are not numbers (the launcher, an address) and values not
known yet (None) are skipped.
"""

from __future__ import annotations

import math
import os
from typing import Any

#: The ``stats()`` keys written as scalars (each only where the collector has it).
SCALAR_KEYS = (
    "frames", "batches", "fps", "fps_steady", "fps_recent", "policy_version", "restarts", "dropped_frames",
    "replay_buffer_write_count", "policy_lag_mean", "policy_lag_max", "batch_wait_s", "wait_s", "lost_batches",
)
#: The per-worker keys written as scalars.
WORKER_SCALAR_KEYS = ("frames", "alive", "restarts", "policy_version", "env_step_mean_s", "env_step_p95_s")

_MISSING = ("TensorBoardLogger needs the tensorboard package, which rlcollect does not install by default: "
            "pip install 'rlcollect[tensorboard]' (or pip install tensorboard)")


def _summary_writer() -> type:
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard imports it, with a vaguer error)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError(_MISSING) from err
    return SummaryWriter


def scalars(stats: dict[str, Any], prefix: str = "collector") -> dict[str, float]:
    """The scalars :class:`TensorBoardLogger` writes for one ``stats()`` dict, by tag.

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


class TensorBoardLogger:
    """Write a collector's ``stats()`` to TensorBoard event files in ``log_dir``.

    Args:
        log_dir: the folder of the event files (created if missing); point ``tensorboard
            --logdir`` at it or at a folder above it.
        prefix: the tag prefix of every scalar (default ``"collector"``).
        flush_secs: how often the writer flushes to disk (``SummaryWriter``'s).

    ``log(collector_or_stats, step=None)`` takes a collector (its ``stats()`` is read) or a
    ``stats()`` dict; ``step`` defaults to the frames collected so far. ``writer`` is the
    ``SummaryWriter``, for your own scalars (returns, losses) in the same run.

    Example:
        >>> import tempfile
        >>> from rlcollect import Collector, TensorBoardLogger
        >>> collector = Collector("CartPole-v1", frames_per_batch=100, total_frames=300)
        >>> with TensorBoardLogger(tempfile.mkdtemp()) as tb:
        ...     for batch in collector:
        ...         _ = tb.log(collector)
        >>> collector.shutdown()
    """

    def __init__(self, log_dir: str | os.PathLike, *, prefix: str = "collector", flush_secs: float = 30.0):
        if not isinstance(log_dir, (str, os.PathLike)) or not os.fspath(log_dir):
            raise TypeError(f"log_dir must be a folder path (str or os.PathLike), got {log_dir!r}")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"prefix must be a non-empty string, got {prefix!r}")
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or not flush_secs > 0:
            raise ValueError(f"flush_secs must be a positive number of seconds, got {flush_secs!r}")
        self.log_dir = os.fspath(log_dir)
        self.prefix = prefix
        self.writer = _summary_writer()(log_dir=self.log_dir, flush_secs=flush_secs)

    def log(self, collector_or_stats: Any, step: int | None = None) -> dict[str, float]:
        """Write one point of every scalar; returns what was written, by tag."""
        if isinstance(collector_or_stats, dict):
            stats = collector_or_stats
        elif callable(getattr(collector_or_stats, "stats", None)):
            stats = collector_or_stats.stats()
        else:
            raise TypeError("log() takes a collector (anything with stats()) or a stats() dict, got "
                            f"{type(collector_or_stats).__name__}")
        if step is None:
            step = stats.get("frames", 0)
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int (default: the frames collected), got {step!r}")
        values = scalars(stats, self.prefix)
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        return values

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file. Idempotent."""
        self.writer.close()

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
