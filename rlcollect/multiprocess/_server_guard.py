"""The first module of the preload list of a fork server that rlcollect launches: it asks the
kernel to SIGKILL the server the moment the process that launched it dies (``PR_SET_PDEATHSIG``).
The server imports the rest of its list (torch: seconds) before it serves; a main process killed
in that time, before its guard process has the server's pid, no longer leaves the server running
until the import is done. A fork clears the setting, so the workers forked from the server are
not concerned (each has its own watchdog).

The launching process's pid comes in ``RLCOLLECT_FORK_SERVER_PARENT`` (set around the launch only):
if that process died before the setting took effect, the server exits at once. Without the variable
(a fork server that someone else launched), importing this module does nothing.

Example:
    >>> import rlcollect.multiprocess._server_guard as guard
    >>> guard.PARENT_ENV
    'RLCOLLECT_FORK_SERVER_PARENT'
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

from rlcollect.multiprocess.start import PARENT_ENV  # start.py sets it around the launch

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _arm() -> None:
    expected = os.environ.pop(PARENT_ENV, None)
    if expected is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError, ValueError):
        return
    if os.getppid() != int(expected):  # the launcher died before the setting took effect
        os._exit(1)


_arm()
