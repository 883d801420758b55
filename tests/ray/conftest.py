"""The Ray tests' fixture: one Ray cluster per test module (``ray start --head`` takes seconds),
and the driver (this process) connected to it.  The tests that need Ray are marked ``ray`` and
skipped, with the reason, where Ray is not installed."""

from __future__ import annotations

import importlib.util
import os

import pytest

from ray_helpers import auth_env, start_head, stop_head

NO_RAY = importlib.util.find_spec("ray") is None
SKIP_REASON = "Ray is not installed (pip install 'rlcollect[ray]')"

# Ray's token authentication, as a cluster should run (docs/ray.md, "Trust"): every Ray head
# these tests start, this process and the drivers they start share one token.  Set before Ray
# is imported (Ray reads it once, at import), and explicit, so that a token file a local Ray
# left in ~/.ray does not decide for the tests.
os.environ.update(auth_env())


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A Ray head (4 logical CPUs) and this process connected to it, for one test module."""
    if NO_RAY:
        pytest.skip(SKIP_REASON)
    import ray

    cluster = start_head(tmp_path_factory.mktemp("ray") / "head.log")
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=True)
        yield cluster
    finally:
        ray.shutdown()
        stop_head(cluster.pid)
