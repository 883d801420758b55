"""Loggers: a collector's ``stats()`` written to TensorBoard, Weights & Biases or MLflow through
one interface (:class:`StatsLogger`: ``log``, ``watch``, ``close``). Each backend imports its
package only when a logger is made (the extras ``tensorboard``, ``wandb``, ``mlflow``)."""

from rlcollect.loggers.base import SCALAR_KEYS, WORKER_SCALAR_KEYS, StatsLogger, scalars
from rlcollect.loggers.mlflow import MLflowLogger
from rlcollect.loggers.tensorboard import TensorBoardLogger
from rlcollect.loggers.wandb import WandbLogger
from rlcollect.loggers.watch import StatsWatcher

__all__ = ["MLflowLogger", "SCALAR_KEYS", "StatsLogger", "StatsWatcher", "TensorBoardLogger", "WORKER_SCALAR_KEYS",
           "WandbLogger", "scalars"]
