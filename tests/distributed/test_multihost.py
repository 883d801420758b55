"""A real multi-host run on one machine: three network namespaces, each its own network stack,
joined by veth pairs.  Rank 0 runs in the first with ``launcher="external"`` and listens on its
veth address; the two nodes are started with ``rlcollect node`` in the others and reach it only
over the veth links (their namespaces have no other route):

    ns1 [10.77.1.2] --veth-- [10.77.1.1] ns0 [10.77.2.1] --veth-- [10.77.2.2] ns2

Needs root and iproute2 (``ip netns``); skipped cleanly where namespaces cannot be made.  The
addresses exist only inside the namespaces the test creates, and the namespaces (with their
links) are deleted at the end, whatever happened.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dist_helpers import rlcollect_command

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(240)]
HELPERS = str(Path(__file__).resolve().parent)
#: The nodes import the helpers, and rlcollect from where this test runs (a worktree's PYTHONPATH).
NODE_PATH = os.pathsep.join(filter(None, [HELPERS, os.environ.get("PYTHONPATH")]))
MASTER = "10.77.1.1"
PORT = 29517

_RANK0 = """
import json, sys
sys.path.insert(0, {helpers!r})
import torch
from dist_helpers import BLOCK, NODE_ID, TRAJ_IDS, ValuePolicy, counting5
from rlcollect import DistributedCollector

out = {{}}
with DistributedCollector([counting5] * 2, ValuePolicy(), frames_per_batch=20, total_frames=80, sync={sync},
                          launcher="external", master_addr={master!r}, tcp_port={port}, timeout=120.0) as c:
    batches = list(c)
    c.update_policy_weights_({{"w": torch.ones(1)}})
    updated = set()  # the nodes seen acting with the new weights (async: after their batches in flight)
    for _ in range(12):
        b = next(iter(c))
        rows = [(i, b["action"][i]) for i in range(2)] if {sync} else [(int(b[NODE_ID][0]), b["action"])]
        updated |= {{node for node, actions in rows if (actions == 1).all()}}
    out["shapes"] = [list(b.shape) for b in batches]
    out["blocks"] = sorted({{int(i) for b in batches for i in (b[TRAJ_IDS] // BLOCK).unique()}})
    out["updated"] = sorted(updated)
    out["master"] = c.stats()["master"]
print("RESULT " + json.dumps(out), flush=True)
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def namespaces():
    """Three namespaces joined as above; yields their names."""
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (the `ip` command) is not installed")
    tag = f"rlc{os.getpid() % 100000}"
    names = [f"{tag}n{i}" for i in range(3)]
    made = []
    try:
        for name in names:
            result = _ip("netns", "add", name, check=False)
            if result.returncode:
                pytest.skip(f"cannot create network namespaces here (`ip netns add` said: {result.stderr.strip()})")
            made.append(name)
        ns0, ns1, ns2 = names
        for side, peer_ns, subnet in (("a", ns1, 1), ("b", ns2, 2)):
            here, there = f"{tag}{side}0", f"{tag}{side}1"
            _ip("link", "add", here, "type", "veth", "peer", "name", there)
            _ip("link", "set", here, "netns", ns0)
            _ip("link", "set", there, "netns", peer_ns)
            _ip("-n", ns0, "addr", "add", f"10.77.{subnet}.1/24", "dev", here)
            _ip("-n", peer_ns, "addr", "add", f"10.77.{subnet}.2/24", "dev", there)
            _ip("-n", ns0, "link", "set", here, "up")
            _ip("-n", peer_ns, "link", "set", there, "up")
        for name in names:
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", ns2, "route", "add", "10.77.1.0/24", "via", "10.77.2.1")  # ns2 reaches rank 0 through ns0
        yield names
    except subprocess.CalledProcessError as err:
        pytest.skip(f"cannot set up veth links here: {' '.join(err.cmd)}: {err.stderr.strip()}")
    finally:
        for name in made:
            _ip("netns", "del", name, check=False)


# Async: the path with the most traffic (two batches in flight per node, weights in between);
# sync differs only on rank 0, which test_collector.py covers.
@pytest.mark.parametrize("sync", [False], ids=["async"])
def test_nodes_in_other_namespaces_collect_over_veth(namespaces, tmp_path, sync):
    ns0, ns1, ns2 = namespaces
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(_RANK0.format(helpers=HELPERS, master=MASTER, port=PORT, sync=sync)))
    from rlcollect.distributed.control.auth import SECRET_ENV, new_secret

    # The secret, as a user would hand it to the nodes of another host: in the environment.
    env = {**os.environ, "PYTHONPATH": NODE_PATH, SECRET_ENV: new_secret().decode()}
    rank0 = subprocess.Popen(["ip", "netns", "exec", ns0, sys.executable, str(script)], stdout=subprocess.PIPE,
                             text=True, env=env)
    nodes = [subprocess.Popen(["ip", "netns", "exec", ns, rlcollect_command(), "node", "--master-addr", MASTER,
                               "--master-port", str(PORT), "--rank", str(rank), "--world-size", "3",
                               "--timeout", "120"],
                              env=env)
             for rank, ns in ((1, ns1), (2, ns2))]
    try:
        stdout, _ = rank0.communicate(timeout=200)
        assert rank0.returncode == 0, stdout
        result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
        assert result["master"] == f"{MASTER}:{PORT}"
        expected = [[2, 10]] * 4 if sync else [[20]] * 4
        assert result["shapes"] == expected
        # Each node has its own trajectory-id block. Async is first-come-first-served: one node may
        # deliver all four batches, so only the sync case can ask for both.
        if sync:
            assert result["blocks"] == [0, 1]
        else:
            assert result["blocks"] and set(result["blocks"]) <= {0, 1}
        assert result["updated"] == [0, 1]  # the weights crossed the veth links too
        assert [node.wait(timeout=30) for node in nodes] == [0, 0]
    finally:
        for p in (rank0, *nodes):
            if p.poll() is None:
                p.kill()
            p.wait()
        if rank0.stdout:
            rank0.stdout.close()
