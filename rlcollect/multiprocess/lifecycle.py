"""Starting a multi-process collector's workers, and stopping them: the start-method checks, the
main process's torch threads, where the policy acts (acting.py) and the ``WorkerPool``
(pool.py), brought up in that order and undone in the reverse one.  The faces (collector.py)
call :func:`start_workers` once, when they are built, and :func:`stop_workers` at shutdown or
when they are garbage-collected; wiring the started workers into slots and a gather stays theirs.
"""

from __future__ import annotations

import os
from typing import Any

import cloudpickle
import torch

from rlcollect.multiprocess import start
from rlcollect.multiprocess.acting import acting_for
from rlcollect.multiprocess.pool import WorkerPool


def start_workers(cfg: Any, policy: Any, num_threads: int | None) -> tuple[WorkerPool, Any, int]:
    """Check the start method, set this process's torch threads (``num_threads``, or the cores
    the workers leave), start where the policy acts and the worker processes.

    Returns ``(pool, acting, previous_threads)``; on an error nothing is left running and the
    torch threads are restored.
    """
    start.check_fork_is_safe(cfg.mp_start_method, [d for ds in cfg.devices.values() for d in ds], policy)
    start.check_not_bootstrapping()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or max(1, (os.cpu_count() or 1) - cfg.num_workers))
    acting = None
    try:
        acting = acting_for(cfg)
        context = start.get_context(cfg.mp_start_method)
        pool = WorkerPool(context, [cloudpickle.dumps(spec) for spec in cfg.specs], cfg.num_sub_threads,
                          cfg.worker_timeout, cfg.start_timeout, channels=acting.channels(context),
                          start_guard=acting.start_guard)
    except BaseException:
        torch.set_num_threads(previous_threads)  # no shutdown() will run to restore it
        if acting is not None:
            acting.close()
        raise
    return pool, acting, previous_threads


def stop_workers(pool: WorkerPool, threads: int, acting: Any = None, timeout: float = 10.0) -> None:
    """Stop where the policy acts, then the workers (close -> terminate -> kill within
    ``timeout``), and give this process back its ``threads`` torch threads."""
    if acting is not None:  # first: a worker waiting for its actions gets an error at once, and exits
        acting.close()
    pool.shutdown(timeout)
    torch.set_num_threads(threads)
