"""Free-running multi-process collection (docs/replay-buffer.md, "Free-running"): ``start()``, ``pause()``, ``async_shutdown()``.

With an rlcollect ``ReplayBuffer`` the workers write into it themselves: ``start()`` sends each
worker ``run_free`` and returns; a worker then collects batch after batch straight into the
buffer, checking its pipe between batches. ``pause()`` sends ``pause``: the worker finishes the
batch in progress, answers ``run_free`` (with what it wrote), then ``pause``; nothing more is
written until the block exits and ``run_free`` is sent again. A worker failure while running free
surfaces at the next ``pause()``, ``update_policy_weights_()``, ``stats()`` or
``async_shutdown()`` (and is restarted when ``on_worker_failure="restart"``).

With any other buffer (an object with ``extend()`` the workers cannot share), the main process
runs the collection loop in a background thread and extends the buffer itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rlcollect.collector import frames_written
from rlcollect.freerun import BackgroundLoop
from rlcollect.errors import WorkerError
from rlcollect.multiprocess import protocol as P


class FreeRunning:
    """Mixin of the multi-process collectors (see the module docstring)."""

    _running_free = False
    _loop: BackgroundLoop | None = None

    def start(self) -> None:
        """Collect continuously into the replay buffer; returns at once.

        Example:
            >>> from rlcollect import MultiAsyncCollector, ReplayBuffer
            >>> rb = ReplayBuffer(10_000)
            >>> c = MultiAsyncCollector("CartPole-v1", num_workers=2, frames_per_batch=200, replay_buffer=rb)
            >>> c.start()
            >>> with c.pause():
            ...     frozen = rb.write_count
            >>> c.async_shutdown(); rb.close()
        """
        self._check_open()
        if self.replay_buffer is None:
            raise RuntimeError("start() needs a replay_buffer: batches collected while running free go there")
        if self._running_free or self._loop is not None:
            raise RuntimeError("start() was already called; use pause() to stop writing for a while")
        with self._guard():
            self._discard_in_flight()
            if self._workers_write:
                self._run_free()
            else:
                self._loop = BackgroundLoop(self._next_batch, name="rlcollect-multi-collector")
                self._loop.start()

    def _run_free(self) -> None:
        for i in range(self.num_workers):
            self._pool.send(i, P.RUN_FREE, self.init_random_frames)
        self._running_free = True

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        """Within the block nothing is written to the buffer (batches in progress finish first)."""
        self._check_open()
        if self._loop is not None:
            with self._loop.pause():
                yield
            return
        if not self._running_free:
            raise RuntimeError("pause() needs a collector running free: call start() first")
        with self._guard():
            self._stop_running_free()
        try:
            yield
        finally:
            if not self._closed:
                with self._guard():
                    self._run_free()

    def _stop_running_free(self) -> None:
        """Send ``pause`` to every worker and read what they owe: the ``run_free`` reply (the
        frames written, or the error that stopped the worker), then the ``pause`` reply."""
        pool = self._pool
        for i in range(self.num_workers):
            pool.send(i, P.PAUSE)
        for i in range(self.num_workers):
            failure = None
            while pool.handles[i].pending:
                command = pool.handles[i].pending[0]
                try:
                    info = pool.receive(i)
                except WorkerError as err:  # dead or hung: nothing more to read
                    failure = err
                    break
                except Exception as err:  # run_free raised; the pause reply still follows
                    failure = err
                    continue
                if command == P.RUN_FREE:
                    self._account_free(i, info)
            if failure is not None:
                self._recover(index_of(failure, i), failure)
        self._running_free = False

    def _account_free(self, index: int, info: dict) -> None:
        self._frames += info["frames"]
        self._worker_frames[index] += info["frames"]
        self._worker_versions[index] = info["version"]
        self._worker_steps[index] = (info["meta"]["step_mean_s"], info["meta"]["step_p95_s"])

    def _check_running_free(self) -> None:
        """Surface a worker that failed while running free (restarting it when allowed)."""
        if not self._running_free:
            return
        pool = self._pool
        for i in range(self.num_workers):
            try:
                ready = pool.ready([i], 0.0)
                if ready:  # a worker only answers run_free when it stops: here, on an error
                    info = pool.receive(i)
                    self._account_free(i, info)
                    pool.send(i, P.RUN_FREE, self.init_random_frames)
            except Exception as err:
                self._recover(index_of(err, i), err)
                pool.send(i, P.RUN_FREE, self.init_random_frames)

    @contextlib.contextmanager
    def _control(self) -> Iterator[None]:
        """Control calls made while running free pause the workers around themselves."""
        if self._running_free or self._loop is not None:
            with self.pause():
                yield
        else:
            yield

    def async_shutdown(self, timeout: float | None = None) -> None:
        """Stop running free (writes stop after the batches in progress), then shut down
        (``timeout=None``: 10 s, as ``shutdown``)."""
        timeout = 10.0 if timeout is None else timeout
        try:
            if not self._closed:
                if self._loop is not None:
                    loop, self._loop = self._loop, None
                    loop.stop(timeout)
                elif self._running_free:
                    with self._guard():
                        self._stop_running_free()
        finally:
            self.shutdown(timeout)

    def _random_now(self) -> bool:
        return frames_written(self.replay_buffer, self._frames) < self.init_random_frames


def index_of(error: BaseException, default: int) -> int:
    index = getattr(error, "worker_index", None)
    return default if index is None else index
