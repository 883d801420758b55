"""Scale benchmark (issue 35): ``DistributedCollector`` with N nodes on one host (launcher "mp"),
what rank 0 pays per node and per batch, and how fast the collection reacts (first batch,
weight pushes, a killed node replaced).

    python -m bench.scale [--nodes 2,4,8,16] [--modes sync,async] [--sizes small,large]
                          [--quick] [--seconds 4] [--pushes 20] [--json PATH]

Each node runs one ``SleepEnv(step_time=1e-3)`` (a simulator that waits, so that N nodes fit a
small machine) and a 2x64 ``ArgmaxMLP`` policy. Batch sizes (``--sizes``):

- ``small``: CartPole-sized, 4 float32 observations a frame, 10 frames a node's batch (about
  1 KB: what rank 0 pays per batch, not per byte);
- ``large``: Pong-sized, 7,056 float32 observations a frame (28,224 bytes: Pong's 4x84x84 uint8
  frame stack), 32 frames a node's batch (Pong's T; about 1.8 MB with the next observations).

Every row runs in a fresh interpreter (``--row``), so that its memory and file descriptor
figures start from the same point, and prints, from that interpreter (rank 0):

- ``first batch s``: from the constructor call (torch imported) to the first batch;
- ``CPU ms/batch``, ``CPU s/MB``: rank 0's CPU time (all its threads) over ``--seconds`` of
  steady collection, per batch yielded and per MB yielded;
- ``RSS MB``: rank 0's resident memory then; ``fds``: the file descriptors rank 0 opened for
  the collection (counted after the first batch; ``--fds`` lists them by kind), and over N
  (``fds/node``; a few are fixed: the slope between two rows is the cost of one more node);
  ``threads``: the threads rank 0 started for the collection;
- ``fps``, ``bare fps``, ``of bare``: frames per second yielded, against the sum of the nodes'
  own rate (1 / each node's mean env-step latency, as reported in ``stats()``);
- ``push p50/p99 ms``: ``--pushes`` times, ``update_policy_weights_()`` then batches until every
  node delivered a batch whose frames all carry the new version (``("collector",
  "policy_version")``): an upper bound of "every node acts on it", by a batch's collection time;
- ``replace s``: a node SIGKILLed (``on_node_failure="restart"``) until a batch of its new
  incarnation is delivered;
- ``load``: the 1-minute load average when the row ended (the machine may be shared).

``--quick``: 1 s of steady collection and 3 pushes (a check that every column comes out, not a
measurement).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP_TIME = 1e-3


@dataclass(frozen=True)
class Size:
    """A batch size of the benchmark: ``obs_dim`` float32 observations a frame, ``frames`` a
    node's batch."""

    obs_dim: int
    frames: int
    title: str


SIZES = {
    "small": Size(4, 10, "CartPole-sized: 4 obs, 10 frames"),
    "large": Size(7056, 32, "Pong-sized: 7,056 float32 obs (28 KB), 32 frames"),
}
MODES = ("sync", "async")
DEFAULT_NODES = (2, 4, 8, 16)


@dataclass
class Row:
    nodes: int
    mode: str
    size: str
    first_batch_s: float = 0.0
    cpu_ms_per_batch: float = 0.0
    cpu_s_per_mb: float = 0.0
    mb_per_batch: float = 0.0
    rss_mb: float = 0.0
    fds: int = 0
    fds_per_node: float = 0.0
    fds_by_kind: dict = field(default_factory=dict)
    threads: int = 0
    batches_per_s: float = 0.0
    fps: float = 0.0
    bare_fps: float = 0.0
    push_p50_ms: float | None = None
    push_p99_ms: float | None = None
    replace_s: float | None = None
    load: float = 0.0
    error: str | None = None

    @property
    def of_bare(self) -> float:
        return self.fps / self.bare_fps if self.bare_fps else float("nan")


# -- rank 0's file descriptors -----------------------------------------------------------------------
def open_fds() -> dict[int, str]:
    """This process's open file descriptors and what each points to."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd, closed meanwhile
            pass
    return out


def _socket_ports() -> dict[str, tuple[int, int]]:
    """``{"socket:[inode]": (local port, remote port)}`` of this process's TCP sockets."""
    out = {}
    for name in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            local, remote, inode = parts[1], parts[2], parts[9]
            out[f"socket:[{inode}]"] = (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16))
    return out


def classify_fds(new: dict[int, str], store_port: int | None, channel_port: int | None) -> dict[str, int]:
    """Count the descriptors ``new`` by what they are for: the store's (``store_port``: None
    since rank 0 hosts no store) and the channel's connections (by port), other TCP sockets
    (gloo's pair groups: their listeners and pair connections), pipes, epoll and event fds
    (gloo's event loops), other."""
    ports = _socket_ports()
    kinds: collections.Counter[str] = collections.Counter()
    for target in new.values():
        if target.startswith("socket:"):
            local, remote = ports.get(target, (None, None))
            if store_port in (local, remote):
                kinds["store"] += 1
            elif channel_port in (local, remote):
                kinds["channel"] += 1
            elif local is not None:
                kinds["other tcp (gloo)"] += 1
            else:
                kinds["other socket"] += 1
        elif target.startswith("pipe:"):
            kinds["pipe"] += 1
        elif target.startswith("anon_inode:"):
            kinds[target.removeprefix("anon_inode:").strip("[]")] += 1
        else:
            kinds["other"] += 1
    return dict(sorted(kinds.items()))


# -- one row (in its own interpreter) -------------------------------------------------------------------
def _policy(obs_dim: int):
    import torch

    from rlcollect.nets import ArgmaxMLP

    torch.manual_seed(0)
    return ArgmaxMLP(obs_dim=obs_dim, num_actions=2, hidden=64, depth=2)


def _versions_by_node(batch, mode: str, nodes: int) -> dict[int, int]:
    """Each node in ``batch`` -> the lowest policy version of its frames."""
    from rlcollect.data import POLICY_VERSION
    from rlcollect.distributed.gather import NODE_ID

    versions = batch[POLICY_VERSION]
    if mode == "sync":  # (nodes, frames)
        return {i: int(versions[i].min()) for i in range(nodes)}
    return {int(batch[NODE_ID].reshape(-1)[0]): int(versions.min())}


def measure_row(nodes: int, mode: str, size_name: str, seconds: float, pushes: int) -> Row:
    """Build one collector, measure it (module docstring), shut it down."""
    import torch

    from bench.workloads import nbytes
    from rlcollect import DistributedCollector, SleepEnv
    from rlcollect.distributed.gather import NODE_ID

    torch.set_num_threads(1)
    size = SIZES[size_name]
    row = Row(nodes, mode, size_name)
    env = functools.partial(SleepEnv, step_time=STEP_TIME, obs_dim=size.obs_dim)
    fds_before, threads_before = open_fds(), _threads()
    started = time.perf_counter()
    collector = DistributedCollector(
        [env] * nodes, _policy(size.obs_dim), frames_per_batch=size.frames * (nodes if mode == "sync" else 1),
        total_frames=-1, sync=mode == "sync", on_node_failure="restart", max_node_restarts=1,
        collector_kwargs={"track_policy_version": True},
        # A loaded machine starts 16+ nodes slowly, and their beats may come late: the bounds are
        # hang guards here (a killed node is seen by its exit, not by its silence).
        start_timeout=900, heartbeat_timeout=60)
    try:
        batches = iter(collector)
        batch = next(batches)
        row.first_batch_s = time.perf_counter() - started
        new = {fd: target for fd, target in open_fds().items() if fd not in fds_before}
        row.fds, row.fds_per_node = len(new), len(new) / nodes
        # rank 0 has one port since issue 36 (F6): master_port is its channel listener, no store.
        row.fds_by_kind = classify_fds(new, None, collector.master_port)
        row.threads = _threads() - threads_before
        row.mb_per_batch = nbytes(batch) / 1e6
        # Warm up (every node has delivered, the receive buffers are touched), then the window.
        end = time.perf_counter() + min(1.0, seconds)
        while time.perf_counter() < end:
            next(batches)
        count, frames, byte_count = 0, 0, 0
        cpu, wall = time.process_time(), time.perf_counter()
        while True:
            batch = next(batches)
            count, frames, byte_count = count + 1, frames + batch.numel(), byte_count + nbytes(batch)
            elapsed = time.perf_counter() - wall
            if elapsed >= seconds:
                break
        cpu = time.process_time() - cpu
        row.cpu_ms_per_batch = cpu / count * 1e3
        row.cpu_s_per_mb = cpu / (byte_count / 1e6)
        row.batches_per_s, row.fps = count / elapsed, frames / elapsed
        row.rss_mb = _rss_mb()
        steps = [w["env_step_mean_s"] for w in collector.stats()["workers"]]
        row.bare_fps = sum(1.0 / (s or STEP_TIME) for s in steps)
        # Weight pushes: until every node delivered a batch acted entirely with the new version.
        latencies = []
        for _ in range(pushes):
            pushed = time.perf_counter()
            collector.update_policy_weights_()
            version = collector.stats()["policy_version"]
            waiting = set(range(nodes))
            while waiting:
                for node, seen in _versions_by_node(next(batches), mode, nodes).items():
                    if seen >= version:
                        waiting.discard(node)
            latencies.append(time.perf_counter() - pushed)
        if latencies:
            row.push_p50_ms = statistics.median(latencies) * 1e3
            row.push_p99_ms = _percentile(latencies, 0.99) * 1e3
        # A node killed: until a batch of its replacement is delivered.
        victim = nodes - 1
        restarts = collector.stats()["workers"][victim]["restarts"]
        os.kill(collector.stats()["workers"][victim]["pid"], signal.SIGKILL)
        killed = time.perf_counter()
        while True:
            batch = next(batches)
            renewed = collector.stats()["workers"][victim]["restarts"] > restarts
            if renewed and (mode == "sync" or int(batch[NODE_ID].reshape(-1)[0]) == victim):
                break
        row.replace_s = time.perf_counter() - killed
    finally:
        collector.shutdown()
    row.load = os.getloadavg()[0]
    return row


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rss_mb() -> float:
    from bench.workloads import rss

    return rss()["VmRSS"] / 1e6


# -- the table ----------------------------------------------------------------------------------------
COLUMNS = ("nodes", "mode", "batch", "first batch s", "CPU ms/batch", "CPU s/MB", "MB/batch", "RSS MB",
           "fds", "fds/node", "threads", "batches/s", "fps", "bare fps", "of bare", "push p50 ms", "push p99 ms",
           "replace s", "load")


def header() -> str:
    return "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * 3 + "---:|" * (len(COLUMNS) - 3)


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def format_row(row: Row) -> str:
    if row.error is not None:
        return f"| {row.nodes} | {row.mode} | {row.size} | failed: {row.error} |" + " |" * (len(COLUMNS) - 4)
    cells = [str(row.nodes), row.mode, row.size, _num(row.first_batch_s, 1), _num(row.cpu_ms_per_batch, 2),
             _num(row.cpu_s_per_mb, 3), _num(row.mb_per_batch, 3), _num(row.rss_mb, 0), str(row.fds),
             _num(row.fds_per_node, 1), str(row.threads),
             _num(row.batches_per_s, 0), _num(row.fps, 0), _num(row.bare_fps, 0), _num(row.of_bare, 2),
             _num(row.push_p50_ms, 0), _num(row.push_p99_ms, 0), _num(row.replace_s, 1), _num(row.load, 1)]
    return "| " + " | ".join(cells) + " |"


def run_row_subprocess(nodes: int, mode: str, size: str, seconds: float, pushes: int, timeout: float) -> Row:
    """Measure one row in a fresh interpreter (``--row``); a failure is a row with ``error``."""
    command = [sys.executable, "-m", "bench.scale", "--row", f"{nodes},{mode},{size}", "--seconds", str(seconds),
               "--pushes", str(pushes)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    try:
        proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return Row(nodes, mode, size, error=f"no result within {timeout:g} s")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
        print(proc.stderr[-3000:], file=sys.stderr)
        return Row(nodes, mode, size, error=tail[0][:200])
    return Row(**json.loads(lines[-1]))


def _list(text: str, choices=None, convert=str) -> list:
    values = [convert(v) for v in text.split(",") if v]
    bad = [v for v in values if choices is not None and v not in choices]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {sorted(choices or [])}, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=functools.partial(_list, convert=int), default=list(DEFAULT_NODES),
                        help="comma-separated node counts (default: 2,4,8,16)")
    parser.add_argument("--modes", type=functools.partial(_list, choices=MODES), default=list(MODES),
                        help="sync, async or both (default)")
    parser.add_argument("--sizes", type=functools.partial(_list, choices=SIZES), default=list(SIZES),
                        help="small, large or both (default)")
    parser.add_argument("--seconds", type=float, default=4.0, help="steady-collection window of a row (default: 4)")
    parser.add_argument("--pushes", type=int, default=20, help="weight pushes timed per row (default: 20)")
    parser.add_argument("--quick", action="store_true", help="1 s windows and 3 pushes: every column, no figure")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a row may take (default: 1800)")
    parser.add_argument("--fds", action="store_true", help="also list rank 0's descriptors of each row by kind")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows to this JSON file")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)  # NODES,MODE,SIZE: one row, JSON out
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.pushes = 1.0, 3
    if args.row is not None:
        nodes, mode, size = args.row.split(",")
        print(json.dumps(asdict(measure_row(int(nodes), mode, size, args.seconds, args.pushes))), flush=True)
        return 0
    print(f"# bench.scale on {socket.gethostname()}, {os.cpu_count()} CPUs, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.1f}; "
          f"SleepEnv(step_time={STEP_TIME:g}) nodes, launcher 'mp'", flush=True)
    print(header(), flush=True)
    rows = []
    for nodes in args.nodes:
        for size in args.sizes:
            for mode in args.modes:
                row = run_row_subprocess(nodes, mode, size, args.seconds, args.pushes, args.timeout)
                rows.append(row)
                print(format_row(row), flush=True)
    if args.fds:
        for row in rows:
            print(f"{row.nodes} nodes {row.mode} {row.size}: rank 0's descriptors for the run: {row.fds_by_kind}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
