"""Ray's own liveness, as ``launcher="ray"`` sees it from the driver (rank 0's process).

Ray reports a dead actor, but not its own parts dying (measured with Ray 2.60, docs/ray.md,
"Failures"):

- this host's **raylet** SIGKILLed: Ray declares the driver's node dead after ~15 s (its
  health checks), then every actor the driver owns; a replacement actor is never started
  (its owner's node is dead), and nothing says so;
- the **GCS** (the head) SIGKILLed: the actors go on, but Ray's C++ code ends the driver's
  process ``gcs_rpc_server_reconnect_timeout_s`` (60 s) later, with no Python exception.

``RayHealth`` probes both from a daemon thread, every ``PROBE_PERIOD_S``: a TCP connection to
this host's raylet (refused: it is gone), and the GCS's node table read with a timeout (no
answer: it is gone or unreachable; this driver's node marked dead; no node alive).  The
launcher asks ``problem()`` at every liveness check of rank 0 (every 0.25 s of a wait) and
raises a ``WorkerError`` once Ray has been unhealthy for ``health_timeout`` seconds, well
before Ray would end the process.  The probe never blocks its caller: every call to Ray here
has a timeout, and only the thread makes them.

Ray is imported by the caller (``ray_launcher``); this module takes the ``ray`` module.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

#: Seconds between two probes.
PROBE_PERIOD_S = 1.0
#: Seconds a probe's GCS call and raylet connection may take.
PROBE_TIMEOUT_S = 2.0
#: ``GcsNodeInfo.state`` of a live node (``gcs_pb2.GcsNodeInfo.ALIVE``).
_ALIVE = 0


def bounded(call: Any, timeout: float, default: Any = None) -> Any:
    """``call()`` run in a daemon thread, given up after ``timeout`` s (``default`` then, or
    when it raised): Ray calls without a timeout of their own block while the GCS is gone."""
    out: list = []

    def run() -> None:
        with contextlib.suppress(Exception):
            out.append(call())

    thread = threading.Thread(target=run, name="rlcollect-ray-call", daemon=True)
    thread.start()
    thread.join(timeout)
    return out[0] if out else default


class RayHealth:
    """Probes the Ray this driver is connected to (``ray``: the module, initialised) from a
    daemon thread; ``problem(grace)`` is what is wrong with it, once wrong for ``grace`` s.

    Example (needs Ray initialised)::

        health = RayHealth(ray).start()
        ...
        if (what := health.problem(5.0)) is not None:
            raise WorkerError(what)
        health.stop()
    """

    def __init__(self, ray: Any, period: float = PROBE_PERIOD_S, timeout: float = PROBE_TIMEOUT_S) -> None:
        self.ray, self.period, self.timeout = ray, period, timeout
        self.gcs_address = self.raylet = self.node_id = None
        worker = getattr(getattr(ray, "_private", None), "worker", None)
        worker = getattr(worker, "global_worker", None)
        node = getattr(worker, "node", None)  # None for a Ray client driver (ray://)
        self._gcs = getattr(worker, "gcs_client", None)
        if node is not None:
            with contextlib.suppress(Exception):
                self.raylet = (str(node.node_ip_address), int(node.node_manager_port))
            self.gcs_address = getattr(node, "gcs_address", None)
        with contextlib.suppress(Exception):
            self.node_id = ray.get_runtime_context().get_node_id()
        self._lock = threading.Lock()
        self._bad: str | None = None
        self._bad_since: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RayHealth:
        if self._gcs is not None or self.raylet is not None:
            self._thread = threading.Thread(target=self._loop, name="rlcollect-ray-health", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            found = self.probe()
            with self._lock:
                if found is None:
                    self._bad = self._bad_since = None
                else:
                    self._bad = found
                    if self._bad_since is None:
                        self._bad_since = time.monotonic()
            self._stop.wait(self.period)

    def probe(self) -> str | None:
        """What is wrong with Ray now (one probe, at most ~2 × ``timeout`` s), None if nothing."""
        if self.raylet is not None:
            try:
                socket.create_connection(self.raylet, timeout=self.timeout).close()
            except ConnectionRefusedError:
                return (f"this host's raylet (Ray's node manager at {self.raylet[0]}:{self.raylet[1]}) is gone: it "
                        "refuses connections, so Ray can neither start an actor for this driver nor keep those it "
                        "owns")
            except OSError:
                pass  # a timeout: a busy raylet, not a dead one
        if self._gcs is None:
            return None
        try:
            nodes = self._gcs.get_all_node_info(timeout=self.timeout)
        except Exception as err:  # noqa: BLE001  (RpcError, a timeout: the GCS does not answer)
            return (f"Ray's GCS (the head{', ' + self.gcs_address if self.gcs_address else ''}) does not answer "
                    f"({type(err).__name__}: {str(err).strip()[:200]}); Ray ends a driver about 60 s after losing its "
                    "GCS (gcs_rpc_server_reconnect_timeout_s)")
        alive = [nid for nid, info in nodes.items() if getattr(info, "state", _ALIVE) == _ALIVE]
        if not alive:
            return f"no Ray node is alive (the GCS lists {len(nodes)}, all dead)"
        mine = [info for nid, info in nodes.items() if _hex(nid) == self.node_id]
        if mine and getattr(mine[0], "state", _ALIVE) != _ALIVE:
            return (f"this driver's Ray node ({self.node_id}) is marked dead by the GCS: the actors this driver owns "
                    "are ended and no new one is started")
        return None

    def problem(self, grace: float) -> str | None:
        """What is wrong with Ray, if it has been wrong for at least ``grace`` seconds."""
        with self._lock:
            if self._bad is None or time.monotonic() - self._bad_since < grace:
                return None
            return f"{self._bad} (for {time.monotonic() - self._bad_since:.1f} s)"

    def describe(self, actor: Any = None) -> str:
        """Ray's state in one line, for an error message: the nodes alive, the CPUs free, and
        ``actor``'s state (bounded calls; what cannot be read in time is said so)."""
        parts = []
        found = self.probe()
        parts.append("Ray looks healthy" if found is None else found)
        ray = self.ray
        nodes = bounded(lambda: ray.nodes(), self.timeout)
        if nodes is not None:
            alive = [n for n in nodes if n.get("Alive")]
            parts.append(f"{len(alive)} of {len(nodes)} Ray node(s) alive")
        free = bounded(lambda: ray.available_resources(), self.timeout)
        if free is not None:
            parts.append(f"{free.get('CPU', 0):g} CPU(s) free")
        if actor is not None:
            from ray._private import state

            info = bounded(lambda: state.actors(actor_id=actor._actor_id.hex()), self.timeout)
            if isinstance(info, dict) and info.get("State"):
                parts.append(f"the actor is {info['State']}")
        return "; ".join(parts)


def _hex(node_id: Any) -> str:
    return node_id.hex() if hasattr(node_id, "hex") else str(node_id)
