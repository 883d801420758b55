"""The job the "submitit" launcher submits: run by path (``runpy.run_path``), so that unpickling
the job imports only ``runpy``, and this file watches rank 0's process before it imports
anything heavy (rlcollect imports torch: seconds).  A rank 0 that dies while its local jobs
still import is so noticed within 0.1 s, not after the imports.

``RLCOLLECT_NODE_ARGS`` (given as ``init_globals``) holds ``run_node``'s arguments; ``parent``
among them is rank 0's ``(pid, host)``.  The job's result is ``{"exit_code": code}``.
"""

import os
import socket
import threading
import time


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def _watch(pid: int) -> None:
    while _alive(pid):
        time.sleep(0.1)
    os.write(2, b"rlcollect node: rank 0's process is gone; exiting\n")
    os._exit(3)


_args = dict(globals()["RLCOLLECT_NODE_ARGS"])
_parent = _args.get("parent")
if _parent is not None and _parent[1] == socket.gethostname():
    threading.Thread(target=_watch, args=(int(_parent[0]),), name="rlcollect-rank0-pid", daemon=True).start()

from rlcollect.distributed.node import run_node  # noqa: E402  (after the watch: the slow import)

_code = run_node(**_args)
globals().clear()  # run_path returns these globals: the job's result must pickle
exit_code = _code
