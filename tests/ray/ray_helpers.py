"""Helpers of the Ray tests: a Ray cluster started with ``ray start --head`` outside this process's
tree (one per test module), picklable env factories and policies (from the distributed tests'
helpers), and a look at the actor processes on this host.

The head runs ``ray start --head --block`` detached (``setsid``, its parent a shell that exits at
once): its processes, and the actor processes its raylet starts, are Ray's and not this test
process's children, so that the leak check of tests/conftest.py sees only what a test itself
leaves; the tests check the actors' processes themselves, by pid.  Teardown ends the head (its
``--block`` process stops what it started), then kills its process group for good measure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "distributed"))

from dist_helpers import (BLOCK, NODE_ID, POLICY_VERSION, TRAJ_IDS, ValuePolicy, counting5, free_port,  # noqa: E402,F401
                          pid_alive, wait_gone)

#: Ray sets its actor processes' titles to ``ray::<class>.<method>``.
ACTOR_TITLE = b"ray::RayNode"


@dataclass
class Cluster:
    address: str
    pid: int  # the `ray start --block` process
    log: Path


def auth_env() -> dict[str, str]:
    """Ray's token authentication on, with a fresh token (Ray reads these variables first)."""
    import secrets

    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def start_head(log: Path, num_cpus: int = 4, host: str = "127.0.0.1", netns: str | None = None,
               timeout: float = 180.0, env: dict | None = None) -> Cluster:
    """``ray start --head --block`` in its own session, detached; returns once it says it runs."""
    port = free_port()
    prefix = f"ip netns exec {netns} " if netns else ""
    command = (f"{prefix}'{ray_bin()}' start --head --block --num-cpus {num_cpus} --port {port} "
               f"--node-ip-address {host} --include-dashboard=false --disable-usage-stats "
               f"> '{log}' 2>&1 < /dev/null & echo $!")
    out = subprocess.run(["setsid", "sh", "-c", command], capture_output=True, text=True, check=True,
                         env=env or {**os.environ, "RAY_ADDRESS": ""})
    pid = int(out.stdout.split()[0])
    wait_started(log, pid, timeout)
    return Cluster(f"{host}:{port}", pid, log)


def wait_started(log: Path, pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and "Ray runtime started" in log.read_text(errors="replace"):
            return
        if not pid_alive(pid):
            raise RuntimeError(f"ray start exited: {log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.2)
    stop_head(pid)
    raise RuntimeError(f"ray start did not come up within {timeout} s: {log.read_text(errors='replace')[-3000:]}")


def stop_head(pid: int, timeout: float = 30.0) -> None:
    """End a detached ``ray start --block`` (and what it started)."""
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        return
    group = [p for p in _pids() if _pgid(p) == pgid]
    os.kill(pid, signal.SIGTERM)
    left = wait_gone(group, timeout)
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_gone(left, 10.0)


def _pids() -> list[int]:
    return [int(n) for n in os.listdir("/proc") if n.isdigit()]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def actor_pids() -> set[int]:
    """Pids of the live RayNode actor processes on this host (any cluster)."""
    found = set()
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(ACTOR_TITLE) and pid_alive(pid):
                    found.add(pid)
        except OSError:
            continue
    return found


def wait_no_actors(before: set[int] = frozenset(), timeout: float = 30.0) -> set[int]:
    """The RayNode actor processes (not in ``before``) still alive after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = actor_pids() - set(before)
        if not left:
            return set()
        time.sleep(0.1)
    return actor_pids() - set(before)
