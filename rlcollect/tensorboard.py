"""The former home of ``TensorBoardLogger`` (now ``rlcollect/loggers/tensorboard.py``): this
path keeps importing it, with the scalar helpers it had."""

from rlcollect.loggers.base import SCALAR_KEYS, WORKER_SCALAR_KEYS, scalars
from rlcollect.loggers.tensorboard import TensorBoardLogger

__all__ = ["SCALAR_KEYS", "TensorBoardLogger", "WORKER_SCALAR_KEYS", "scalars"]
