"""torch.profiler traces of chosen rollouts (``Collector.enable_profile``).

Example:
    >>> profiler = RolloutProfiler()
    >>> profiler.enable("/tmp/rlcollect_doc_trace.json", rollouts=(1,), profiler_kwargs={}, next_index=0)
    >>> with profiler.scope(0):  # batch 0 is not profiled
    ...     pass
    >>> profiler.wanted
    True
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger("rlcollect")


class RolloutProfiler:
    """Which batches to profile, and where their traces go."""

    def __init__(self) -> None:
        self._profile: dict | None = None

    @property
    def wanted(self) -> bool:
        """Whether a batch is still to be profiled."""
        return self._profile is not None

    def enable(self, path: str | os.PathLike, rollouts: tuple, profiler_kwargs: dict, next_index: int) -> None:
        """Profile the rollouts ``rollouts`` (counted from batch ``next_index``) into ``path``
        (``.N`` appended before the extension when several are)."""
        rollouts = sorted({int(r) for r in rollouts})
        if not rollouts or rollouts[0] < 0:
            raise ValueError(f"rollouts must be non-negative batch indices, got {rollouts!r}")
        self._profile = {"path": os.fspath(path), "at": {next_index + r for r in rollouts},
                         "kwargs": profiler_kwargs, "many": len(rollouts) > 1}

    @contextlib.contextmanager
    def scope(self, index: int) -> Iterator[None]:
        """Around the rollout of batch ``index``: traced when it is one of those chosen."""
        prof = self._profile
        if prof is None or index not in prof["at"]:
            yield
            return
        from torch.profiler import profile

        with profile(**prof["kwargs"]) as p:
            yield
        path = prof["path"]
        if prof["many"]:
            root, ext = os.path.splitext(path)
            path = f"{root}.{index}{ext or '.json'}"
        p.export_chrome_trace(path)
        logger.info("rlcollect: wrote profiler trace of batch %d to %s", index, path)
        prof["at"].discard(index)
        if not prof["at"]:
            self._profile = None
