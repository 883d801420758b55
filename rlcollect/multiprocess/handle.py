"""``WorkerHandle``: one member of a ``WorkerPool``, with its explicit state.

A member keeps its handle (its index, its slots) across restarts; each start of a process is
a new ``incarnation``::

    starting -> serving -> failed -> restarting -> starting -> serving ...
    (any state) -> closed        (a closed member never comes back)

Example:
    >>> handle = WorkerHandle(0, process=None, conn=None)
    >>> handle.state.value, handle.incarnation
    ('starting', 0)
    >>> handle.move(WorkerState.SERVING); handle.move(WorkerState.FAILED); handle.failed
    True
    >>> handle.move(WorkerState.CLOSED); handle.move(WorkerState.SERVING)
    Traceback (most recent call last):
    ...
    RuntimeError: worker 0: closed -> serving is not a state change a worker makes
"""

from __future__ import annotations

import collections
import enum
from typing import Any


class WorkerState(enum.Enum):
    STARTING = "starting"  # its process is started, it has not reported ready yet
    SERVING = "serving"  # ready: it answers commands
    FAILED = "failed"  # died, hung, or failed to start: restarted or shut down next
    RESTARTING = "restarting"  # its old process is being replaced
    CLOSED = "closed"  # shut down


_NEXT = {
    WorkerState.STARTING: {WorkerState.SERVING, WorkerState.FAILED},
    WorkerState.SERVING: {WorkerState.FAILED, WorkerState.RESTARTING},  # restarted after its collector raised
    WorkerState.FAILED: {WorkerState.RESTARTING},
    WorkerState.RESTARTING: {WorkerState.STARTING, WorkerState.FAILED},
    WorkerState.CLOSED: set(),
}


class WorkerHandle:
    """Worker ``index``: its process and pipe (replaced at each restart), the commands it owes
    replies to (``pending``), what it reported when ready (``info``), the ``ATTACH`` arguments
    it was given (``attachment``, given again to its replacement), and its ``state``."""

    def __init__(self, index: int, process: Any, conn: Any):
        self.index = index
        self.incarnation = 0
        self.attachment: tuple | None = None
        self.state = WorkerState.STARTING
        self._start(process, conn)

    def _start(self, process: Any, conn: Any) -> None:
        self.process, self.conn = process, conn
        self.pending: collections.deque[str] = collections.deque()
        self.info: dict = {}
        self.hung = False  # killed at shutdown without being asked to close

    def replace(self, process: Any, conn: Any) -> None:
        """The replacement process of a restart has started."""
        self.move(WorkerState.STARTING)
        self.incarnation += 1
        self._start(process, conn)

    def move(self, state: WorkerState) -> None:
        if state is self.state:
            return
        if state is not WorkerState.CLOSED and state not in _NEXT[self.state]:
            raise RuntimeError(f"worker {self.index}: {self.state.value} -> {state.value} is not a state change a "
                               "worker makes")
        self.state = state

    @property
    def failed(self) -> bool:
        return self.state is WorkerState.FAILED
