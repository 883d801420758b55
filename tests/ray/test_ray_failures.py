"""Ray's own processes dying under ``launcher="ray"`` (issue 36, item 3; docs/ray.md, "Failures").

On main before the fix (Ray 2.60, local instance): the raylet SIGKILLed left both actors dead
after ~15 s and relaunched onto a Ray that could not start them, with no batch and no error for
more than 180 s; the GCS SIGKILLed made Ray's C++ code end the driver 60 s later with no Python
exception.  Now each is a ``WorkerError`` naming what of Ray is gone, raised at a batch wait
within ``health_timeout`` (5 s) of the probe seeing it, and the collector shuts down.

The raylet and GCS tests run a driver in a fresh interpreter and its own session, with a local
Ray it starts (``ray.init``, then the collector; Ray's processes are the driver's children, in
its process group): the driver kills its own raylet or GCS, reports what the collector did, and
the test ends that whole process group afterwards, whatever happened.  A replacement that Ray
cannot place (its CPUs taken: ``schedule_timeout``) and a stopped actor with its stopped watcher
(issue 36, item 4: the watcher dies with its node) run against the module's cluster (conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import NO_RAY, SKIP_REASON
from ray_helpers import HERE, _pgid, _pids, counting5, wait_gone, wait_no_actors
from rlcollect import DistributedCollector, WorkerError

sys.path.insert(0, str(HERE.parent))
from loadscale import scaled  # noqa: E402
from procs import children as _children  # noqa: E402

START_CAP = 480.0
pytestmark = [pytest.mark.ray, pytest.mark.timeout(START_CAP + 300), pytest.mark.skipif(NO_RAY, reason=SKIP_REASON)]

# The driver kills one of its Ray's processes (the live instance's, by Ray's own record) once batches flow, then
# collects until a WorkerError or ``wait`` seconds (the old behaviour: none for minutes after a
# raylet's death; the process ended by Ray 60 s after the GCS's, so no RESULT line at all).
_SCRIPT = """
import json, os, signal, sys, time
sys.path.insert(0, {helpers!r})
from dist_helpers import counting5
from rlcollect import DistributedCollector, WorkerError

# Ray's local start gives its raylet 30 s to register (hard-coded in Ray 2.60), which a loaded
# 2-core machine can exceed: tried three times here (the collector uses the Ray it finds).
import ray
for attempt in range(3):
    try:
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
        break
    except Exception as err:
        print(f"ray.init failed ({{err}}); again", flush=True)
        try:
            ray.shutdown()
        except Exception:
            pass
out = {{}}
c = DistributedCollector([counting5] * 2, frames_per_batch=20, total_frames=-1, sync=True, launcher="ray",
                         on_node_failure="restart", start_timeout={start_timeout})
it = iter(c)
next(it)
# The live instance's own process (a failed ray.init above may have left others of that name).
victim = ray._private.worker._global_node.all_processes[{what!r}][0].process.pid
os.kill(victim, signal.SIGKILL)
killed = time.monotonic()
out["batches_after"] = 0
try:
    while time.monotonic() - killed < {wait}:
        next(it)
        out["batches_after"] += 1
    out["error"] = None
except WorkerError as err:
    out["error"] = str(err)
out["error_s"] = round(time.monotonic() - killed, 2)
began = time.monotonic()
c.shutdown()
out["shutdown_s"] = round(time.monotonic() - began, 2)
ray.shutdown()
print("RESULT " + json.dumps(out), flush=True)
"""


def _run_driver(tmp_path, what: str, wait: float) -> tuple[dict | None, subprocess.CompletedProcess | None, str]:
    """Run the driver that kills its Ray's ``what``; returns (its RESULT or None, the process, its output)."""
    start_timeout = scaled(120.0, cap=START_CAP)
    script = tmp_path / f"kill_{what}.py"
    script.write_text(_SCRIPT.format(helpers=str(HERE.parent / "distributed"), start_timeout=start_timeout,
                                     what=what, wait=wait))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=env, start_new_session=True)
    group = driver.pid  # its session's process group: the driver and every process of its Ray
    try:
        output, _ = driver.communicate(timeout=start_timeout + wait + 120)
    except subprocess.TimeoutExpired:
        output = b""
    finally:
        _end_group(group)
        if driver.poll() is None:
            driver.kill()
        driver.wait()
    text = output.decode(errors="replace")
    line = next((line for line in text.splitlines() if line.startswith("RESULT ")), None)
    return (None if line is None else json.loads(line[7:])), driver, text


def _end_group(pgid: int) -> None:
    """Kill what is left of process group ``pgid`` and wait until it is gone."""
    members = [p for p in _pids() if _pgid(p) == pgid]
    if members:
        print(f"ending {len(members)} process(es) left in the driver's group")
    for pid in members:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert wait_gone(members, 30.0) == []


def test_raylet_killed_raises_naming_the_raylet_instead_of_relaunching_forever(tmp_path):
    result, driver, text = _run_driver(tmp_path, "raylet", wait=120.0)
    assert result is not None, f"the driver printed no result (exit code {driver.returncode}): {text[-3000:]}"
    print(f"raylet SIGKILLed: WorkerError {result['error_s']} s later, shutdown {result['shutdown_s']} s")
    assert result["error"] is not None, result
    assert "raylet" in result["error"] and "Ray itself failed" in result["error"]
    assert wait_no_actors(timeout=30.0) == set()


def test_gcs_killed_raises_before_ray_ends_the_driver(tmp_path):
    result, driver, text = _run_driver(tmp_path, "gcs_server", wait=120.0)
    # Before the fix Ray's C++ code ended the driver 60 s after the kill: no RESULT line.
    assert result is not None, f"the driver printed no result (exit code {driver.returncode}): {text[-3000:]}"
    print(f"GCS SIGKILLed: WorkerError {result['error_s']} s later, shutdown {result['shutdown_s']} s")
    assert result["error"] is not None, result
    assert "GCS" in result["error"] and "does not answer" in result["error"]
    assert wait_no_actors(timeout=30.0) == set()


def test_ray_health_options_are_checked():
    from rlcollect.distributed.launch.ray_launcher import check_ray_options

    opts = check_ray_options({}, [1])
    assert (opts["health_timeout"], opts["schedule_timeout"]) == (5.0, 30.0)
    for key in ("health_timeout", "schedule_timeout"):
        for bad in (0, -1, "5", True):
            with pytest.raises(ValueError, match=key):
                check_ray_options({key: bad}, [1])

def test_a_replacement_ray_cannot_place_raises_naming_rays_state(ray_cluster):
    """The module's cluster has 4 CPUs, the two nodes take 2 each; once node 0's actor is
    killed, another actor takes its 2 CPUs before the collector relaunches it: the replacement
    is never started, and ``schedule_timeout`` later the collector says why."""
    import ray

    @ray.remote(num_cpus=2)
    class Squatter:
        def ready(self) -> bool:
            return True

    c = DistributedCollector([counting5] * 2, frames_per_batch=20, total_frames=-1, sync=True, launcher="ray",
                             on_node_failure="restart",
                             ray_options={"num_cpus": 2, "schedule_timeout": 5.0})
    squatter = None
    try:
        it = iter(c)
        next(it)
        victim = c.stats()["workers"][0]["pid"]
        other = c.stats()["workers"][1]["pid"]
        os.kill(victim, signal.SIGKILL)
        assert wait_gone([victim], 30.0) == []
        squatter = Squatter.remote()
        ray.get(squatter.ready.remote(), timeout=120)  # it holds the freed CPUs now
        began = time.monotonic()
        with pytest.raises(WorkerError) as info:
            for _ in range(100000):
                next(it)
        print(f"unplaceable replacement: WorkerError {time.monotonic() - began:.1f} s after the squatter started")
        message = str(info.value)
        assert "replacement Ray actor was not started within schedule_timeout=5 s" in message
        assert "0 CPU(s) free" in message and "PENDING_CREATION" in message
        assert info.value.worker_index == 0
    finally:
        c.shutdown()
        if squatter is not None:
            ray.kill(squatter)
    assert wait_gone([victim, other], 30.0) == []
    assert wait_no_actors(timeout=30.0) == set()


def test_a_stopped_actor_and_its_stopped_watcher_are_both_gone_after_replacement(ray_cluster):
    """Issue 36, item 4 with launcher="ray": rank 0 cannot kill an actor's process group (the
    actor runs on a Ray host; ``ray.kill`` ends its process), so the node's watcher asks the
    kernel to kill it with its node (control/watcher.py), stopped or not."""
    watchers: list[int] = []
    c = DistributedCollector([counting5] * 2, frames_per_batch=20, total_frames=-1, sync=True, launcher="ray",
                             on_node_failure="restart", heartbeat_timeout=2.0)
    try:
        it = iter(c)
        next(it)
        pids = [w["pid"] for w in c.stats()["workers"]]
        watchers = _children(pids[0])
        assert len(watchers) == 1  # the node's watcher (counting5 starts no process)
        for pid in (*watchers, pids[0]):
            os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 150
        while c.stats()["workers"][0]["pid"] == pids[0]:
            next(it)
            assert time.monotonic() < deadline, "the stopped node was not replaced"
        assert wait_gone([pids[0], *watchers], 10.0) == []  # gone with its node, not left in state T
        new = [w["pid"] for w in c.stats()["workers"]]
    finally:
        c.shutdown()
        for pid in watchers:  # (on the code before the fix: leave nothing behind)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert wait_gone([*pids, *new], 30.0) == []
    assert wait_no_actors(timeout=30.0) == set()
