"""``BatchSource``: the calls a worker process or a distributed node drives its collector with.

A worker (multiprocess/worker.py) and a node (distributed/node.py) each build one collector:
a ``Collector``, or a multi-process collector of their own (``collector_class="sync"`` /
``"async"``). They use it only through this interface, so any collector that implements it can
run inside them:

- ``layout``: the layout of one batch, which the owner allocates shared memory for;
- ``collect_into(buf, random, stop)``: fill ``buf`` with the next batch, in place;
- ``batch_info()``: what the last batch was (its frames' policy versions, the env-step latency);
- ``weight_spec``, ``weights_module(model_id)``, ``set_weights(state, version, model_id)``: the
  weights it acts with, and how new ones (with the owner's version number) are applied;
- ``policy_version``, ``set_seed``, ``reset``, ``state_dict``, ``load_state_dict``,
  ``getattr_env``, ``enable_profile``, ``shutdown``: the public calls of every collector.

Example:
    >>> from rlcollect import Collector
    >>> from rlcollect.data import BatchBuffer
    >>> c = Collector("CartPole-v1", frames_per_batch=8)
    >>> isinstance(c, BatchSource)
    True
    >>> buf = BatchBuffer(c.layout)
    >>> c.collect_into(buf), c.batch_info()["frames"]
    (8, 8)
    >>> c.set_weights(None, 5); c.policy_version
    5
    >>> c.shutdown()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from rlcollect.data import BatchBuffer, BatchLayout

#: Names, shapes and dtypes of a policy's parameters and buffers.
WeightSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


@runtime_checkable
class BatchSource(Protocol):
    """Something that fills batch buffers in place (see the module docstring)."""

    policy: Any

    @property
    def layout(self) -> BatchLayout:
        """The layout of one batch ``collect_into`` fills."""

    @property
    def policy_version(self) -> int:
        """The version of the weights acting now."""

    @property
    def weight_spec(self) -> WeightSpec | None:
        """The acting policy's parameters and buffers (None: it has none)."""

    def collect_into(self, buf: BatchBuffer, random: bool = False, stop: Any = None) -> int:
        """Fill ``buf`` with the next batch (random actions when ``random``; ``stop``: a flag
        array that ends the batch early when set); returns the valid frames written."""

    def batch_info(self) -> dict:
        """The last batch filled: ``rlcollect.metrics.batch_meta``'s keys."""

    def weights_module(self, model_id: str = "policy") -> torch.nn.Module | None:
        """The module ``set_weights(None, ...)`` takes ``model_id``'s weights from (it may have
        been written in place); raises ValueError for a model this collector cannot update."""

    def set_weights(self, state: Mapping[str, torch.Tensor] | None, version: int, model_id: str = "policy") -> None:
        """Act with ``state`` (None: what ``weights_module(model_id)`` holds now) from the next
        batch on, with ``policy_version`` set to ``version``."""

    def set_seed(self, seed: int, static_seed: bool = False) -> int: ...

    def reset(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def getattr_env(self, name: str) -> Any: ...

    def enable_profile(self, path: str = ..., **kwargs: Any) -> None: ...

    def shutdown(self) -> None: ...
