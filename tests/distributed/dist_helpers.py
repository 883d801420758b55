"""Shared helpers for the distributed collector tests: picklable env factories and policies
(imported by reference in the node processes: the "mp" launcher hands them this process's
``sys.path``), and checks that node processes are gone."""

from __future__ import annotations

import functools
import os
import time

import torch
from torch import nn

from rlcollect.data import TRAJ_ID_BLOCK
from rlcollect.envs.testing import CountingEnv

TRAJ_IDS = ("collector", "traj_ids")
POLICY_VERSION = ("collector", "policy_version")
NODE_ID = ("collector", "node_id")
WORKER_ID = ("collector", "worker_id")
BLOCK = TRAJ_ID_BLOCK

counting5 = functools.partial(CountingEnv, max_steps=5)


class ValuePolicy(nn.Module):
    """Plays action 1 when its weight is above 0.5, else 0 (starts at 0)."""

    def __init__(self, value: float = 0.0):
        super().__init__()
        self.w = nn.Parameter(torch.full((1,), float(value)))

    def forward(self, observation):
        return (observation[..., 0] * 0 + self.w[0]).gt(0.5).long()


class BigPolicy(torch.nn.Module):
    """100 MiB of float32 parameters; plays action 0."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(25 * 1024 * 1024))

    def forward(self, observation):
        return (observation[..., 0] * 0 + self.w[0]).long()


def failing_env():
    raise ValueError("this env cannot be built")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return False


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """The pids still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if pid_alive(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in pids if pid_alive(p)]


def node_pids(collector) -> list[int]:
    return [node["pid"] for node in collector.stats()["workers"]]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rlcollect_command() -> str:
    """The ``rlcollect`` console script of this interpreter's environment."""
    import sys
    from pathlib import Path

    return str(Path(sys.executable).with_name("rlcollect"))


def read_line(process, prefix: str, timeout: float) -> str:
    """The first line of ``process``'s stdout that starts with ``prefix`` (within ``timeout`` s)."""
    import select

    deadline = time.monotonic() + timeout
    buffer = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([process.stdout], [], [], 0.2)
        if ready:
            chunk = os.read(process.stdout.fileno(), 4096)
            if not chunk:
                break
            buffer += chunk
            for line in buffer.decode(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line
    raise AssertionError(f"no line starting with {prefix!r} within {timeout} s; got {buffer[-2000:]!r}")


def channel_send(collector, *messages) -> list:
    """Open a connection to ``collector``'s channel listener per message (what a foreign process
    that reaches the port can do), read rank 0's welcome and send the message there as the
    connection's first message (a callable: what it makes of the welcome's challenge); returns
    the connections (close them)."""
    from rlcollect.distributed.control.messages import unverified_challenge
    from rlcollect.distributed.control.wire import Wire

    host = collector.stats()["master"].rsplit(":", 1)[0]
    wires = []
    for data in messages:
        wire = Wire.connect(host, collector._pool.channel.port, 10.0)
        challenge = unverified_challenge(wire.recv())
        wire.send(data(challenge) if callable(data) else data)
        wires.append(wire)
    return wires
