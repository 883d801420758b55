"""Multi-process collectors: workers, shared-memory transport, supervision."""

from rlcollect.multiprocess.asynchronous import MultiAsyncCollector
from rlcollect.multiprocess.protocol import WorkerError
from rlcollect.multiprocess.sync import MultiSyncCollector


def MultiCollector(*args, sync: bool = True, **kwargs):
    """``MultiSyncCollector(...)`` when ``sync`` is True, else ``MultiAsyncCollector(...)``.

    Example:
        >>> from rlcollect import MultiCollector
        >>> c = MultiCollector("CartPole-v1", num_workers=2, frames_per_batch=20, sync=False)
        >>> type(c).__name__
        'MultiAsyncCollector'
        >>> c.shutdown()
    """
    if not isinstance(sync, bool):
        raise TypeError(f"sync must be True or False, got {sync!r}")
    return (MultiSyncCollector if sync else MultiAsyncCollector)(*args, **kwargs)


__all__ = ["MultiAsyncCollector", "MultiCollector", "MultiSyncCollector", "WorkerError"]
