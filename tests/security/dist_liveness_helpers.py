"""Env factories for tests/security/test_dist_liveness.py, imported by reference in the node
processes (the "mp" launcher hands them this process's ``sys.path``)."""

from __future__ import annotations

import time
from pathlib import Path


def hanging_env(marker: str):
    """Say it started (touch ``marker``), then hang in the constructor."""
    Path(marker).touch()
    time.sleep(600)
