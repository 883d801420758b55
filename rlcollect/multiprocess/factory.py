"""``MultiCollector``: torchrl's one class for both kinds, a dispatcher rather than a collector:
``MultiCollector(..., sync=...)`` builds a ``MultiSyncCollector`` or a ``MultiAsyncCollector``
(collector.py), and both count as its subclasses."""

from __future__ import annotations

import inspect
from typing import Any

from rlcollect.multiprocess.collector import MultiAsyncCollector, MultiCollectorBase, MultiSyncCollector
from rlcollect.multiprocess.config import ARGS_DOC


class _Dispatch(type):
    """``MultiCollector(...)`` builds one of the two collectors; both count as its subclasses
    (torchrl's ``MultiCollector`` is their base class) without inheriting from it."""

    def __call__(cls, *args: Any, sync: bool = True, **kwargs: Any):
        if not isinstance(sync, bool):
            raise TypeError(f"sync must be True or False, got {sync!r}")
        return (MultiSyncCollector if sync else MultiAsyncCollector)(*args, **kwargs)

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, MultiCollectorBase)

    def __subclasscheck__(cls, subclass: Any) -> bool:
        return isinstance(subclass, type) and issubclass(subclass, MultiCollectorBase)


class MultiCollector(metaclass=_Dispatch):
    __doc__ = """``MultiSyncCollector(...)`` when ``sync`` is True, else ``MultiAsyncCollector(...)``;
    ``isinstance(c, MultiCollector)`` and ``issubclass(MultiSyncCollector, MultiCollector)`` hold
    for either (as in torchrl).
""" + ARGS_DOC + """        sync (bool): True (default) builds a ``MultiSyncCollector``, False a
            ``MultiAsyncCollector`` (torchrl's ``MultiCollector(sync=...)``).

    Example:
        >>> from rlcollect import MultiCollector
        >>> c = MultiCollector("CartPole-v1", num_workers=2, frames_per_batch=20, sync=False)
        >>> type(c).__name__, isinstance(c, MultiCollector)
        ('MultiAsyncCollector', True)
        >>> c.shutdown()
    """


def _signature_with_sync() -> Any:
    sig = inspect.signature(MultiCollectorBase.__init__)
    params = [p for p in sig.parameters.values() if p.name != "self"]
    sync = inspect.Parameter("sync", inspect.Parameter.KEYWORD_ONLY, default=True, annotation="bool")
    return sig.replace(parameters=[*params[:-1], sync, params[-1]])


#: ``inspect.signature(MultiCollector)``: the collectors' arguments and ``sync``.
MultiCollector.__signature__ = _signature_with_sync()
