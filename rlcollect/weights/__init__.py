"""Weight synchronisation between the trainer's policy and the acting copies."""

from rlcollect.weights.models import UnknownModelError
from rlcollect.weights.schemes import (
    DistributedWeightSyncScheme,
    MultiProcessWeightSyncScheme,
    NoWeightSyncScheme,
    SharedMemWeightSyncScheme,
    WeightSyncScheme,
    validate_schemes,
)

__all__ = [
    "DistributedWeightSyncScheme",
    "MultiProcessWeightSyncScheme",
    "NoWeightSyncScheme",
    "SharedMemWeightSyncScheme",
    "UnknownModelError",
    "WeightSyncScheme",
    "validate_schemes",
]
