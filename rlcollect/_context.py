"""Process-wide facts a user's env factory may ask for (which worker it is running in)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_worker_index: int | None = None


def current_worker_index() -> int | None:
    """The index of the collector worker building or stepping envs here (None outside one).

    Example:
        >>> from rlcollect import current_worker_index
        >>> current_worker_index() is None
        True
    """
    return _worker_index


@contextlib.contextmanager
def worker_index(index: int | None) -> Iterator[None]:
    global _worker_index
    previous, _worker_index = _worker_index, index
    try:
        yield
    finally:
        _worker_index = previous
