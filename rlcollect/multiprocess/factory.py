"""``MultiCollector``: pick the sync or async multi-process collector with one flag."""

from __future__ import annotations

from typing import Any


def MultiCollector(*args: Any, sync: bool = True, **kwargs: Any):
    """``MultiSyncCollector(...)`` when ``sync`` is True, else ``MultiAsyncCollector(...)``.

    Example:
        >>> from rlcollect import MultiCollector
        >>> c = MultiCollector("CartPole-v1", num_workers=2, frames_per_batch=20, sync=False)
        >>> type(c).__name__
        'MultiAsyncCollector'
        >>> c.shutdown()
    """
    from rlcollect.multiprocess.asynchronous import MultiAsyncCollector
    from rlcollect.multiprocess.sync import MultiSyncCollector

    if not isinstance(sync, bool):
        raise TypeError(f"sync must be True or False, got {sync!r}")
    return (MultiSyncCollector if sync else MultiAsyncCollector)(*args, **kwargs)
