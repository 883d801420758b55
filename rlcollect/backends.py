"""torchrl's front door: ``Collector(create_env_fn, policy, ..., backend=..., num_collectors=N,
backend_options={...}, sync=...)`` builds the collector of that backend, so that a torchrl 0.14
script ports unchanged.

| ``backend`` | builds |
| --- | --- |
| ``"direct"`` (default without ``num_collectors``) | ``Collector`` (this process) |
| ``"process"`` (default with ``num_collectors``) | ``MultiSyncCollector`` / ``MultiAsyncCollector`` |
| ``"distributed"`` | ``DistributedCollector``, one node per env (its own default launcher, "mp") |
| ``"submitit"`` | ``DistributedCollector(launcher="submitit")`` |
| ``"ray"`` | ``RayCollector``: ``DistributedCollector(launcher="ray")``, torchrl's Ray arguments mapped |

As in torchrl: ``sync`` defaults to False (async) for every backend but "direct", which refuses
it; ``num_collectors`` repeats a single env constructor, or must match a list of them;
``backend_options`` are merged into the collector's arguments (a key that repeats a top-level
argument, or one of ``backend_options``, ``num_collectors``, ``num_workers``, ``sync``, is
refused).  torchrl's ``"rpc"`` backend has no counterpart here: refused, naming the accepted ones.

``Collector`` is defined here, the public class: ``SingleCollector`` (rlcollect/collector.py,
one process, what the workers and nodes run) with this front door added.  So the core class does
not know the collectors built on it, and no import goes back up.  Only ``Collector`` itself
dispatches (``Collector.__new__`` calls ``dispatch`` when one of the four selector arguments is
given); subclasses take their own arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlcollect.collector import SingleCollector
from rlcollect.collector_doc import COLLECTOR_DOC

#: The selector arguments ``Collector`` hands to ``dispatch``.
SELECTORS = ("backend", "backend_options", "num_collectors", "sync")
BACKENDS = ("direct", "process", "distributed", "submitit", "ray")
_RESERVED_OPTIONS = ("backend_options", "num_collectors", "num_workers", "sync")


class Collector(SingleCollector):
    __doc__ = COLLECTOR_DOC

    # Hidden from type checkers: a __new__ defined below the inherited __init__ is what mypy
    # checks a call against, and this one takes (*args, **kwargs); without it every argument of
    # Collector(...) is checked against __init__'s annotations (tests/test_packaging.py, mypy).
    if not TYPE_CHECKING:
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            """torchrl's front door: given ``backend``, ``num_collectors``, ``backend_options`` or
            ``sync``, ``Collector(...)`` builds that backend's collector (``dispatch``)."""
            if cls is Collector and not set(SELECTORS).isdisjoint(kwargs):
                return dispatch(*args, **kwargs)
            return super().__new__(cls)


# help() and IDEs show __init__'s arguments and the front door's (__new__ takes *args, **kwargs).
_INIT = inspect.signature(SingleCollector.__init__)
Collector.__signature__ = _INIT.replace(parameters=[*list(_INIT.parameters.values())[1:], *(
    inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None)
    for n in ("backend", "num_collectors", "backend_options", "sync"))])


def _env_list(args: tuple, kwargs: dict, num_collectors: int | None) -> tuple[tuple, dict, int]:
    """``create_env_fn`` as one constructor per collector (positional or keyword, as given)."""
    positional = bool(args)
    if not positional and "create_env_fn" not in kwargs:
        raise TypeError("Collector() missing its first argument: create_env_fn")
    envs = args[0] if positional else kwargs["create_env_fn"]
    if isinstance(envs, Sequence) and not isinstance(envs, (str, bytes)):
        envs = list(envs)
        if not envs:
            raise ValueError("create_env_fn is an empty list; give one env constructor per collector")
        if num_collectors is not None and num_collectors != len(envs):
            raise ValueError(f"num_collectors={num_collectors} does not match the {len(envs)} env constructors of "
                             "create_env_fn")
    else:
        envs = [envs] * (1 if num_collectors is None else num_collectors)
    if positional:
        return (envs, *args[1:]), kwargs, len(envs)
    return args, {**kwargs, "create_env_fn": envs}, len(envs)


def dispatch(*args: Any, backend: str | None = None, backend_options: dict | None = None,
             num_collectors: int | None = None, sync: bool | None = None, **kwargs: Any) -> Any:
    """The collector ``Collector(*args, backend=..., ..., **kwargs)`` stands for (see the module
    docstring); for ``"direct"`` an uninitialised ``DirectCollector``, which Python then
    initialises with the same arguments.

    Example:
        >>> from rlcollect import Collector
        >>> c = Collector("CartPole-v1", num_collectors=2, frames_per_batch=20, total_frames=40)
        >>> type(c).__name__, c.num_workers         # "process" inferred; async unless sync=True
        ('MultiAsyncCollector', 2)
        >>> c.shutdown()
        >>> Collector("CartPole-v1", frames_per_batch=20, backend="rpc")
        Traceback (most recent call last):
        ValueError: backend must be one of ('direct', 'process', 'distributed', 'submitit', 'ray'), got 'rpc'
    """
    if len(args) > 2:
        raise TypeError(f"Collector takes create_env_fn and policy positionally, got {len(args)} positional arguments")
    if num_collectors is not None and (isinstance(num_collectors, bool) or not isinstance(num_collectors, int)
                                       or num_collectors < 1):
        raise ValueError(f"num_collectors must be a positive int or None, got {num_collectors!r}")
    if backend is None:
        backend = "process" if num_collectors is not None else "direct"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend_options is not None and not isinstance(backend_options, dict):
        raise TypeError(f"backend_options must be a dict or None, got {type(backend_options).__name__}")
    options = dict(backend_options or {})
    reserved = sorted(set(options) & set(_RESERVED_OPTIONS))
    if reserved:
        raise ValueError(f"backend_options must not hold {reserved}: give them as Collector's own arguments")
    duplicates = sorted((set(options) & set(kwargs)) | (set(options) & set(("create_env_fn", "policy")[: len(args)])))
    if duplicates:
        raise ValueError(f"backend_options repeat top-level arguments: {duplicates}")
    if sync is not None and not isinstance(sync, bool):
        raise TypeError(f"sync must be True, False or None, got {sync!r}")
    if backend == "direct":
        if num_collectors not in (None, 1):
            raise ValueError(f"backend='direct' collects in this process: num_collectors must be 1 or None, got "
                             f"{num_collectors!r}")
        if sync is not None:
            raise ValueError("sync is for the collectors of several workers; backend='direct' takes none")
        if options:
            raise ValueError(f"backend_options are for the other backends; backend='direct' got {sorted(options)}")
        envs = args[0] if args else kwargs.get("create_env_fn")
        if isinstance(envs, Sequence) and not isinstance(envs, (str, bytes)) and len(envs) != 1:
            raise ValueError(f"backend='direct' takes one env constructor, got a list of {len(envs)}")
        return DirectCollector.__new__(DirectCollector)
    sync = False if sync is None else sync
    kwargs.update(options)
    args, kwargs, n = _env_list(args, kwargs, num_collectors)
    if backend == "process":
        from rlcollect.multiprocess.factory import MultiCollector

        return MultiCollector(*args, sync=sync, **kwargs)
    if backend == "ray":
        from rlcollect.distributed.ray_collector import RayCollector

        return RayCollector(*args, num_collectors=n, sync=sync, **kwargs)
    from rlcollect.distributed.collector import DistributedCollector

    if backend == "submitit":
        launcher = kwargs.setdefault("launcher", "submitit")
        if launcher != "submitit":
            raise ValueError(f"backend='submitit' runs launcher='submitit', got launcher={launcher!r}")
    return DistributedCollector(*args, sync=sync, **kwargs)


class DirectCollector(Collector):
    """What ``Collector(..., backend="direct")`` builds: a ``Collector`` whose constructor also
    takes the selector arguments (checked by ``dispatch``) and a one-entry env list."""

    def __init__(self, *args: Any, backend: Any = None, backend_options: Any = None, num_collectors: Any = None,
                 sync: Any = None, **kwargs: Any) -> None:
        envs = args[0] if args else kwargs.get("create_env_fn")
        if isinstance(envs, Sequence) and not isinstance(envs, (str, bytes)):
            if args:
                args = (envs[0], *args[1:])
            else:
                kwargs["create_env_fn"] = envs[0]
        super().__init__(*args, **kwargs)
