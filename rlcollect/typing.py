"""The types of rlcollect's public arguments, for type checkers and readers.

The package ships a ``py.typed`` marker (PEP 561), so mypy and pyright read its annotations.
The envs and policies a collector accepts are duck-typed, as in torchrl: these protocols say
what is called on them. Nothing here is imported at run time by the collectors (the module
imports only ``typing``), so ``from rlcollect.typing import EnvSource`` is free.

Example:
    >>> from rlcollect.typing import EnvLike
    >>> from rlcollect import CountingEnv
    >>> isinstance(CountingEnv(), EnvLike)  # a runtime-checkable protocol
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, Union, runtime_checkable

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rlcollect.policy import ExplorationType

__all__ = ["DeviceLike", "EnvFactory", "EnvLike", "EnvSource", "ExplorationLike", "PolicyLike", "ReplayBufferLike",
           "TensorDictPolicy"]


@runtime_checkable
class EnvLike(Protocol):
    """An env a collector steps: rlcollect's own envs (``GymEnv``, ``SerialEnv``, ``VectorEnv``,
    ``EnvPoolEnv``, ...), a ``gymnasium.Env`` or ``gymnasium.vector.VectorEnv`` (wrapped on
    arrival), or a torchrl-style TensorDict env (``reset(tensordict)``, ``step(tensordict)``)."""

    def reset(self, *args: Any, **kwargs: Any) -> Any: ...

    def step(self, *args: Any, **kwargs: Any) -> Any: ...


#: A callable returning an env: an env class (``CountingEnv``), a function, a ``functools.partial``;
#: a collector's ``create_env_kwargs`` are passed to it.
EnvFactory: TypeAlias = Callable[..., EnvLike]

#: What ``create_env_fn`` accepts: a gymnasium id (``"CartPole-v1"``, built with ``GymEnv``), an
#: env instance, or a factory.
EnvSource: TypeAlias = Union[str, EnvLike, EnvFactory]


@runtime_checkable
class TensorDictPolicy(Protocol):
    """A torchrl-style policy: reads its ``in_keys`` from the tensordict it is given and writes
    its ``out_keys`` (``"action"``, ...) into it (a ``tensordict.nn.TensorDictModule``)."""

    in_keys: Any
    out_keys: Any

    def __call__(self, tensordict: Any, /, *args: Any, **kwargs: Any) -> Any: ...


#: What ``policy`` accepts: ``None`` (random actions from the env's action space), a
#: ``TensorDictPolicy``, an ``nn.Module`` or any callable whose parameters are named after
#: observation keys and which returns the action (checked at construction).
PolicyLike: TypeAlias = Union["torch.nn.Module", TensorDictPolicy, Callable[..., Any], None]

#: A device as torch takes it: ``torch.device("cuda:0")``, ``"cpu"``, ``"cuda:1"``, an index;
#: ``None`` means "where it already is" (see each argument).
DeviceLike: TypeAlias = Union["torch.device", str, int, None]

#: An ``ExplorationType`` member or its name (``"random"``, ``"deterministic"``, ``"mode"``, ``"mean"``,
#: ``"median"``).
ExplorationLike: TypeAlias = Union["ExplorationType", str]


@runtime_checkable
class ReplayBufferLike(Protocol):
    """Where a collector given ``replay_buffer`` writes its batches: anything with ``extend``
    (rlcollect's ``ReplayBuffer``, torchrl's ``ReplayBuffer``)."""

    def extend(self, data: Any, /) -> Any: ...
