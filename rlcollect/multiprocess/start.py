"""How worker processes start: the accepted start methods, what the default picks, and the fork
server that rlcollect prepares so that a worker starts warm.

``mp_start_method=None`` (the default) picks, when the collector is built:

- "fork" where it is safe: on Linux, when CUDA is not initialised in this process and no other
  thread runs in it (a lock another thread holds at the fork would stay locked forever in the
  worker). rlcollect's own lock-free watchdog thread (in a worker that runs a nested collector)
  does not count. A forked worker starts in a fraction of a second: it has everything imported;
- "forkserver" otherwise, with torch, tensordict, gymnasium and rlcollect's worker code preloaded:
  the first collector of a program starts multiprocessing's fork server (a fresh interpreter,
  started with exec: nothing of the main process's threads or CUDA state comes with it), which
  imports those modules once; every worker is then a fork of that server.

The trade-offs of each method are in docs/multiprocess.md ("Start methods").

Example:
    >>> import threading
    >>> from rlcollect.multiprocess.start import fork_unsafe_reason, resolve_start_method
    >>> resolve_start_method("spawn")
    'spawn'
    >>> resolve_start_method(None) == ("forkserver" if fork_unsafe_reason() else "fork")
    True
    >>> stop = threading.Event()
    >>> thread = threading.Thread(target=stop.wait, name="my-thread")
    >>> thread.start()
    >>> "'my-thread'" in fork_unsafe_reason(), resolve_start_method(None)
    (True, 'forkserver')
    >>> stop.set(); thread.join()
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import sys
import threading
from typing import Any

logger = logging.getLogger("rlcollect")

START_METHODS = ("spawn", "fork", "forkserver")
#: What ``mp_start_method=None`` (the default) means where "fork" is not safe.
DEFAULT_START_METHOD = "forkserver"
#: rlcollect's own threads that hold no lock a forked worker could need (a worker's watchdog
#: polls its parent's pid and sleeps): they do not make "fork" unsafe. Neither does
#: multiprocessing's own resource sharer thread (see ``_fork_safe``).
FORK_SAFE_THREADS = frozenset({"rlcollect-watchdog"})
#: What the fork server imports before it forks the first worker: what every worker imports
#: anyway. A module that is not installed is skipped (multiprocessing ignores its ImportError).
#: The main module is deliberately not in the list (Python's own default preloads it): each
#: worker imports it, as with "spawn", so that code at its top level (a CUDA tensor, a thread,
#: a variable read from the environment) runs in the worker rather than in a process that
#: forks workers.
PRELOAD = ("numpy", "torch", "tensordict", "gymnasium", "rlcollect.multiprocess.worker", "rlcollect.envs.gym")

#: Imported first by a fork server launched from the main thread: see _server_guard.py.
SERVER_GUARD = "rlcollect.multiprocess._server_guard"
#: The launching process's pid, for the guard (set only around the launch).
PARENT_ENV = "RLCOLLECT_FORK_SERVER_PARENT"

_lock = threading.Lock()
_launched: set[int] = set()  # fork servers this process launched with PRELOAD in their list
_noted = False


def resolve_start_method(value: Any) -> str:
    """The start method ``mp_start_method=value`` means: ``None`` (the default) is "fork" where
    ``fork_unsafe_reason()`` finds nothing against it and "forkserver" otherwise; anything else
    must be one of ``START_METHODS`` (``ValueError`` otherwise)."""
    if value is None:
        reason = fork_unsafe_reason()
        if reason is not None:
            logger.debug("rlcollect: workers start from the fork server, not with 'fork': %s", reason)
            return DEFAULT_START_METHOD
        return "fork"
    if not isinstance(value, str) or value not in START_METHODS:
        raise ValueError(f"mp_start_method must be None (the default: 'fork' where it is safe, else "
                         f"{DEFAULT_START_METHOD!r}) or one of {START_METHODS}, got {value!r}")
    return value


def fork_unsafe_reason() -> str | None:
    """Why forking this process now is not safe, or ``None`` when it is: not Linux (or no "fork"
    there), CUDA initialised, a call from another thread than the main one, or another thread
    alive (other than ``FORK_SAFE_THREADS``). Threads that a C extension starts without Python
    (torch's intra-op pool, which torch re-creates in a forked child) are not seen and need not be."""
    if not sys.platform.startswith("linux") or "fork" not in multiprocessing.get_all_start_methods():
        return f"'fork' is not the safe choice on {sys.platform}"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialised in this process"
    if threading.current_thread() is not threading.main_thread():
        return f"the collector is built in a thread other than the main one ({threading.current_thread().name!r})"
    others = sorted(t.name for t in threading.enumerate() if t is not threading.current_thread() and not _fork_safe(t))
    if others:
        return f"another thread runs in this process ({', '.join(map(repr, others[:3]))})"
    return None


def _fork_safe(thread: threading.Thread) -> bool:
    """rlcollect's lock-free threads, and multiprocessing's resource sharer (which serves file
    descriptors sent to other processes and which multiprocessing itself resets in a forked
    child: its after-fork hook re-creates its lock and drops its listener)."""
    if thread.name in FORK_SAFE_THREADS:
        return True
    sharer = sys.modules.get("multiprocessing.resource_sharer")
    return sharer is not None and thread is getattr(sharer._resource_sharer, "_thread", None)


def check_fork_is_safe(method: str, devices: list, policy: Any) -> None:
    """``ValueError`` for "fork" once CUDA is initialised here and the workers would use it: CUDA
    cannot be re-initialised in a forked child (the worker would fail with "Cannot re-initialize
    CUDA in forked subprocess"). Workers that stay on the CPU may still fork."""
    torch = sys.modules.get("torch")
    if method != "fork" or torch is None or not torch.cuda.is_initialized():
        return
    wanted = [str(d) for d in devices if d is not None and torch.device(d).type == "cuda"]
    if policy is not None and hasattr(policy, "parameters"):
        wanted += [str(p.device) for p in policy.parameters() if p.device.type == "cuda"][:1]
    if wanted:
        raise ValueError(
            f"mp_start_method='fork' cannot be used here: CUDA is already initialised in this process and the "
            f"workers would use it ({wanted[0]}), which a forked process cannot. Leave mp_start_method at its "
            f"default (which then picks {DEFAULT_START_METHOD!r}) or pass 'spawn'")


def check_not_bootstrapping() -> None:
    """``RuntimeError`` when this process is itself a worker (or fork server) still importing
    the main module, i.e. a script builds a collector at import time without the
    ``if __name__ == "__main__":`` guard. Raised before anything starts: with "forkserver" a
    fork server would otherwise be launched that imports the script again, and so on."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(
            "a multi-process collector was built while this process was still starting up: it is a worker "
            "(or fork server) importing your main module, which builds a collector at import time. Guard the "
            "code that builds the collector with `if __name__ == '__main__':`")


def get_context(method: str) -> Any:
    """The multiprocessing context for ``method``; for "forkserver", with rlcollect's modules
    added to the fork server's preload list (before it is launched)."""
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        _add_preload(context)
    return context


def _server() -> Any:
    from multiprocessing import forkserver

    return forkserver._forkserver  # the one global fork server; no public accessor


def _add_preload(context: Any) -> None:
    """Add ``PRELOAD`` to the global fork server's list, keeping what the program set itself
    (``multiprocessing.set_forkserver_preload``); Python's untouched default (the main module
    only) is replaced. Takes effect when the server is (re)launched."""
    server = _server()
    with _lock:
        current = list(server._preload_modules)
        base = [] if current == ["__main__"] else current
        wanted = base + [m for m in PRELOAD if m not in base]
        if wanted != current:
            context.set_forkserver_preload(wanted)


def start_fork_server() -> tuple[int | None, bool]:
    """Make sure the global fork server runs; ``(its pid, whether this call launched it)``.

    A server that something else launched without rlcollect's preload list (the program itself,
    another library) is used as it is: its workers import torch themselves, so each start-up
    takes about as long as a "spawn" one. That is logged once."""
    global _noted
    from multiprocessing import forkserver

    server = _server()
    before = server._forkserver_pid
    with _lock:
        # The guard, first in the list, ties the server's life to the thread that launches it
        # (PR_SET_PDEATHSIG): only to the main thread, which lives as long as the program does.
        # The list is read only when the server is launched.
        modules = [m for m in server._preload_modules if m != SERVER_GUARD]
        if threading.current_thread() is threading.main_thread():
            modules.insert(0, SERVER_GUARD)
        server.set_forkserver_preload(modules)
        os.environ[PARENT_ENV] = str(os.getpid())
        try:
            forkserver.ensure_running()
        finally:
            os.environ.pop(PARENT_ENV, None)
    pid = server._forkserver_pid
    launched = pid is not None and pid != before
    if launched and all(m in server._preload_modules for m in PRELOAD):
        _launched.add(pid)
    elif pid is not None and pid not in _launched and not _noted:
        _noted = True
        logger.warning(
            "rlcollect: multiprocessing's fork server (pid %d) was started before rlcollect could preload torch "
            "and its worker code into it; workers fork from it as it is and import them themselves (start-up as "
            "slow as 'spawn'). Build the first collector before starting other 'forkserver' processes, or add "
            "%s to multiprocessing.set_forkserver_preload() before the server starts", pid, list(PRELOAD))
    return pid, launched

