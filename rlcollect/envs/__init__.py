"""Environments: the protocol, gymnasium and vector-env adapters, serial batching and test envs.

Names are imported on first use (``from rlcollect.envs import GymEnv`` works as usual): a
program, or a worker, that needs one env module does not import the others (the vector-env and
EnvPool adapters, the test envs), which keeps ``import rlcollect.envs.base`` light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ArraySpec": "rlcollect.envs.base",
    "BusyEnv": "rlcollect.envs.testing",
    "CountingEnv": "rlcollect.envs.testing",
    "EnvBase": "rlcollect.envs.base",
    "EnvPoolEnv": "rlcollect.envs.envpool",
    "FaultyEnv": "rlcollect.envs.testing",
    "GymEnv": "rlcollect.envs.gym",
    "GroupedEnv": "rlcollect.envs.grouped",
    "InjectedFault": "rlcollect.envs.testing",
    "PettingZooEnv": "rlcollect.envs.pettingzoo",
    "PettingZooAECEnv": "rlcollect.envs.pettingzoo",
    "SerialEnv": "rlcollect.envs.serial",
    "SleepEnv": "rlcollect.envs.testing",
    "TensorDictEnvAdapter": "rlcollect.envs.adapter",
    "VectorEnv": "rlcollect.envs.vector",
    "VmasEnv": "rlcollect.envs.vmas",
    "as_env": "rlcollect.envs.adapter",
    "make_env": "rlcollect.envs.adapter",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlcollect.envs' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover
    from rlcollect.envs.adapter import TensorDictEnvAdapter, as_env, make_env
    from rlcollect.envs.base import ArraySpec, EnvBase
    from rlcollect.envs.envpool import EnvPoolEnv
    from rlcollect.envs.grouped import GroupedEnv
    from rlcollect.envs.gym import GymEnv
    from rlcollect.envs.pettingzoo import PettingZooAECEnv, PettingZooEnv
    from rlcollect.envs.serial import SerialEnv
    from rlcollect.envs.testing import BusyEnv, CountingEnv, FaultyEnv, InjectedFault, SleepEnv
    from rlcollect.envs.vector import VectorEnv
    from rlcollect.envs.vmas import VmasEnv
