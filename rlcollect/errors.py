"""The errors rlcollect raises that more than one part of the package shares.

``WorkerError`` is raised by the multi-process collectors (a worker process) and by the
distributed collector (a node) alike; both carry the index of the member that failed.

Example:
    >>> from rlcollect.errors import WorkerError
    >>> err = WorkerError("worker 1 was killed by SIGKILL", worker_index=1, exitcode=-9)
    >>> err.worker_index, err.exitcode, isinstance(err, RuntimeError)
    (1, -9, True)
"""

from __future__ import annotations


class WorkerError(RuntimeError):
    """A worker process died, hung past ``worker_timeout``, or failed in a way that cannot be
    re-raised as the original exception type.

    Attributes: ``worker_index``, ``exitcode`` (None if the process is still alive),
    ``worker_traceback`` (the worker's formatted traceback, when there is one).
    """

    def __init__(self, message: str, worker_index: int | None = None, exitcode: int | None = None,
                 worker_traceback: str | None = None):
        super().__init__(message)
        self.worker_index = worker_index
        self.exitcode = exitcode
        self.worker_traceback = worker_traceback

    def __reduce__(self):
        return (WorkerError, (self.args[0], self.worker_index, self.exitcode, self.worker_traceback))


class InferenceUnavailable(RuntimeError):
    """A worker's central inference (``inference="central"``) did not answer: the policy
    raised in the main process (the collector re-raises that error itself), or the collector
    is shutting down."""
