"""Replay buffers: :class:`ReplayBuffer`, a ring of frames shared between processes.

``replay.py`` holds the ring logic (reserve, write, commit, sample); ``storage.py`` the memory
it lives in (a directory of memory-mapped files, or private memory).  Importing this package
does not import tensordict: worker processes that only extend a buffer stay light.
"""

from rlcollect.buffers.replay import ReplayBuffer
from rlcollect.buffers.storage import LockTimeout

__all__ = ["LockTimeout", "ReplayBuffer"]
