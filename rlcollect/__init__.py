"""rlcollect: fast, reliable collection of reinforcement-learning experience."""

from rlcollect._context import current_worker_index
from rlcollect.collector import Collector
from rlcollect.data import split_trajectories
from rlcollect.envs import BusyEnv, CountingEnv, EnvBase, FaultyEnv, GymEnv, InjectedFault, SerialEnv, SleepEnv
from rlcollect.multiprocess import MultiAsyncCollector, MultiCollector, MultiSyncCollector, WorkerError
from rlcollect.policy import ExplorationType
from rlcollect.weights import (
    DistributedWeightSyncScheme,
    MultiProcessWeightSyncScheme,
    NoWeightSyncScheme,
    SharedMemWeightSyncScheme,
    WeightSyncScheme,
)

__all__ = [
    "BusyEnv",
    "Collector",
    "CountingEnv",
    "DistributedWeightSyncScheme",
    "EnvBase",
    "ExplorationType",
    "FaultyEnv",
    "GymEnv",
    "InjectedFault",
    "MultiAsyncCollector",
    "MultiCollector",
    "MultiProcessWeightSyncScheme",
    "MultiSyncCollector",
    "NoWeightSyncScheme",
    "SerialEnv",
    "SharedMemWeightSyncScheme",
    "SleepEnv",
    "WeightSyncScheme",
    "WorkerError",
    "current_worker_index",
    "split_trajectories",
]
