"""Free-running collection in a background thread (``start()`` / ``pause()``), for collectors
whose batches are written by this process: the single-process ``Collector``, and a
multi-process collector given a buffer that its workers cannot write to themselves."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator


class BackgroundLoop:
    """Calls ``step()`` over and over in a daemon thread until stopped.

    ``pause()`` is a context manager: on entry it waits for the step in progress to finish and
    no step runs until the block exits. An exception raised by ``step`` stops the loop; it is
    re-raised by the next ``check()``, ``pause()`` or ``stop()``.

    Example:
        >>> import time
        >>> ticks = []
        >>> loop = BackgroundLoop(lambda: (ticks.append(1), time.sleep(0.001)), name="demo")
        >>> loop.start()
        >>> with loop.pause():
        ...     frozen = len(ticks); time.sleep(0.01); assert len(ticks) == frozen
        >>> loop.stop()
    """

    def __init__(self, step: Callable[[], object], name: str):
        self._step = step
        self._cond = threading.Condition()
        self._paused = False
        self._stopping = False
        self._busy = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                    while self._paused and not self._stopping:
                        self._cond.wait()
                    if self._stopping:
                        return
                    self._busy = True
                self._step()
        except BaseException as exc:  # noqa: BLE001  (handed to the controlling thread)
            self.error = exc
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def check(self) -> None:
        """Re-raise the loop's exception, if it stopped on one."""
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    @contextlib.contextmanager
    def pause(self) -> Iterator[None]:
        with self._cond:
            self._paused = True
            while self._busy:
                self._cond.wait()
        try:
            self.check()
            yield
        finally:
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.check()
