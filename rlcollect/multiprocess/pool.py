"""Supervision of worker processes: start-up, commands and replies over each worker's pipe
(``send``/``receive`` for the gathers; ``serving``, ``ask`` and ``ask_all``: the pool contract of
both wings, rlcollect/members.py's ``Pool``), liveness (a dead worker is noticed the moment its
process sentinel fires), per-batch timeouts, and a bounded shutdown (close -> terminate -> kill)
that leaves no process behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from multiprocessing.connection import wait
from collections.abc import Sequence
from typing import Any


from rlcollect._pids import pid_alive
from rlcollect.errors import WorkerError
from rlcollect.multiprocess import protocol as P
from rlcollect.multiprocess.handle import WorkerHandle, WorkerState
from rlcollect.multiprocess import start
from rlcollect.multiprocess.reaper import Reaper
from rlcollect.multiprocess.shm import unclaimed_fds_closed_on_failure
from rlcollect.multiprocess.worker import worker_main

logger = logging.getLogger("rlcollect")

#: How long a dead worker's exit code may take to be known (the fork server reaps it first).
_DEATH_NOTICE_S = 2.0
#: Default ``start_timeout``: "spawn" under load has been measured at 30-40 s for 2 workers.
DEFAULT_START_TIMEOUT_S = 120.0
_OWN_ERROR = "; its own error, if any, is on stderr above"
_MAIN_GUARD_HINT = (
    ". If the script that builds the collector runs it at import time, guard it with "
    "`if __name__ == '__main__':` (with 'spawn', and with 'forkserver', which the default picks instead of "
    "'fork' once another thread runs in the process, e.g. a TensorBoard writer or tqdm's monitor, or CUDA is "
    "initialised, every worker imports the main module); the worker's own error, if any, is on stderr above"
)


def _startup_hint(handle: WorkerHandle, start_method: str) -> str:
    """What a worker that died before it was ready is told: nothing more when a signal killed it
    (someone else's doing); the ``__main__`` guard hint only where it may apply: a first start,
    not "fork" (a replacement imported the main module as its predecessor did)."""
    code = handle.process.exitcode
    if code is not None and code < 0:
        return " before it was ready"
    if handle.incarnation > 0 or start_method == "fork":
        return " before it was ready" + _OWN_ERROR
    return " before it was ready" + _MAIN_GUARD_HINT


@contextlib.contextmanager
def _ctrl_c_deferred():
    """Hold Ctrl-C back while starting a worker (or the fork server).

    A child inherits the signal mask through fork and exec, so with SIGINT blocked here a worker
    starts with Ctrl-C blocked and ignores it from the first line of ``worker_main``: Ctrl-C is
    the main process's to handle (it shuts the workers down), and a worker still importing never
    prints a KeyboardInterrupt traceback. In the main thread the KeyboardInterrupt itself is
    also held back until the worker is started and known to the pool (other threads may take
    the signal despite the mask), then raised: a start cut in the middle would leave a worker
    that nobody shuts down.
    """
    from multiprocessing import resource_tracker

    # Starting the resource tracker unblocks SIGINT in this thread when it is done: have it
    # running (a no-op once it is) before blocking.
    resource_tracker.ensure_running()
    held: list = []
    previous = None
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            previous = handler
            signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
            if held:
                previous(signal.SIGINT, held[0])


def _stop_process(process: Any, grace: float = 1.0) -> None:
    """Terminate, then kill, then reap ``process``."""
    if process.is_alive():
        process.terminate()
        process.join(grace)
    if process.is_alive():
        process.kill()
    process.join(5.0)


def _end_groups(pids: list[int], grace: float = 1.0) -> None:
    """End what is left of the process groups the workers ``pids`` led (each worker leads its
    own, worker.py): what their envs started and did not stop. SIGTERM, then SIGKILL after
    ``grace`` seconds. A pid whose group is empty (the usual case) costs one system call; a group
    id stays reserved while any member lives, so a recycled pid is not hit."""
    left = []
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGTERM)
            left.append(pid)
        except OSError:  # no such group (nothing left), or not ours
            pass
    deadline = time.monotonic() + grace
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [pid for pid in left if _group_exists(pid)]
    for pid in left:
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)


def _group_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except OSError:
        return False
    return True


def _describe_death(handle: WorkerHandle) -> str:
    handle.process.join(0.5)
    code = handle.process.exitcode
    if code is None:
        return "stopped answering"
    if code < 0:
        import signal

        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name} (exit code {code})"
    return f"exited with code {code}"


class WorkerPool:
    """The worker processes of one multi-process collector.

    Args:
        context: a multiprocessing context ("spawn", "fork" or "forkserver"; see start.py).
        payloads: one cloudpickled worker spec per worker.
        num_sub_threads: torch threads in each worker.
        worker_timeout: seconds a worker may spend on one batch (None: no limit).
        start_timeout: seconds a worker may take to build its collector and report ready.
        channels: with central inference, ``channels(index)`` makes the pipes of each start of
            worker ``index`` to the inference loop and returns the worker's ends (handed to it
            as an argument); ``start_guard``: held while a process is started (the loop's lock:
            no forward runs in another thread while this process forks).
    """

    def __init__(self, context: Any, payloads: list[bytes], num_sub_threads: int, worker_timeout: float | None,
                 start_timeout: float = DEFAULT_START_TIMEOUT_S, channels: Any = None, start_guard: Any = None):
        self.context = context
        self.channels = channels
        self.start_guard = start_guard if start_guard is not None else contextlib.nullcontext()
        self.worker_timeout = worker_timeout
        self.start_timeout = start_timeout
        self.num_sub_threads = num_sub_threads
        self.handles: list[WorkerHandle] = []
        self.closed = False
        self._server_booting = False  # a fork server this pool launched has not forked a worker yet
        self.reaper = Reaper()  # before the first worker: it ends them if this process dies
        try:
            self._watch_fork_server()
            # start_timeout counts from here: a fork server's or spawned interpreter's start-up
            # is part of the wait a user sees.
            deadline = time.monotonic() + start_timeout
            for index, payload in enumerate(payloads):
                self._spawn(index, payload, deadline)
            self._await_ready(self.handles, deadline)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                for handle in self.handles:  # Ctrl-C: no worker is waited for, all are terminated now
                    handle.hung = True
                self._stop_own_fork_server()
            self.shutdown(timeout=2.0)
            raise

    def _watch_fork_server(self) -> None:
        """With "forkserver", the server imports its preload list before it serves (seconds) and
        would finish that, and fork a worker, after this process died: the guard ends it too."""
        if self.context.get_start_method() != "forkserver":
            return
        with _ctrl_c_deferred():  # the server's forks inherit its mask
            server_pid, launched = start.start_fork_server()
        if server_pid:
            self.reaper.watch(server_pid)
            if launched:
                self._own_fork_server = server_pid
                self._server_booting = True

    def _stop_own_fork_server(self) -> None:
        """After Ctrl-C during start-up: a fork server this pool launched may still be importing
        the main module (seconds) and only then notice that the main process is gone; end it now.
        multiprocessing launches a new one for the next pool that needs it."""
        pid = getattr(self, "_own_fork_server", None)
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)  # left unreaped: multiprocessing reaps it when relaunching
            except OSError:
                pass

    def _spawn(self, index: int, payload: bytes, deadline: float) -> None:
        """Start worker ``index`` and put its handle in ``self.handles`` (appended, or replacing
        the old one), so that shutdown() always knows it, even if a Ctrl-C deferred during the
        start is raised the moment the mask is restored."""
        parent_conn, child_conn = self.context.Pipe(duplex=True)
        forked_from_server = self.context.get_start_method() == "forkserver"
        # A fork server keeps the environment it was launched with: the worker takes this
        # process's, as a spawned one would.
        environ = dict(os.environ) if forked_from_server else None
        inference = self.channels(index) if self.channels is not None else None
        process = self.context.Process(
            target=worker_main,
            args=(index, payload, child_conn, os.getpid(), self.num_sub_threads, environ, inference),
            name=f"rlcollect-worker-{index}",
            daemon=False,  # a worker may itself run a multi-process collector
        )
        # The first worker of a fork server this pool just launched waits (seconds) for the
        # server to import its preload list: that wait must not hold Ctrl-C back.
        booting = forked_from_server and self._server_booting
        with contextlib.nullcontext() if booting else _ctrl_c_deferred():
            try:
                if booting:
                    self._start_while_server_boots(process, index, deadline)
                else:
                    with self.start_guard:
                        process.start()
            except (OSError, EOFError) as err:
                parent_conn.close()
                if not forked_from_server:
                    raise
                # The server died before it forked this worker: while importing its preload
                # list, or killed.
                raise WorkerError(
                    f"worker {index} could not be started: multiprocessing's fork server exited before forking "
                    f"it ({type(err).__name__}: {err}). It imports its preload list first; its own error, if "
                    "any, is on stderr above. A script that builds a collector at import time must guard it "
                    "with `if __name__ == '__main__':`", index, None) from err
            except WorkerError:
                parent_conn.close()
                raise
            except KeyboardInterrupt:
                if process.pid is None:  # the server was killed before it forked the worker
                    parent_conn.close()
                    raise
                self._register(index, process, parent_conn)  # forked just before: shutdown() ends it
                raise
            finally:
                child_conn.close()
                for conn in inference or ():
                    conn.close()
            self._register(index, process, parent_conn)

    def _register(self, index: int, process: Any, conn: Any) -> None:
        self.reaper.watch(process.pid)
        if index < len(self.handles):  # a restart: the member keeps its handle
            self.handles[index].replace(process, conn)
        else:
            self.handles.append(WorkerHandle(index, process, conn))

    def _start_while_server_boots(self, process: Any, index: int, deadline: float) -> None:
        """``process.start()`` in a helper thread while this thread waits, interruptibly and
        until ``deadline``: on Ctrl-C or past the deadline the fork server (launched by this pool)
        is killed, so the start fails at once without forking the worker (or has just forked it,
        and the caller registers it)."""
        failure: list[BaseException] = []

        def run() -> None:
            try:
                process.start()
            except BaseException as err:  # noqa: BLE001  (re-raised in the calling thread)
                failure.append(err)

        starter = threading.Thread(target=run, name="rlcollect-worker-start", daemon=True)
        starter.start()
        try:
            while starter.is_alive():
                starter.join(0.05)
                if starter.is_alive() and time.monotonic() > deadline:
                    self._stop_own_fork_server()
                    starter.join()
                    if process.pid is None:
                        raise WorkerError(
                            f"worker {index} hung during start-up: multiprocessing's fork server did not finish "
                            f"importing its preload list within start_timeout={self.start_timeout:g} s (a module "
                            "of the list blocks at import?); the fork server was killed", index, None)
        except KeyboardInterrupt:
            self._stop_own_fork_server()
            starter.join()
            raise
        self._server_booting = False
        if failure and process.pid is None:
            raise failure[0]

    def restart(self, index: int, payload: bytes, check: Any = None) -> None:
        """Replace worker ``index`` by a new process built from ``payload`` (the old one is
        killed if it still runs), wait until it is ready (``check(info)`` may refuse what it
        reports), and attach it as the old one was."""
        old = self.handles[index]
        old.move(WorkerState.RESTARTING)
        _stop_process(old.process)
        _end_groups([old.process.pid])
        self.reaper.forget(old.process.pid)
        old.conn.close()
        with contextlib.suppress(ValueError):
            old.process.close()
        deadline = time.monotonic() + self.start_timeout
        self._watch_fork_server()  # relaunched if it died meanwhile
        self._spawn(index, payload, deadline)
        self._await_ready([self.handles[index]], deadline)
        if check is not None:
            check(self.handles[index].info)
        if old.attachment is not None:  # (the same handle, now the replacement's)
            self.attach(index, *old.attachment)

    def attach(self, index: int, *args: Any) -> None:
        """Hand worker ``index`` its shared slots, stop flag and weight store (``P.ATTACH``);
        a replacement started by ``restart`` gets the same (also when this worker dies before
        it answers: its replacement is then handed what it was being handed)."""
        self.handles[index].attachment = args
        with unclaimed_fds_closed_on_failure():  # (a worker dead before it read them never takes its slots)
            self.ask(index, P.ATTACH, *args)

    def __len__(self) -> int:
        return len(self.handles)

    def _await_ready(self, handles: list[WorkerHandle], deadline: float) -> None:
        waiting = {h.index for h in handles}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = sorted(waiting)
                for i in late:
                    self.handles[i].hung = True  # killed at shutdown, not asked
                    self.handles[i].move(WorkerState.FAILED)
                who = f"worker {late[0]}" if len(late) == 1 else f"workers {late}"
                raise WorkerError(
                    f"{who} hung during start-up: not ready within start_timeout={self.start_timeout:g} s (the worker "
                    "builds its env and policy then; a constructor that blocks is the usual cause). Raise "
                    "start_timeout if start-up is legitimately slow", late[0], None)
            for handle in self._wait([self.handles[i] for i in sorted(waiting)], remaining):
                try:
                    kind, value = handle.conn.recv()
                except (EOFError, OSError) as err:
                    handle.move(WorkerState.FAILED)
                    death = _describe_death(handle)
                    raise WorkerError(f"worker {handle.index} {death}{self._hint(handle)}",
                                      handle.index, handle.process.exitcode) from err
                if kind == P.ERROR:
                    handle.move(WorkerState.FAILED)
                    raise P.unpack_exception(value, "start-up")
                handle.info = value
                handle.move(WorkerState.SERVING)
                waiting.discard(handle.index)

    def _hint(self, handle: WorkerHandle) -> str:
        return _startup_hint(handle, self.context.get_start_method())

    def _wait(self, handles: list[WorkerHandle], timeout: float | None) -> list[WorkerHandle]:
        """Handles with a message to read; raises ``WorkerError`` if one of them died first."""
        by_conn = {h.conn: h for h in handles}
        by_sentinel = {h.process.sentinel: h for h in handles}
        ready = wait([*by_conn, *by_sentinel], timeout)
        out = [by_conn[r] for r in ready if r in by_conn]
        for r in ready:
            if r in by_sentinel and by_sentinel[r] not in out:
                dead = by_sentinel[r]
                if dead.conn.poll():
                    # The process closes its file descriptors one by one as it dies, so the
                    # sentinel can fire a moment before its pipe reads as closed. The pipe
                    # holds a last reply or EOF now: reading it raises the WorkerError (or
                    # delivers the reply) instead of reporting "nothing ready".
                    out.append(dead)
                    continue
                dead.move(WorkerState.FAILED)
                death = _describe_death(dead)
                hint = "" if dead.info else self._hint(dead)
                raise WorkerError(f"worker {dead.index} {death}{hint}", dead.index, dead.process.exitcode)
        return out

    # -- requests ---------------------------------------------------------------------------
    def send(self, index: int, command: str, *args: Any) -> None:
        handle = self.handles[index]
        try:
            handle.conn.send((command, args))
        except (BrokenPipeError, ConnectionResetError, EOFError) as err:
            handle.move(WorkerState.FAILED)
            raise WorkerError(f"worker {index} {_describe_death(handle)}", index, handle.process.exitcode) from err
        handle.pending.append(command)

    def receive(self, index: int, timeout: float | None = None) -> Any:
        """The reply to the oldest command sent to worker ``index``."""
        handle = self.handles[index]
        if not handle.conn.poll() and not self._wait([handle], timeout):
            raise self.timed_out(index, timeout)
        try:
            kind, value = handle.conn.recv()
        except (EOFError, OSError) as err:
            handle.move(WorkerState.FAILED)
            raise WorkerError(f"worker {index} {_describe_death(handle)}", index, handle.process.exitcode) from err
        command = handle.pending.popleft()
        if kind == P.ERROR:
            raise P.unpack_exception(value, f"{command!r}")
        return value

    def timed_out(self, index: int, seconds: float | None) -> WorkerError:
        """Mark worker ``index`` hung and build the error saying so."""
        handle = self.handles[index]
        handle.hung = True
        handle.move(WorkerState.FAILED)
        command = handle.pending[0] if handle.pending else "?"
        return WorkerError(f"worker {index} did not answer {command!r} within {seconds} s (worker_timeout)",
                           index, None)

    # -- the pool contract of both wings (rlcollect/members.py's ``Pool``) ---------------------------
    def serving(self) -> list[int]:
        """Every worker (a failed one is replaced or raised before the next command)."""
        return list(range(len(self.handles)))

    def ask(self, index: int, command: str, *args: Any) -> Any:
        """Send worker ``index`` a command and wait for its reply (earlier replies must have been
        read); its exception is re-raised here."""
        if self.handles[index].pending:
            raise RuntimeError(f"worker {index} still owes replies to {list(self.handles[index].pending)}")
        self.send(index, command, *args)
        return self.receive(index)

    def ask_all(self, command: str, *args: Any, members: Sequence[int] | None = None) -> list[Any]:
        """``command`` sent to each of ``members`` (None: every worker) before any reply is read,
        so that they run it together; their replies, in order."""
        indices = self.serving() if members is None else members
        for i in indices:
            self.send(i, command, *args)
        return [self.receive(i) for i in indices]

    def ready(self, indices: list[int], timeout: float | None) -> list[int]:
        """Indices among ``indices`` with a reply waiting (after up to ``timeout`` seconds)."""
        handles = [self.handles[i] for i in indices]
        already = [h.index for h in handles if h.conn.poll()]
        if already:
            return already
        return [h.index for h in self._wait(handles, timeout)]

    def raise_if_dead(self, index: int) -> None:
        """Raise ``WorkerError`` if worker ``index``'s process has died (a zombie counts), even
        when its sentinel has not fired yet: with "forkserver" the server reports the exit
        only once it has reaped the process, a moment after the death."""
        handle = self.handles[index]
        if pid_alive(handle.process.pid):
            return
        handle.process.join(_DEATH_NOTICE_S)  # the exit code, for the message
        handle.move(WorkerState.FAILED)
        raise WorkerError(f"worker {index} {_describe_death(handle)}", index, handle.process.exitcode)

    def busy(self, index: int) -> bool:
        """Whether worker ``index`` owes a reply."""
        return bool(self.handles[index].pending)

    def next_reply(self, index: int) -> str:
        """The command whose reply worker ``index`` sends next."""
        return self.handles[index].pending[0]

    def pids(self) -> list[int]:
        return [h.process.pid for h in self.handles]

    def alive(self) -> list[bool]:
        return [h.process.is_alive() and h.state is not WorkerState.FAILED for h in self.handles]

    # -- shutdown -------------------------------------------------------------------------------
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every worker: ask politely, then terminate, then kill. Idempotent."""
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + max(timeout, 0.1) * 0.6
        for handle in self.handles:
            if handle.process.is_alive() and not handle.hung:
                try:
                    handle.conn.send((P.CLOSE, ()))
                except (OSError, ValueError):
                    pass
        for handle in self.handles:
            if not handle.hung:
                handle.process.join(max(0.0, deadline - time.monotonic()))
        for handle in self.handles:
            if handle.process.is_alive():
                handle.process.terminate()
        kill_at = time.monotonic() + max(timeout, 0.1) * 0.2
        for handle in self.handles:
            handle.process.join(max(0.0, kill_at - time.monotonic()))
            if handle.process.is_alive():
                handle.process.kill()
                handle.process.join(5.0)
        _end_groups([handle.process.pid for handle in self.handles])
        for handle in self.handles:
            handle.move(WorkerState.CLOSED)
            handle.attachment = None  # the shared slots and stores: freed with the collector's
            handle.conn.close()
            try:
                handle.process.close()
            except ValueError:
                logger.error("rlcollect: worker %d could not be reaped", handle.index)
        # Clears what it watches (the fork server lives on for other pools) and exits.
        self.reaper.close()


class Attach:
    """``attach(i)``: hand worker ``i`` its slots, stop flag, weight store and (central
    inference) its rows of the shared block."""

    def __init__(self, pool: WorkerPool, slots: Any, stops: list[Any], acting: Any):
        self.pool, self.slots, self.stops, self.acting = pool, slots, stops, acting

    def __call__(self, index: int) -> None:
        self.pool.attach(index, self.slots.handed(index), self.stops[index], self.acting.store_for(index),
                         self.acting.attachment(index), self.slots.layout_of(index))
