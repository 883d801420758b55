"""Replay buffers: :class:`ReplayBuffer`, a ring of frames shared between processes.

``replay.py`` holds the ring logic (write, sample, share, close), ``seqlock.py`` how concurrent
writers and readers stay exact (reserve, commit, torn-free read); ``storage.py`` the memory
it lives in (a directory of memory-mapped files, or private memory).  Importing this package
does not import tensordict: worker processes that only extend a buffer stay light.
"""

from rlcollect.buffers.replay import ReplayBuffer
from rlcollect.buffers.storage import LockTimeout

__all__ = ["LockTimeout", "ReplayBuffer"]
