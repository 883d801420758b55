"""How node processes come to exist.

- ``"mp"``: rank 0 starts each node as a local process (``python -m rlcollect.distributed.node``,
  the same entry point as ``rlcollect node``) and watches it; a node also watches rank 0's
  process and ends with it.
- ``"submitit"``: rank 0 submits one job per node through submitit (SLURM by default;
  ``slurm_kwargs={"executor": "local"}`` runs the same jobs as local processes).
- ``"submitit_delayed"``: the jobs were submitted beforehand (``submit_nodes``) and wait for
  rank 0; rank 0 only waits for them.
- ``"external"``: the user starts ``rlcollect node ...`` on any host; rank 0 waits for them.

Every launcher answers ``dead()`` (nodes whose process or job has ended, with a cause) and
``stop(timeout)`` (make sure none is left: wait, then terminate, then kill or cancel).  The
launchers that start the nodes themselves ("mp", "submitit") can also ``kill`` one node and
``relaunch`` it (``on_node_failure="restart"``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

logger = logging.getLogger("rlcollect")

LAUNCHERS = ("mp", "submitit", "submitit_delayed", "external")
#: Set by the "mp" launcher: the node ends when this process does.
PARENT_PID_ENV = "RLCOLLECT_PARENT_PID"
#: The nodes' logging level (default INFO; WARNING for the "mp" launcher's).
LOG_LEVEL_ENV = "RLCOLLECT_LOG_LEVEL"
#: Defaults of submitit's executor parameters; ``slurm_kwargs`` entries win.
SLURM_DEFAULTS = {"timeout_min": 24 * 60, "nodes": 1, "tasks_per_node": 1}
#: ``slurm_kwargs`` entries that choose the executor rather than set its parameters.
EXECUTOR_KEYS = ("executor", "folder")


def node_command(master_addr: str, master_port: int, rank: int, world_size: int, timeout: float) -> list[str]:
    """The command line that starts node ``rank`` (what the user types for "external")."""
    return ["rlcollect", "node", "--master-addr", master_addr, "--master-port", str(master_port),
            "--rank", str(rank), "--world-size", str(world_size), "--timeout", f"{timeout:g}"]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name} (exit code {code})"
        except ValueError:
            return f"was killed by signal {-code} (exit code {code})"
    return f"exited with code {code}"


class Launcher:
    """Base class: a launcher that starts nothing (nodes come by themselves)."""

    name = "external"
    #: False: the nodes are someone else's processes; shutdown waits for their goodbye only.
    owns_processes = False
    #: True: ``kill`` and ``relaunch`` work (``on_node_failure="restart"``).
    can_relaunch = False

    def start(self, master_addr: str, master_port: int, world_size: int, timeout: float) -> None:
        ranks = range(1, world_size)
        commands = "\n".join("  " + " ".join(node_command(master_addr, master_port, r, world_size, timeout))
                             for r in ranks)
        logger.warning("rlcollect: waiting up to %g s for %d node(s) to join %s:%d; start them with:\n%s",
                       timeout, len(ranks), master_addr, master_port, commands)

    def dead(self) -> dict[int, str]:
        """``{rank: cause}`` for nodes whose process is known to have ended."""
        return {}

    def pids(self) -> dict[int, int]:
        return {}

    def stop(self, timeout: float, failed: set[int] = frozenset()) -> None:
        """Make sure no node is left (``failed``: nodes known dead or hung, not waited for).
        Here nothing to do: nodes exit on "close", or when rank 0's store goes away."""

    def kill(self, rank: int, timeout: float = 5.0) -> None:
        """End node ``rank`` now, if it still runs (a failed or hung node); here nothing can be
        done: the node is someone else's process (it ends when it notices rank 0 dropped it)."""

    def relaunch(self, rank: int) -> None:
        """Start node ``rank`` again (after ``kill``)."""
        raise NotImplementedError(f"the {self.name!r} launcher cannot relaunch nodes")


class MpLauncher(Launcher):
    """Local node processes, started with the interpreter and ``sys.path`` of this one."""

    name = "mp"
    owns_processes = True
    can_relaunch = True

    def __init__(self) -> None:
        self.processes: dict[int, subprocess.Popen] = {}
        self._launch: tuple | None = None

    def start(self, master_addr: str, master_port: int, world_size: int, timeout: float) -> None:
        env = dict(os.environ)
        env[PARENT_PID_ENV] = str(os.getpid())
        # Local nodes share this terminal: only their warnings and errors, unless asked.
        env.setdefault(LOG_LEVEL_ENV, "WARNING")
        # What multiprocessing's "spawn" does too: functions pickled by reference (from the
        # user's modules) import in the node as they do here.
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self._launch = (master_addr, master_port, world_size, timeout, env)
        for rank in range(1, world_size):
            self.relaunch(rank)

    def relaunch(self, rank: int) -> None:
        master_addr, master_port, world_size, timeout, env = self._launch
        command = [sys.executable, "-m", "rlcollect.distributed.node", *node_command(
            master_addr, master_port, rank, world_size, timeout)[2:]]
        self.processes[rank] = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)

    def kill(self, rank: int, timeout: float = 5.0) -> None:
        process = self.processes.get(rank)
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(timeout)

    def dead(self) -> dict[int, str]:
        return {rank: f"(pid {p.pid}) {describe_exit(p.returncode)}"
                for rank, p in self.processes.items() if p.poll() is not None}

    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self.processes.items()}

    def stop(self, timeout: float, failed: set[int] = frozenset()) -> None:
        for rank in failed:  # a hung node would only make us wait
            if rank in self.processes and self.processes[rank].poll() is None:
                self.processes[rank].kill()
        _stop_processes(list(self.processes.values()), timeout)


def _stop_processes(processes: list[subprocess.Popen], timeout: float) -> None:
    """Wait for ``processes`` to exit, then terminate, then kill; bounded by ``timeout``."""
    deadline = time.monotonic() + 0.6 * timeout
    for p in processes:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    alive = [p for p in processes if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + 0.2 * timeout
    for p in alive:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5.0)


# -- submitit ------------------------------------------------------------------------------------
def make_executor(slurm_kwargs: dict | None, default_folder: str = "rlcollect-submitit") -> Any:
    """A submitit executor: ``slurm_kwargs["executor"]`` is ``"auto"`` (default: SLURM when
    there is one), ``"slurm"`` or ``"local"`` (local processes, for tests and single machines);
    ``slurm_kwargs["folder"]`` is where submitit keeps its logs; every other entry is an
    executor parameter (``timeout_min``, ``slurm_partition``, ``cpus_per_task``, ...)."""
    try:
        import submitit
    except ImportError as err:
        raise ImportError("the 'submitit' launchers need the submitit package: pip install submitit") from err
    kwargs = dict(slurm_kwargs or {})
    kind = kwargs.pop("executor", "auto")
    folder = kwargs.pop("folder", default_folder)
    executors = {"auto": submitit.AutoExecutor, "slurm": submitit.SlurmExecutor, "local": submitit.LocalExecutor}
    if kind not in executors:
        raise ValueError(f"slurm_kwargs['executor'] must be one of {sorted(executors)}, got {kind!r}")
    executor = executors[kind](folder=folder)
    # SlurmExecutor takes slurm's own parameter names: the user's, unchanged.
    executor.update_parameters(**(kwargs if kind == "slurm" else {**SLURM_DEFAULTS, **kwargs}))
    return executor


def submit_nodes(master_addr: str, master_port: int, world_size: int, *, slurm_kwargs: dict | None = None,
                 timeout: float = 300.0, ranks: list[int] | None = None) -> list:
    """Submit node jobs through submitit that wait (up to ``timeout`` s) for a rank 0 at
    ``master_addr:master_port``: the jobs of ``launcher="submitit_delayed"``.  Returns the
    submitit jobs.

    Example (not run: it needs a rank 0 to join)::

        jobs = submit_nodes("10.0.0.1", 29500, world_size=3, slurm_kwargs={"slurm_partition": "cpu"})
        collector = DistributedCollector([make_env] * 2, policy, frames_per_batch=1000,
                                         launcher="submitit_delayed", master_addr="10.0.0.1", tcp_port=29500)
    """
    from rlcollect.distributed.node import run_node

    executor = make_executor(slurm_kwargs)
    ranks = list(range(1, world_size)) if ranks is None else ranks
    return [executor.submit(run_node, master_addr, master_port, rank, world_size, timeout) for rank in ranks]


class SubmititLauncher(Launcher):
    """One submitit job per node, submitted by rank 0."""

    name = "submitit"
    owns_processes = True
    can_relaunch = True

    def __init__(self, slurm_kwargs: dict | None):
        self.slurm_kwargs = slurm_kwargs
        self.jobs: dict[int, Any] = {}
        self.retired: list[Any] = []  # jobs of killed incarnations: reaped at stop
        self._launch: tuple | None = None

    def start(self, master_addr: str, master_port: int, world_size: int, timeout: float) -> None:
        self._launch = (master_addr, master_port, world_size, timeout)
        jobs = submit_nodes(master_addr, master_port, world_size, slurm_kwargs=self.slurm_kwargs, timeout=timeout)
        self.jobs = dict(zip(range(1, world_size), jobs))

    def relaunch(self, rank: int) -> None:
        master_addr, master_port, world_size, timeout = self._launch
        [job] = submit_nodes(master_addr, master_port, world_size, slurm_kwargs=self.slurm_kwargs, timeout=timeout,
                             ranks=[rank])
        self.jobs[rank] = job

    def kill(self, rank: int, timeout: float = 5.0) -> None:
        job = self.jobs.get(rank)
        if job is None:
            return
        if not job.done():
            job.cancel(check=False)
        # A local job's controller process forwards the cancel to its task (SIGINT, then
        # SIGKILL a second later) and exits: wait for that, so the node is gone on return.
        # Killing the controller outright would orphan the task.
        process = getattr(job, "_process", None)
        if process is not None:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5.0)
        self.retired.append(job)

    def dead(self) -> dict[int, str]:
        out = {}
        for rank, job in self.jobs.items():
            if job.done():
                out[rank] = f"(job {job.job_id}) ended in state {job.state}"
        return out

    def stop(self, timeout: float, failed: set[int] = frozenset()) -> None:
        for rank in failed:
            if rank in self.jobs and not self.jobs[rank].done():
                self.jobs[rank].cancel(check=False)
        deadline = time.monotonic() + 0.6 * timeout
        while time.monotonic() < deadline and not all(job.done() for job in self.jobs.values()):
            time.sleep(0.05)
        for job in self.jobs.values():
            if not job.done():
                job.cancel(check=False)
        # Local jobs are child processes: reap them (cancel asks the job controller to stop
        # its task, which takes about a second).
        jobs = [*self.jobs.values(), *self.retired]
        local = [job._process for job in jobs if getattr(job, "_process", None) is not None]
        _stop_processes(local, max(0.4 * timeout, 2.0))


class SubmititDelayedLauncher(Launcher):
    """Jobs submitted beforehand with ``submit_nodes``: rank 0 only waits for them."""

    name = "submitit_delayed"

    def start(self, master_addr: str, master_port: int, world_size: int, timeout: float) -> None:
        logger.info("rlcollect: waiting up to %g s for %d submitit node job(s) to join %s:%d",
                    timeout, world_size - 1, master_addr, master_port)


def make_launcher(name: str, slurm_kwargs: dict | None) -> Launcher:
    if name == "mp":
        return MpLauncher()
    if name == "submitit":
        return SubmititLauncher(slurm_kwargs)
    if name == "submitit_delayed":
        return SubmititDelayedLauncher()
    if name == "external":
        return Launcher()
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {name!r}")
