"""``StatsWatcher``: log a collector's ``stats()`` every few seconds from a thread of its own,
for collection that no loop of the caller's sees batch by batch (``start()``: the collector
runs free into a replay buffer while the caller trains)."""

from __future__ import annotations

import threading
from typing import Any


class StatsWatcher:
    """Calls ``logger.log(collector)`` every ``every_s`` seconds in a daemon thread.

    Made by :meth:`rlcollect.loggers.StatsLogger.watch`. ``stop()`` (or leaving the ``with``
    block) ends the thread, logs one last point, and re-raises an error a point hit (the
    thread stops at the first one).

    Args:
        logger: the :class:`~rlcollect.loggers.StatsLogger` that writes each point.
        collector: what is logged (anything with ``stats()``).
        every_s: seconds between two points (a positive number).

    Example:
        >>> from rlcollect import Collector, ReplayBuffer
        >>> from rlcollect.loggers import StatsLogger
        >>> class Points(StatsLogger):
        ...     steps = []
        ...     def write(self, values, step):
        ...         self.steps.append(step)
        ...     def close(self):
        ...         pass
        >>> rb = ReplayBuffer(1000)
        >>> c = Collector("CartPole-v1", frames_per_batch=100, replay_buffer=rb)
        >>> logger = Points()
        >>> c.start()
        >>> watcher = logger.watch(c, every_s=0.01)
        >>> with c.pause():  # no frame is written in this block
        ...     watcher.stop()
        ...     logger.steps[-1] == c.stats()["frames"]
        True
        >>> c.async_shutdown(); rb.close()
    """

    def __init__(self, logger: Any, collector: Any, *, every_s: float = 10.0):
        if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or not every_s > 0:
            raise ValueError(f"every_s must be a positive number of seconds, got {every_s!r}")
        if not callable(getattr(collector, "stats", None)):
            raise TypeError(f"watch() takes a collector (anything with stats()), got {type(collector).__name__}")
        self.logger = logger
        self.collector = collector
        self.every_s = float(every_s)
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rlcollect-stats-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stopping.wait(self.every_s):
                self.logger.log(self.collector)
        except BaseException as exc:  # noqa: BLE001  (re-raised by stop(), in the caller's thread)
            self.error = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """End the thread, log one last point and re-raise the error a point hit. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self._thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        self.logger.log(self.collector)

    def __enter__(self) -> StatsWatcher:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
