"""``WandbLogger``: a collector's ``stats()`` as Weights & Biases metrics.

Needs the ``wandb`` package (``pip install 'rlcollect[wandb]'``), imported when a logger is
made. The metric names are those of :func:`rlcollect.loggers.base.scalars`; their x-axis is
``<prefix>/step`` (the frames collected, by default), declared with ``define_metric``, so that
the run's own step stays free for the caller's metrics (returns, losses) logged beside them.
"""

from __future__ import annotations

import os
from typing import Any

from rlcollect.loggers.base import StatsLogger

_MISSING = ("WandbLogger needs the wandb package, which rlcollect does not install by default: "
            "pip install 'rlcollect[wandb]' (or pip install wandb)")
MODES = ("online", "offline", "disabled")


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as err:
        raise ImportError(_MISSING) from err
    return wandb


class WandbLogger(StatsLogger):
    """Write a collector's ``stats()`` to a Weights & Biases run.

    Args:
        project: the W&B project of the run this logger starts (default ``"rlcollect"``).
        run: a run you started yourself (``wandb.init(...)``) to log into instead; then
            ``project``, ``name``, ``dir``, ``mode`` and ``config`` must be left out, and
            ``close()`` leaves that run open.
        name: the run's display name (None: W&B picks one).
        dir: the folder W&B writes its files in (None: W&B's default, ``$WANDB_DIR`` or the
            working directory).
        mode: ``"online"``, ``"offline"`` (files only, ``wandb sync`` uploads them later) or
            ``"disabled"``; None: W&B's default (``$WANDB_MODE``, else online).
        config: the run's config (a dict: your hyperparameters).
        prefix: the prefix of every metric name (default ``"collector"``).

    ``log(collector_or_stats, step=None)`` and ``watch(collector)`` are
    :class:`~rlcollect.loggers.StatsLogger`'s; ``run`` is the W&B run, for your own metrics.

    Example:
        >>> import tempfile
        >>> from rlcollect import Collector, WandbLogger
        >>> collector = Collector("CartPole-v1", frames_per_batch=100, total_frames=200)
        >>> with WandbLogger(dir=tempfile.mkdtemp(), mode="disabled") as logger:
        ...     for batch in collector:
        ...         written = logger.log(collector)
        >>> written["collector/frames"]
        200.0
        >>> collector.shutdown()
    """

    def __init__(self, project: str | None = "rlcollect", *, run: Any = None, name: str | None = None,
                 dir: str | os.PathLike | None = None, mode: str | None = None, config: dict | None = None,
                 prefix: str = "collector"):
        super().__init__(prefix=prefix)
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {MODES} or None (W&B's default), got {mode!r}")
        if config is not None and not isinstance(config, dict):
            raise TypeError(f"config must be a dict (the run's hyperparameters) or None, got {type(config).__name__}")
        if dir is not None and not isinstance(dir, (str, os.PathLike)):
            raise TypeError(f"dir must be a folder path (str or os.PathLike) or None, got {dir!r}")
        wandb = _wandb()
        if run is not None:
            given = {"name": name, "dir": dir, "mode": mode, "config": config}
            extra = [key for key, value in given.items() if value is not None]
            if extra or project != "rlcollect":
                raise ValueError(f"run= logs into your own run: leave out {extra or ['project']} (they are that "
                                 "run's, set by wandb.init)")
            if not callable(getattr(run, "log", None)):
                raise TypeError(f"run must be a W&B run (what wandb.init returns), got {type(run).__name__}")
            self.run, self._owns_run = run, False
        else:
            if dir is not None:
                os.makedirs(dir, exist_ok=True)
            self.run = wandb.init(project=project, name=name, dir=None if dir is None else os.fspath(dir), mode=mode,
                                  config=config)
            self._owns_run = True
        self.step_metric = f"{self.prefix}/step"
        self.run.define_metric(f"{self.prefix}/*", step_metric=self.step_metric)
        self._closed = False

    def write(self, values: dict[str, float], step: int) -> None:
        self.run.log({**values, self.step_metric: step})

    def close(self) -> None:
        """Finish the run this logger started (a run given as ``run=`` stays open). Idempotent."""
        if not self._closed:
            self._closed = True
            if self._owns_run:
                self.run.finish()
