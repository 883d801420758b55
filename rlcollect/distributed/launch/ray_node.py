"""The Ray actor behind each node of ``launcher="ray"``: a thin shell around the same node loop
as ``rlcollect node`` (``node.run_node``).

Ray places, starts, watches and ends this actor; what the node does inside it (its channel to
rank 0, the signed control messages, its pair process group with rank 0, batches, weights) is
unchanged.  The run's secret arrives in the constructor's arguments (Ray's task specification),
never in a message nor on a command line.

This module imports neither torch nor rlcollect's node at import time: Ray imports it in every
fresh worker process before the actor exists, and the node loop's imports (torch) happen in
``run``.
"""

from __future__ import annotations

import os
import socket
import sys


class RayNode:
    """One node of a ``DistributedCollector(launcher="ray")`` (made a Ray actor class with
    ``ray.remote`` by the launcher; not used directly).

    ``secret`` is the run's secret; ``sys_path`` the driver's ``sys.path``, whose entries
    missing here are appended (so that env factories pickled by reference import as they do
    on the driver, when the driver's files exist on this host); ``log_level`` the node's
    logging level (``RLCOLLECT_LOG_LEVEL``).

    Example (what the launcher does; needs Ray)::

        actor = ray.remote(RayNode).options(num_cpus=1).remote(secret, sys.path, "WARNING")
        code = ray.get(actor.run.remote("10.0.0.1", 29500, 1, 3, 300.0, 60.0, None))
    """

    def __init__(self, secret: bytes, sys_path: list[str], log_level: str) -> None:
        self._secret = secret
        for entry in sys_path:
            if entry and entry not in sys.path and os.path.isdir(entry):
                sys.path.append(entry)
        os.environ["RLCOLLECT_LOG_LEVEL"] = log_level

    def where(self) -> tuple[int, str]:
        """``(pid, host name)`` of the actor's process."""
        return os.getpid(), socket.gethostname()

    def run(self, master_addr: str, master_port: int, rank: int, world_size: int, timeout: float,
            rank0_timeout: float, parent: tuple[int, str, str] | None) -> int:
        """Run node ``rank`` until rank 0 closes it (or is gone); returns ``run_node``'s exit code.
        ``parent``: the driver's pid, host name and Ray node id; the node watches that pid only
        when it runs on the driver's Ray node (a pid means nothing in another host's namespace)."""
        import ray

        from rlcollect.distributed.node import configure_logging, run_node

        configure_logging(rank)
        same_node = parent is not None and ray.get_runtime_context().get_node_id() == parent[2]
        parent = (parent[0], parent[1]) if same_node else None
        secret, self._secret = self._secret, None  # read once, as the other launchers' nodes do
        try:
            return run_node(master_addr, master_port, rank, world_size, timeout, secret=secret,
                            rank0_timeout=rank0_timeout, parent=parent)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
