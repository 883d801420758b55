"""The errors rlcollect raises that more than one part of the package shares.

``WorkerError`` is raised by the multi-process collectors (a worker process) and by the
distributed collector (a node) alike; both carry the index of the member that failed.
``pack_exception`` / ``unpack_exception`` carry an exception raised in another process (a
worker, or central inference's loop answering a worker) back as the same type, with the
index and traceback of where it was raised.

Example:
    >>> from rlcollect.errors import WorkerError
    >>> err = WorkerError("worker 1 was killed by SIGKILL", worker_index=1, exitcode=-9)
    >>> err.worker_index, err.exitcode, isinstance(err, RuntimeError)
    (1, -9, True)
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass

import cloudpickle


class WorkerError(RuntimeError):
    """A worker process died, hung past ``worker_timeout``, or failed in a way that cannot be
    re-raised as the original exception type.

    The collectors raise it; user code catches it (``except WorkerError as e``) and reads its
    attributes, named after the arguments.

    Args:
        message: what happened, for the user: which worker, in which phase, and what to do.
        worker_index: the index of the worker (a node's, for ``DistributedCollector``) that
            failed, or None when no single worker is to blame.
        exitcode: the worker process's exit status (negative: killed by that signal), or None
            if the process is still alive (a hang) or its status is unknown.
        worker_traceback: the worker's formatted traceback, when it raised one; also appended
            to the message.
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


@dataclass
class PackedException:
    """An exception on its way from a worker to the main process (``pack_exception``)."""

    type_name: str
    message: str
    traceback: str
    worker_index: int | None
    pickled: bytes | None


def pack_exception(exc: BaseException, worker_index: int | None) -> PackedException:
    try:
        pickled = cloudpickle.dumps(exc)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    return PackedException(
        type_name=f"{type(exc).__module__}.{type(exc).__qualname__}",
        message=str(exc),
        traceback="".join(traceback.format_exception(exc)),
        worker_index=worker_index,
        pickled=pickled,
    )


def unpack_exception(packed: PackedException, context: str) -> BaseException:
    """The exception to raise in the main process: the original type when it can be rebuilt
    with a message, with the worker's index and traceback in that message."""
    where = f"worker {packed.worker_index}" if packed.worker_index is not None else "a worker"
    message = f"{packed.message}\n\n[{where}, during {context}; its traceback:]\n{packed.traceback}"
    original = None
    if packed.pickled is not None:
        try:
            original = pickle.loads(packed.pickled)
        except Exception:
            original = None
    if original is not None:
        try:
            exc = type(original)(message)
        except Exception:
            exc = None
        if exc is not None and type(exc) is type(original):
            exc.worker_index = packed.worker_index
            exc.worker_traceback = packed.traceback
            return exc
    return WorkerError(f"{where} raised {packed.type_name}: {message}", packed.worker_index, None, packed.traceback)
