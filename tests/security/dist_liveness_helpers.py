"""Env factories for tests/security/test_dist_liveness.py, imported by reference in the node
processes (the "mp" launcher hands them this process's ``sys.path``)."""

from __future__ import annotations

import time
from pathlib import Path


def hanging_env(marker: str):
    """Say it started (touch ``marker``), then hang in the constructor."""
    Path(marker).touch()
    time.sleep(600)


def hold_gil(seconds: float) -> None:
    """Keep the GIL for ``seconds``, as a C extension that never releases it would: no other
    thread of this process runs meanwhile (the heartbeat thread included)."""
    import sys

    old = sys.getswitchinterval()
    sys.setswitchinterval(max(100.0, 10 * seconds))  # the eval loop hands the GIL over after this long only
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(old)


def gil_hogging_env(at_step: int, seconds: float, marker: str, **kwargs):
    """A ``CountingEnv`` whose ``at_step``-th step holds the GIL for ``seconds``, once (in all
    processes: ``marker`` is created when it fires)."""
    from rlcollect.envs.testing import CountingEnv

    class GilHoggingEnv(CountingEnv):
        def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
            self.steps_taken = getattr(self, "steps_taken", 0) + 1
            if self.steps_taken == at_step and not Path(marker).exists():
                Path(marker).touch()
                hold_gil(seconds)
            super().step_rows(action, obs_out, reward, terminated, truncated)

    return GilHoggingEnv(**kwargs)
