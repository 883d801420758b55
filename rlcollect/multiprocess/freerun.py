"""Free-running multi-process collection (docs/replay-buffer.md, "Free-running"): what
``start()``, ``pause()`` and ``async_shutdown()`` do, behind one interface with two
strategies (``free_running(config)`` picks one):

- ``start(step)``; ``suspend()`` / ``resume()`` (``pause()``'s block: nothing is written in
  between; ``suspend`` returns the frames written since ``start``); ``stop()`` (the frames
  written); ``check()`` (a failure surfaced, the frames it had written); ``running``;
  ``close(timeout)`` (at shutdown: the error a background loop hit, or None).

With an rlcollect ``ReplayBuffer`` the workers write into it themselves: ``start()`` sends each
worker ``run_free`` and returns; a worker then collects batch after batch straight into the
buffer, checking its pipe between batches. ``pause()`` sends ``pause``: the worker finishes the
batch in progress, answers ``run_free`` (with what it wrote), then ``pause``; nothing more is
written until the block exits and ``run_free`` is sent again. A worker failure while running free
surfaces at the next ``pause()``, ``update_policy_weights_()``, ``stats()`` or
``async_shutdown()``: the frames it wrote completely are counted (its control block, protocol.py),
and it is restarted when ``on_worker_failure="restart"`` (at ``async_shutdown()`` only counted;
with "raise", or past ``max_worker_restarts``, its ``WorkerError`` is raised).

With any other buffer (an object with ``extend()`` the workers cannot share), the main process
runs the collection loop in a background thread (rlcollect/freerun.py) and extends the buffer
itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlcollect.errors import WorkerError
from rlcollect.freerun import BackgroundLoop
from rlcollect.multiprocess import protocol as P
from rlcollect.multiprocess.recovery import WorkerRestarts
from rlcollect.multiprocess.stats import WorkerStats


def free_running(config: Any, pool: Any, restarts: WorkerRestarts, stats: WorkerStats, controls: list) -> Any:
    """The workers write the replay buffer themselves (an rlcollect ``ReplayBuffer``), or
    this process does from a background thread. ``controls``: each worker's shared control
    block (protocol.py)."""
    if config.workers_write:
        return FreeRunningWorkers(pool, restarts, stats, config.init_random_frames, controls)
    return BackgroundThread()


class BackgroundThread:
    """This process collects in a background thread (``rlcollect.freerun.BackgroundLoop``) and
    extends the buffer itself."""

    def __init__(self) -> None:
        self.loop: BackgroundLoop | None = None
        self._paused: Any = None

    @property
    def running(self) -> bool:
        return self.loop is not None

    def start(self, step: Callable[[], Any]) -> None:
        self.loop = BackgroundLoop(step, name="rlcollect-multi-collector")
        self.loop.start()

    def suspend(self) -> int:
        """Wait for the batch in progress (re-raising the error the loop hit)."""
        self._paused = self.loop.pause()
        self._paused.__enter__()
        return 0

    def resume(self) -> None:
        paused, self._paused = self._paused, None
        if paused is not None:
            paused.__exit__(None, None, None)

    def check(self) -> int:
        return 0

    def written(self) -> None:
        """Nothing to add: the background thread counts each batch as it writes it."""
        return None

    def stop(self) -> int:
        return self.close(10.0, raise_error=True) or 0

    def close(self, timeout: float, raise_error: bool = False) -> BaseException | None:
        loop, self.loop = self.loop, None
        if loop is None:
            return None
        try:
            loop.stop(timeout)
        except Exception as err:  # noqa: BLE001  (raised once everything is shut down)
            if raise_error:
                raise
            return err
        return None


class FreeRunningWorkers:
    """The workers of one collector writing into a shared replay buffer on their own.

    A worker that fails while running free (killed, say) is found by the next ``check()`` or
    ``stop()``: the frames it had written completely are counted (its control block's
    ``FREE_FRAMES``, protocol.py), then it is restarted (``restarts.recover``, which re-raises
    its error when no restart is allowed). At the final stop (``async_shutdown``) it is not
    replaced, only counted (``restarts.forgive``).

    Args:
        pool: the ``WorkerPool``.
        restarts: replaces a worker that failed while running free (or re-raises its error).
        stats: where what the workers wrote is counted.
        init_random_frames: sent with ``run_free``: each worker acts randomly while the
            buffer's ``write_count`` is below it.
        controls: each worker's shared control block (protocol.py): ``FREE_FRAMES`` is zeroed
            before each ``run_free`` and counts what the worker wrote since.
    """

    def __init__(self, pool: Any, restarts: WorkerRestarts, stats: WorkerStats, init_random_frames: int,
                 controls: list):
        self.pool, self.restarts, self.stats = pool, restarts, stats
        self.init_random_frames = init_random_frames
        self.controls = controls
        self.running = False

    def start(self, step: Any = None) -> None:
        for i in range(len(self.pool)):
            self._run_free(i)
        self.running = True

    def _run_free(self, index: int) -> None:
        self.controls[index][P.FREE_FRAMES] = 0
        self.pool.send(index, P.RUN_FREE, self.init_random_frames)

    def suspend(self) -> int:
        return self.stop(final=False)

    def resume(self) -> None:
        self.start()

    def close(self, timeout: float) -> None:
        self.running = False

    def stop(self, final: bool = True) -> int:
        """Send ``pause`` to every worker and read what they owe: the ``run_free`` reply (the
        frames written, or the error that stopped the worker), then the ``pause`` reply. A
        worker that failed meanwhile is restarted (not when ``final``: only counted), idle.
        Returns the frames written since ``start``."""
        pool, frames = self.pool, 0
        failures: dict[int, BaseException] = {}
        for i in range(len(pool)):
            try:
                pool.send(i, P.PAUSE)
            except WorkerError as err:  # died while running free: its pipe is broken
                failures[i] = err
        for i in range(len(pool)):
            while i not in failures and pool.handles[i].pending:
                command = pool.handles[i].pending[0]
                try:
                    info = pool.receive(i)
                except WorkerError as err:  # dead or hung: nothing more to read
                    failures[i] = err
                    break
                except Exception as err:  # run_free raised; the pause reply still follows
                    failures[i] = err
                    continue
                if command == P.RUN_FREE:
                    frames += self._account(i, info)
        self.running = False
        try:
            for i, failure in failures.items():
                frames += self._written(i, failure)
                self._replace(index_of(failure, i), failure, final)
        finally:
            # Each failure's traceback holds this frame, which holds them: a cycle that would keep
            # the shared tensors the frames reach (each an open fd) until the next garbage collection.
            failures.clear()
            failure = None
        return frames

    def check(self) -> int:
        """Surface a worker that failed while running free (restarting it when allowed, and
        sending it ``run_free``); returns the frames such a worker had written."""
        if not self.running:
            return 0
        pool, frames = self.pool, 0
        for i in range(len(pool)):
            try:
                ready = pool.ready([i], 0.0)
                if not ready:  # killed a moment ago: its pipe or sentinel may not tell yet
                    pool.raise_if_dead(i)
                if ready:  # a worker only answers run_free when it stops: here, on an error
                    info = pool.receive(i)
                    frames += self._account(i, info)
                    self._run_free(i)
            except Exception as err:
                frames += self._written(i, err)
                self._replace(index_of(err, i), err, final=False)
                self._run_free(i)
        return frames

    def written(self) -> list[int] | None:
        """What each worker has written since it was last counted (its ``FREE_FRAMES``, read live
        while running free: ``stats()`` adds it to what was counted), or None when not running."""
        if not self.running:
            return None
        return [int(control[P.FREE_FRAMES]) for control in self.controls]

    def _replace(self, index: int, error: BaseException, final: bool) -> None:
        if final:
            self.restarts.forgive(index, error)
        else:
            self.restarts.recover(index, error)

    def _written(self, index: int, error: BaseException) -> int:
        """The frames worker ``index`` wrote completely before ``error`` stopped it (its run_free
        reply never came). A batch it was writing when killed is lost: its slots are reserved
        (in the buffer's ``write_count``) but never complete, and ``sample()`` skips them."""
        frames = int(self.controls[index][P.FREE_FRAMES])
        self.controls[index][P.FREE_FRAMES] = 0
        self.stats.note_frames(index, frames)
        return frames

    def _account(self, index: int, info: dict) -> int:
        self.controls[index][P.FREE_FRAMES] = 0
        self.stats.note_worker(index, info)
        return info["frames"]


def index_of(error: BaseException, default: int) -> int:
    index = getattr(error, "worker_index", None)
    return default if index is None else index
