"""Environments: the protocol, gymnasium and vector-env adapters, serial batching and test envs."""

from rlcollect.envs.adapter import TensorDictEnvAdapter, as_env, make_env
from rlcollect.envs.base import ArraySpec, EnvBase
from rlcollect.envs.envpool import EnvPoolEnv
from rlcollect.envs.gym import GymEnv
from rlcollect.envs.serial import SerialEnv
from rlcollect.envs.testing import BusyEnv, CountingEnv, FaultyEnv, InjectedFault, SleepEnv
from rlcollect.envs.vector import VectorEnv

__all__ = [
    "ArraySpec",
    "BusyEnv",
    "CountingEnv",
    "EnvBase",
    "EnvPoolEnv",
    "FaultyEnv",
    "GymEnv",
    "InjectedFault",
    "SerialEnv",
    "SleepEnv",
    "TensorDictEnvAdapter",
    "VectorEnv",
    "as_env",
    "make_env",
]

