"""A Ray that the collector started (no cluster given) goes when the collector shuts down;
a Ray started before it stays.  Runs in a fresh interpreter: starting a local Ray takes seconds
and must not meet the other modules' clusters."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import NO_RAY, SKIP_REASON
from ray_helpers import HERE, wait_no_actors

sys.path.insert(0, str(HERE.parent))
from loadscale import scaled  # noqa: E402

# Starting a local Ray head and its node actors is CPU work (tens of processes importing):
# start_timeout's default of 120 s is ample on a quiet machine, not at load 8-10 on 2 cores.
# The hang guards below are sized for the largest start_timeout (START_CAP).
START_CAP = 480.0
pytestmark = [pytest.mark.ray, pytest.mark.timeout(START_CAP + 240),
              pytest.mark.skipif(NO_RAY, reason=SKIP_REASON)]

_SCRIPT = """
import json, sys
sys.path.insert(0, {helpers!r})
import ray
from dist_helpers import counting5
from rlcollect import DistributedCollector
out = {{}}
with DistributedCollector([counting5] * 2, frames_per_batch=20, total_frames=40, sync=True, launcher="ray",
                          start_timeout={start_timeout}) as c:
    out["shapes"] = [list(b.shape) for b in c]
    out["initialized_during"] = ray.is_initialized()
    out["cpus"] = ray.cluster_resources().get("CPU")
out["initialized_after"] = ray.is_initialized()
print("RESULT " + json.dumps(out), flush=True)
"""


def test_a_ray_the_collector_started_is_shut_down_with_it(tmp_path):
    script = tmp_path / "local.py"
    start_timeout = scaled(120.0, cap=START_CAP)
    script.write_text(_SCRIPT.format(helpers=str(HERE.parent / "distributed"), start_timeout=start_timeout))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                         timeout=start_timeout + 160)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result == {"shapes": [[2, 10], [2, 10]], "initialized_during": True, "cpus": result["cpus"],
                      "initialized_after": False}
    assert result["cpus"] >= 2
    # Ray's processes were this test's grandchildren: the leak check (tests/conftest.py) fails
    # the test if any is left; and no actor process is.
    assert wait_no_actors(timeout=30.0) == set()
