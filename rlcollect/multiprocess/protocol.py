"""The worker channel protocol: command names and replies (an exception raised in a worker
travels back packed by ``rlcollect.errors.pack_exception`` and is re-raised as the same type).

Main -> worker: ``(command, args)`` on the worker's pipe; every command gets exactly one reply,
in order: ``("ok", value)`` or ``("error", packed_exception)``.  The first message a worker sends
is unprompted: ``("ready", description)`` once its collector is built, or ``("error", ...)``.
"""

from __future__ import annotations

import torch

# How an exception crosses a process boundary lives in errors.py (central inference uses it too).
from rlcollect.errors import PackedException, pack_exception, unpack_exception  # noqa: F401

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

# Each worker's shared control block (an int64 tensor handed with ATTACH): the main process sets
# STOP_FLAG to make it stop at its next step (preemption); while running free the worker adds
# each batch it wrote completely into the replay buffer to FREE_FRAMES (the main process zeroes it
# before each RUN_FREE), so the frames of a worker killed while running free are still counted.
STOP_FLAG, FREE_FRAMES = 0, 1


def control_block() -> torch.Tensor:
    """A worker's shared control block: ``[STOP_FLAG, FREE_FRAMES]``, zeroed."""
    return torch.zeros(2, dtype=torch.int64).share_memory_()
