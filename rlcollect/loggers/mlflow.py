"""``MLflowLogger``: a collector's ``stats()`` as MLflow metrics.

Needs MLflow's client (``pip install 'rlcollect[mlflow]'``: ``mlflow-skinny``, enough for a
tracking server or a file store; the full ``mlflow`` package works too), imported when a logger
is made. It writes through an ``MlflowClient`` of its own, not through ``mlflow``'s global
active run, so a logger in a thread or beside your own ``mlflow.start_run()`` is not confused
with it. The metric names are those of :func:`rlcollect.loggers.base.scalars`.
"""

from __future__ import annotations

import time
from typing import Any

from rlcollect.loggers.base import StatsLogger

_MISSING = ("MLflowLogger needs MLflow's client, which rlcollect does not install by default: "
            "pip install 'rlcollect[mlflow]' (or pip install mlflow-skinny)")


def _mlflow() -> tuple[Any, Any]:
    try:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient
    except ImportError as err:
        raise ImportError(_MISSING) from err
    return MlflowClient, Metric


class MLflowLogger(StatsLogger):
    """Write a collector's ``stats()`` to an MLflow run.

    Args:
        experiment: the name of the experiment of the run this logger starts (created if
            missing; default ``"rlcollect"``).
        run_id: the id of a run you started yourself to log into instead (``close()`` leaves it
            running); then ``run_name`` must be left out.
        run_name: the name of the run this logger starts (None: MLflow picks one).
        tracking_uri: where runs are kept: a tracking server (``http://...``), a database, or a
            file store (``file:///path``; MLflow 3 wants ``MLFLOW_ALLOW_FILE_STORE=true`` for
            that one). None: MLflow's default (``$MLFLOW_TRACKING_URI``, or
            ``mlflow.set_tracking_uri``'s).
        prefix: the prefix of every metric name (default ``"collector"``).

    ``log(collector_or_stats, step=None)`` and ``watch(collector)`` are
    :class:`~rlcollect.loggers.StatsLogger`'s; ``client`` and ``run_id`` are there for your own
    metrics in the same run (``logger.client.log_metric(logger.run_id, "train/loss", 0.1)``).

    Example:
        >>> import os, tempfile
        >>> from rlcollect import Collector, MLflowLogger
        >>> os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        >>> store = "file://" + tempfile.mkdtemp()
        >>> collector = Collector("CartPole-v1", frames_per_batch=100, total_frames=200)
        >>> with MLflowLogger("cartpole", tracking_uri=store) as logger:
        ...     for batch in collector:
        ...         _ = logger.log(collector)
        >>> [(m.step, m.value) for m in logger.client.get_metric_history(logger.run_id, "collector/frames")]
        [(100, 100.0), (200, 200.0)]
        >>> collector.shutdown()
    """

    def __init__(self, experiment: str = "rlcollect", *, run_id: str | None = None, run_name: str | None = None,
                 tracking_uri: str | None = None, prefix: str = "collector"):
        super().__init__(prefix=prefix)
        if not isinstance(experiment, str) or not experiment:
            raise ValueError(f"experiment must be a non-empty string (an experiment name), got {experiment!r}")
        if tracking_uri is not None and not isinstance(tracking_uri, str):
            raise TypeError(f"tracking_uri must be a string (a URI) or None, got {tracking_uri!r}")
        if run_id is not None and run_name is not None:
            raise ValueError(f"run_id= logs into your own run: leave out run_name (got {run_name!r})")
        client_class, self._metric = _mlflow()
        self.client = client_class(tracking_uri)
        if run_id is None:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            self._owns_run = True
        else:
            self.run_id = self.client.get_run(run_id).info.run_id  # an unknown id fails here, not at the first log
            self._owns_run = False
        self._closed = False

    def write(self, values: dict[str, float], step: int) -> None:
        now_ms = int(time.time() * 1000)
        metrics = [self._metric(key=tag, value=value, timestamp=now_ms, step=step) for tag, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        """Mark the run this logger started finished (a run given as ``run_id=`` stays
        running). Idempotent."""
        if not self._closed:
            self._closed = True
            if self._owns_run:
                self.client.set_terminated(self.run_id)
