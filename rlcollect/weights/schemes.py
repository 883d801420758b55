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


def validate_schemes(value: Any) -> dict[str, WeightSyncScheme]:
    """Check ``weight_sync_schemes``: None or ``{model_id: WeightSyncScheme or backend name}``."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"weight_sync_schemes must be a dict {{model_id: scheme}}, got {type(value).__name__}")
    out = {}
    for key, scheme in value.items():
        if isinstance(scheme, str) and scheme not in BACKENDS:
            raise ValueError(f"weight_sync_schemes[{key!r}]: unknown backend {scheme!r}; accepted: {', '.join(BACKENDS)}")
        if isinstance(scheme, str):
            scheme = WeightSyncScheme.from_backend(scheme)
        if not isinstance(scheme, WeightSyncScheme):
            raise TypeError(
                f"weight_sync_schemes[{key!r}] must be a WeightSyncScheme or one of {BACKENDS}, got {scheme!r}"
            )
        out[key] = scheme
    return out
