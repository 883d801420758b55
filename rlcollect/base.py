"""``CollectorBase``: what every public collector shares, and nothing else.

Iteration up to ``total_frames``, ``len()``, the context manager, the "shut down already"
check, the policy version (which moves a torchrl ``PolicyVersion`` given as
``track_policy_version`` along with it) and torchrl's ``next()`` / ``increment_version()`` /
``get_policy_version()``.  A subclass provides ``_next_batch()``, ``total_frames``, ``_frames``,
``_closed``, ``shutdown()`` and ``_batch_frames()`` (the frames of one yielded batch, for
``len()``); everything else (workers, weights, free running, statistics) is composed from
collaborators in its own module.

Example:
    >>> class Counter(CollectorBase):
    ...     total_frames, _frames, _closed = 6, 0, False
    ...     def _next_batch(self):
    ...         self._frames += 2
    ...         return self._frames
    ...     def _batch_frames(self):
    ...         return 2
    ...     def shutdown(self):
    ...         self._closed = True
    >>> with Counter() as c:
    ...     len(c), list(c)
    (3, [2, 4, 6])
    >>> c.increment_version(); c.get_policy_version()
    1
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any


class CollectorBase:
    """The one base class of rlcollect's public collectors (see the module docstring)."""

    _version_tracker: Any = None
    _iterator: Iterator | None = None
    #: Whether an exception raised while iterating shuts the collector down (its workers).
    _shutdown_on_error = False

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        self._check_open()
        self._check_iterable()
        try:
            while self.total_frames < 0 or self._frames < self.total_frames:
                yield self._next_batch()
        except GeneratorExit:
            raise
        except BaseException:
            if self._shutdown_on_error:
                self.shutdown()
            raise

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self)
        return next(self._iterator)

    def __len__(self) -> int:
        if self.total_frames < 0:
            raise TypeError("an endless collector (total_frames=-1) has no len()")
        return math.ceil(self.total_frames / self._batch_frames())

    def _check_iterable(self) -> None:
        """Raise when the collector cannot be iterated now (it is running free, say)."""

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this {self._name_when_closed()} has been shut down")

    def _name_when_closed(self) -> str:
        return type(self).__name__

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # -- torchrl's methods ---------------------------------------------------------------------
    def next(self) -> Any:
        """The next batch, or None once ``total_frames`` are collected (torchrl's ``next()``).

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10, total_frames=10)
            >>> c.next().shape, c.next()
            (torch.Size([10]), None)
            >>> c.shutdown()
        """
        try:
            return self.__next__()
        except StopIteration:
            return None

    def increment_version(self) -> None:
        """Bump the policy version without sending weights (and a torchrl ``PolicyVersion``
        given as ``track_policy_version`` with it); weight updates bump it too.

        Example:
            >>> from rlcollect import Collector
            >>> c = Collector("CartPole-v1", frames_per_batch=10)
            >>> c.increment_version(); c.get_policy_version()
            1
            >>> c.shutdown()
        """
        self._version += 1

    @contextlib.contextmanager
    def updating_weights(self) -> Iterator[None]:
        """Change the trainer's policy in place inside the block (an optimizer step, say); at
        its end the collector takes the new weights with a new version, as
        ``update_policy_weights_()`` does. With ``inference="central"`` the main process's
        forward also waits for the block: no forward sees half a step, and every frame's
        version is exactly that of the weights that acted.

        Example:
            >>> import torch
            >>> from rlcollect import Collector, CountingEnv
            >>> class Policy(torch.nn.Module):
            ...     def __init__(self):
            ...         super().__init__()
            ...         self.w = torch.nn.Parameter(torch.zeros(1))
            ...     def forward(self, observation):
            ...         return (observation[..., 0] * self.w[0] > 0).long()
            >>> policy = Policy()
            >>> c = Collector(CountingEnv(), policy, frames_per_batch=4)
            >>> with c.updating_weights():
            ...     _ = policy.w.data.add_(1.0)
            >>> c.policy_version
            1
            >>> c.shutdown()
        """
        yield
        self.update_policy_weights_()

    @property
    def _version(self) -> int:
        return self.__dict__.get("_version_value", 0)

    @_version.setter
    def _version(self, value: int) -> None:
        # Every bump (weight updates included) moves the user's torchrl PolicyVersion too.
        old = self.__dict__.get("_version_value", 0)
        self.__dict__["_version_value"] = value
        tracker = self._version_tracker
        if tracker is not None:
            for _ in range(max(0, value - old)):
                tracker.increment_version()

    @property
    def policy_version(self) -> int:
        """The version of the weights acting now (0 until the first update)."""
        return self._version

    def get_policy_version(self) -> int:
        """``policy_version`` as a method (torchrl has both)."""
        return self.policy_version
