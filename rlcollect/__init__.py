"""rlcollect: fast, reliable collection of reinforcement-learning experience.

The public API is what this module exports.  Names are imported on first use, so that a worker
process that only needs the rollout machinery does not pay for importing everything (tensordict
in particular, which costs seconds at start-up).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The library logs through the "rlcollect" logger and never prints; configure logging to see it.
logging.getLogger("rlcollect").addHandler(logging.NullHandler())

_EXPORTS = {
    "AsyncBatchedCollector": "rlcollect.multiprocess.async_batched",
    "BusyEnv": "rlcollect.envs.testing",
    "Collector": "rlcollect.backends",
    "CountingEnv": "rlcollect.envs.testing",
    "DistributedCollector": "rlcollect.distributed.collector",
    "DistributedDataCollector": "rlcollect.distributed.collector",
    "DistributedWeightSyncScheme": "rlcollect.weights.schemes",
    "EnvBase": "rlcollect.envs.base",
    "EnvPoolEnv": "rlcollect.envs.envpool",
    "ExplorationType": "rlcollect.policy",
    "FaultyEnv": "rlcollect.envs.testing",
    "GymEnv": "rlcollect.envs.gym",
    "InjectedFault": "rlcollect.envs.testing",
    "MultiAsyncCollector": "rlcollect.multiprocess.collector",
    "MultiCollector": "rlcollect.multiprocess.factory",
    "MultiProcessWeightSyncScheme": "rlcollect.weights.schemes",
    "MLflowLogger": "rlcollect.loggers.mlflow",
    "MultiSyncCollector": "rlcollect.multiprocess.collector",
    "NoWeightSyncScheme": "rlcollect.weights.schemes",
    "RayCollector": "rlcollect.distributed.ray_collector",
    "ReplayBuffer": "rlcollect.buffers.replay",
    "SerialEnv": "rlcollect.envs.serial",
    "SharedMemWeightSyncScheme": "rlcollect.weights.schemes",
    "SleepEnv": "rlcollect.envs.testing",
    "StatsLogger": "rlcollect.loggers.base",
    "TensorBoardLogger": "rlcollect.loggers.tensorboard",
    "VectorEnv": "rlcollect.envs.vector",
    "WandbLogger": "rlcollect.loggers.wandb",
    "WeightSyncScheme": "rlcollect.weights.schemes",
    "WorkerError": "rlcollect.errors",
    "current_worker_index": "rlcollect._context",
    "split_trajectories": "rlcollect.data",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlcollect' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover
    from rlcollect._context import current_worker_index
    from rlcollect.buffers.replay import ReplayBuffer
    from rlcollect.multiprocess.async_batched import AsyncBatchedCollector
    from rlcollect.backends import Collector
    from rlcollect.data import split_trajectories
    from rlcollect.distributed.collector import DistributedCollector, DistributedDataCollector
    from rlcollect.distributed.ray_collector import RayCollector
    from rlcollect.envs.base import EnvBase
    from rlcollect.envs.envpool import EnvPoolEnv
    from rlcollect.envs.gym import GymEnv
    from rlcollect.envs.serial import SerialEnv
    from rlcollect.envs.testing import BusyEnv, CountingEnv, FaultyEnv, InjectedFault, SleepEnv
    from rlcollect.envs.vector import VectorEnv
    from rlcollect.multiprocess.collector import MultiAsyncCollector
    from rlcollect.multiprocess.factory import MultiCollector
    from rlcollect.errors import WorkerError
    from rlcollect.multiprocess.collector import MultiSyncCollector
    from rlcollect.loggers.base import StatsLogger
    from rlcollect.loggers.mlflow import MLflowLogger
    from rlcollect.loggers.tensorboard import TensorBoardLogger
    from rlcollect.loggers.wandb import WandbLogger
    from rlcollect.policy import ExplorationType
    from rlcollect.weights.schemes import (
        DistributedWeightSyncScheme,
        MultiProcessWeightSyncScheme,
        NoWeightSyncScheme,
        SharedMemWeightSyncScheme,
        WeightSyncScheme,
    )
