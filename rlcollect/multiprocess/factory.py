"""``MultiCollector``: pick the sync or async multi-process collector with one flag."""

from __future__ import annotations

from typing import Any


class _Dispatch(type):
    def __call__(cls, *args: Any, **kwargs: Any):
        if cls is not MultiCollector:
            return super().__call__(*args, **kwargs)  # (a subclass given sync= refuses it)
        sync = kwargs.pop("sync", True)
        from rlcollect.multiprocess.asynchronous import MultiAsyncCollector
        from rlcollect.multiprocess.sync import MultiSyncCollector

        if not isinstance(sync, bool):
            raise TypeError(f"sync must be True or False, got {sync!r}")
        return (MultiSyncCollector if sync else MultiAsyncCollector)(*args, **kwargs)


class MultiCollector(metaclass=_Dispatch):
    """``MultiSyncCollector(...)`` when ``sync`` is True, else ``MultiAsyncCollector(...)``; both
    are subclasses, so ``isinstance(c, MultiCollector)`` holds for either (as in torchrl).

    Example:
        >>> from rlcollect import MultiCollector
        >>> c = MultiCollector("CartPole-v1", num_workers=2, frames_per_batch=20, sync=False)
        >>> type(c).__name__, isinstance(c, MultiCollector)
        ('MultiAsyncCollector', True)
        >>> c.shutdown()
    """
