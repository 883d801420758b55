"""Free-running multi-process collection (docs/replay-buffer.md, "Free-running"): what
``start()``, ``pause()`` and ``async_shutdown()`` do, behind one interface with two
strategies (``free_running(config)`` picks one):

- ``start(step)``; ``suspend()`` / ``resume()`` (``pause()``'s block: nothing is written in
  between); ``stop()``; ``check()`` (a failure surfaced); ``running``; ``close(timeout)`` (at
  shutdown: the error a background loop hit, or None). ``suspend``, ``stop`` and ``check``
  return ``(frames, failures)``: the frames written since they were last counted, and the
  workers found failed, ``(index, error)``, which the collector's ``Members`` has replaced
  (``recovered(index)`` sends a replacement back to running free) or, at the final stop, only
  forgiven. Free running never repairs a failure itself.

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
from rlcollect.members import MemberStats

#: What ``suspend``, ``stop`` and ``check`` return: the frames written, the workers found failed.
Counted = tuple[int, list[tuple[int, BaseException]]]


def free_running(config: Any, pool: Any, stats: MemberStats, controls: list) -> Any:
    """The workers write the replay buffer themselves (an rlcollect ``ReplayBuffer``), or
    this process does from a background thread. ``controls``: each worker's shared control
    block (protocol.py)."""
    if config.workers_write:
        return FreeRunningWorkers(pool, stats, config.init_random_frames, controls)
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

    def suspend(self) -> Counted:
        """Wait for the batch in progress (re-raising the error the loop hit)."""
        self._paused = self.loop.pause()
        self._paused.__enter__()
        return 0, []

    def resume(self) -> None:
        paused, self._paused = self._paused, None
        if paused is not None:
            paused.__exit__(None, None, None)

    def check(self) -> Counted:
        return 0, []

    def recovered(self, index: int) -> None:
        """(the background thread's failures end it: none is repaired here)"""

    def written(self) -> None:
        """Nothing to add: the background thread counts each batch as it writes it."""
        return None

    def stop(self, final: bool = True) -> Counted:
        self.close(10.0, raise_error=True)
        return 0, []

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
    ``FREE_FRAMES``, protocol.py) and it is returned among the failures; the collector's
    ``Members`` then has it restarted (re-raising its error when no restart is allowed) and
    ``recovered`` sends the replacement ``run_free``. At the final stop (``async_shutdown``) it
    is not replaced, only counted.

    Args:
        pool: the ``WorkerPool``.
        stats: where what the workers wrote is counted.
        init_random_frames: sent with ``run_free``: each worker acts randomly while the
            buffer's ``write_count`` is below it.
        controls: each worker's shared control block (protocol.py): ``FREE_FRAMES`` is zeroed
            before each ``run_free`` and counts what the worker wrote since.
    """

    def __init__(self, pool: Any, stats: MemberStats, init_random_frames: int, controls: list):
        self.pool, self.stats = pool, stats
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

    def suspend(self) -> Counted:
        return self.stop(final=False)

    def resume(self) -> None:
        self.start()

    def close(self, timeout: float) -> None:
        self.running = False

    def stop(self, final: bool = True) -> Counted:
        """Send ``pause`` to every worker and read what they owe: the ``run_free`` reply (the
        frames written, or the error that stopped the worker), then the ``pause`` reply.
        Returns the frames written since ``start`` and the workers that failed meanwhile (to be
        restarted, idle; at the ``final`` stop only forgiven)."""
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
        failed = []
        for i, failure in failures.items():
            frames += self._written(i, failure)
            failed.append((index_of(failure, i), failure))
        # Each failure's traceback holds this frame, which holds them: a cycle that would keep
        # the shared tensors the frames reach (each an open fd) until the next garbage collection.
        failures.clear()
        failure = None
        return frames, failed

    def check(self) -> Counted:
        """Surface the workers that failed while running free: the frames they had written, and
        the failures (``recovered`` sends each replacement ``run_free``)."""
        if not self.running:
            return 0, []
        pool, frames, failed = self.pool, 0, []
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
                failed.append((index_of(err, i), err))
        return frames, failed

    def recovered(self, index: int) -> None:
        """Worker ``index`` was replaced while running free: it runs free again."""
        if self.running:
            self._run_free(index)

    def written(self) -> list[int] | None:
        """What each worker has written since it was last counted (its ``FREE_FRAMES``, read live
        while running free: ``stats()`` adds it to what was counted), or None when not running."""
        if not self.running:
            return None
        return [int(control[P.FREE_FRAMES]) for control in self.controls]

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
