"""Weight synchronisation schemes: how ``update_policy_weights_`` reaches the policy copies
that act (in this process, in worker processes, or on distributed nodes)."""

from __future__ import annotations

from typing import Any

BACKENDS = ("shared", "process", "distributed", "none")


class WeightSyncScheme:
    """Base class of the weight synchronisation schemes.

    Pass one per model to a collector as ``weight_sync_schemes={"policy": scheme}``.

    Example:
        >>> from rlcollect import WeightSyncScheme
        >>> type(WeightSyncScheme.from_backend("none")).__name__
        'NoWeightSyncScheme'
    """

    backend = ""
    #: False for schemes whose updates do nothing.
    delivers = True

    @classmethod
    def from_backend(cls, name: str) -> WeightSyncScheme:
        """Build the scheme for ``name``: "shared", "process", "distributed" or "none"."""
        schemes = {
            "shared": SharedMemWeightSyncScheme,
            "process": MultiProcessWeightSyncScheme,
            "distributed": DistributedWeightSyncScheme,
            "none": NoWeightSyncScheme,
        }
        if name not in schemes:
            raise ValueError(f"unknown weight sync backend {name!r}; accepted: {', '.join(BACKENDS)}")
        return schemes[name]()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class SharedMemWeightSyncScheme(WeightSyncScheme):
    """One shared-memory copy of the weights that workers copy from when its version changes
    (the default for CPU workers).

    Example:
        >>> SharedMemWeightSyncScheme().backend
        'shared'
    """

    backend = "shared"


class MultiProcessWeightSyncScheme(WeightSyncScheme):
    """Weights sent to each worker through its command channel.

    Example:
        >>> MultiProcessWeightSyncScheme().backend
        'process'
    """

    backend = "process"


class DistributedWeightSyncScheme(WeightSyncScheme):
    """Weights sent to distributed nodes over torch.distributed.

    Example:
        >>> DistributedWeightSyncScheme().backend
        'distributed'
    """

    backend = "distributed"


class NoWeightSyncScheme(WeightSyncScheme):
    """Updates are no-ops: the workers keep the weights they started with.

    Example:
        >>> NoWeightSyncScheme().delivers
        False
    """

    backend = "none"
    delivers = False


#: torchrl's scheme classes (``torchrl.weight_update``) and the scheme each maps to here.
TORCHRL_SCHEMES = {
    "SharedMemWeightSyncScheme": SharedMemWeightSyncScheme,
    "MultiProcessWeightSyncScheme": MultiProcessWeightSyncScheme,
    "NoWeightSyncScheme": NoWeightSyncScheme,
    "DistributedWeightSyncScheme": DistributedWeightSyncScheme,
}


def from_torchrl(scheme: Any) -> WeightSyncScheme | None:
    """Our scheme for a torchrl scheme object (matched by class name in ``torchrl.*``, so
    torchrl is never imported here); None for anything else.

    Example:
        >>> class SharedMemWeightSyncScheme: pass
        >>> SharedMemWeightSyncScheme.__module__ = "torchrl.weight_update._shared"
        >>> from_torchrl(SharedMemWeightSyncScheme())
        SharedMemWeightSyncScheme()
    """
    cls = type(scheme)
    if not cls.__module__.startswith("torchrl"):
        return None
    for klass in cls.__mro__:
        if klass.__module__.startswith("torchrl") and klass.__name__ in TORCHRL_SCHEMES:
            return TORCHRL_SCHEMES[klass.__name__]()
    raise TypeError(f"torchrl's {cls.__name__} has no counterpart here; accepted torchrl schemes: "
                    f"{', '.join(TORCHRL_SCHEMES)} (or our own of the same names)")


def validate_schemes(value: Any) -> dict[str, WeightSyncScheme]:
    """Check ``weight_sync_schemes``: None or ``{model_id: WeightSyncScheme, a torchrl scheme
    object or a backend name}``; torchrl's objects are mapped to ours of the same name."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"weight_sync_schemes must be a dict {{model_id: scheme}}, got {type(value).__name__}")
    out = {}
    for key, scheme in value.items():
        if isinstance(scheme, str) and scheme not in BACKENDS:
            raise ValueError(
                f"weight_sync_schemes[{key!r}]: unknown backend {scheme!r}; accepted: {', '.join(BACKENDS)}")
        if isinstance(scheme, str):
            scheme = WeightSyncScheme.from_backend(scheme)
        if not isinstance(scheme, (str, WeightSyncScheme)):
            try:
                scheme = from_torchrl(scheme) or scheme
            except TypeError as err:
                raise TypeError(f"weight_sync_schemes[{key!r}]: {err}") from None
        if not isinstance(key, str) or not key:
            raise ValueError(f"weight_sync_schemes keys must be model ids like 'policy' or 'policy.module[0]', "
                             f"got {key!r}")
        if not isinstance(scheme, WeightSyncScheme):
            raise TypeError(
                f"weight_sync_schemes[{key!r}] must be a WeightSyncScheme or one of {BACKENDS}, got {scheme!r}"
            )
        out[key] = scheme
    return out
