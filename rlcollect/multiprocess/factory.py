"""``MultiCollector``: pick the sync or async multi-process collector with one flag."""

from __future__ import annotations

from typing import Any

from rlcollect.multiprocess.asynchronous import MultiAsyncCollector
from rlcollect.multiprocess.base import MultiCollectorBase
from rlcollect.multiprocess.sync import MultiSyncCollector


class _Dispatch(type):
    """``MultiCollector(...)`` builds one of the two collectors; both count as its subclasses
    (torchrl's ``MultiCollector`` is their base class) without inheriting from it."""

    def __call__(cls, *args: Any, **kwargs: Any):
        sync = kwargs.pop("sync", True)
        if not isinstance(sync, bool):
            raise TypeError(f"sync must be True or False, got {sync!r}")
        return (MultiSyncCollector if sync else MultiAsyncCollector)(*args, **kwargs)

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, MultiCollectorBase)

    def __subclasscheck__(cls, subclass: Any) -> bool:
        return isinstance(subclass, type) and issubclass(subclass, MultiCollectorBase)


class MultiCollector(metaclass=_Dispatch):
    """``MultiSyncCollector(...)`` when ``sync`` is True, else ``MultiAsyncCollector(...)``;
    ``isinstance(c, MultiCollector)`` and ``issubclass(MultiSyncCollector, MultiCollector)`` hold
    for either (as in torchrl).

    Example:
        >>> from rlcollect import MultiCollector
        >>> c = MultiCollector("CartPole-v1", num_workers=2, frames_per_batch=20, sync=False)
        >>> type(c).__name__, isinstance(c, MultiCollector)
        ('MultiAsyncCollector', True)
        >>> c.shutdown()
    """
