"""The worker channel protocol: command names, replies, and how an exception raised in a
worker travels back to the main process and is re-raised there as the same type.

Main -> worker: ``(command, args)`` on the worker's pipe; every command gets exactly one reply,
in order: ``("ok", value)`` or ``("error", packed_exception)``.  The first message a worker sends
is unprompted: ``("ready", description)`` once its collector is built, or ``("error", ...)``.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass

import cloudpickle

from rlcollect.errors import WorkerError

# Commands a worker understands (see worker.py for the handlers).
ATTACH = "attach"  # receive the shared batch buffers
COLLECT = "collect"  # fill a batch slot; reply with its info
SEED = "seed"
RESET = "reset"
STATE_DICT = "state_dict"
LOAD_STATE_DICT = "load_state_dict"
UPDATE_WEIGHTS = "update_weights"  # weights through the channel (MultiProcessWeightSyncScheme)
GETATTR_POLICY = "getattr_policy"
GETATTR_ENV = "getattr_env"
GET_WEIGHTS = "get_weights"  # the worker policy's state, to seed the shared store
ENABLE_PROFILE = "enable_profile"
RUN_FREE = "run_free"  # collect into the replay buffer until the next command; replies then
PAUSE = "pause"  # sent to a worker running free: ends it (the run_free reply comes first)
CLOSE = "close"

OK, ERROR, READY = "ok", "error", "ready"


@dataclass
class PackedException:
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
