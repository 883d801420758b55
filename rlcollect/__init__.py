"""rlcollect: fast, reliable collection of reinforcement-learning experience."""

from rlcollect._context import current_worker_index
from rlcollect.envs import BusyEnv, CountingEnv, EnvBase, FaultyEnv, GymEnv, InjectedFault, SerialEnv, SleepEnv

__all__ = [
    "BusyEnv",
    "CountingEnv",
    "EnvBase",
    "FaultyEnv",
    "GymEnv",
    "InjectedFault",
    "SerialEnv",
    "SleepEnv",
    "current_worker_index",
]
