"""Environments: the protocol, gymnasium adapter, serial batching and test envs."""

from rlcollect.envs.adapter import TensorDictEnvAdapter, as_env, make_env
from rlcollect.envs.base import ArraySpec, EnvBase
from rlcollect.envs.gym import GymEnv
from rlcollect.envs.serial import SerialEnv
from rlcollect.envs.testing import BusyEnv, CountingEnv, FaultyEnv, InjectedFault, SleepEnv

__all__ = [
    "ArraySpec",
    "BusyEnv",
    "CountingEnv",
    "EnvBase",
    "FaultyEnv",
    "GymEnv",
    "InjectedFault",
    "SerialEnv",
    "SleepEnv",
    "TensorDictEnvAdapter",
    "as_env",
    "make_env",
]
