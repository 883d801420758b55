"""``TensorBoardLogger``: a collector's ``stats()`` as TensorBoard scalars.

Needs the ``tensorboard`` package (``pip install 'rlcollect[tensorboard]'``); it writes through
``torch.utils.tensorboard.SummaryWriter``. The scalar names are those of
:func:`rlcollect.loggers.base.scalars`.
"""

from __future__ import annotations

import os

from rlcollect.loggers.base import StatsLogger

_MISSING = ("TensorBoardLogger needs the tensorboard package, which rlcollect does not install by default: "
            "pip install 'rlcollect[tensorboard]' (or pip install tensorboard)")


def _summary_writer() -> type:
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard imports it, with a vaguer error)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as err:
        raise ImportError(_MISSING) from err
    return SummaryWriter


class TensorBoardLogger(StatsLogger):
    """Write a collector's ``stats()`` to TensorBoard event files in ``log_dir``.

    Args:
        log_dir: the folder of the event files (created if missing); point ``tensorboard
            --logdir`` at it or at a folder above it.
        prefix: the tag prefix of every scalar (default ``"collector"``).
        flush_secs: how often the writer flushes to disk (``SummaryWriter``'s).

    ``log(collector_or_stats, step=None)`` takes a collector (its ``stats()`` is read) or a
    ``stats()`` dict; ``step`` defaults to the frames collected so far; ``watch(collector)``
    logs every few seconds from a thread (:class:`~rlcollect.loggers.StatsLogger`). ``writer``
    is the ``SummaryWriter``, for your own scalars (returns, losses) in the same run.

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
        super().__init__(prefix=prefix)
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or not flush_secs > 0:
            raise ValueError(f"flush_secs must be a positive number of seconds, got {flush_secs!r}")
        self.log_dir = os.fspath(log_dir)
        self.writer = _summary_writer()(log_dir=self.log_dir, flush_secs=flush_secs)

    def write(self, values: dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file. Idempotent."""
        self.writer.close()
