"""How node processes come to exist.

- ``"mp"``: rank 0 starts each node as a local process (a small bootstrap, then the same entry
  point as ``rlcollect node``) and watches it.  The node reads the run's secret from its stdin (a
  pipe rank 0 closes once written) and inherits the read end of the run's *lifeline*, a pipe whose
  write end only rank 0 holds and never writes: the node's first thread, started before any
  heavy import, waits for its end of file, so rank 0's death in any phase ends the node at once.
  One lifeline serves every node, so rank 0 keeps two descriptors for it, not one per node.  The
  node ignores SIGINT (a Ctrl-C reaches the whole process group; rank 0 shuts the nodes down).
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

from rlcollect.distributed.launch.node_args import LOG_LEVEL_ENV

logger = logging.getLogger("rlcollect")

LAUNCHERS = ("mp", "submitit", "submitit_delayed", "external", "ray")
#: The "mp" launcher's node bootstrap (``python -c``; argv: the lifeline's fd, then the node's
#: options).  It ignores SIGINT, reads the secret line from stdin and watches the lifeline for end
#: of file before it imports anything heavy (torch takes seconds to import).  It ends with
#: ``os._exit`` (no interpreter teardown), removing multiprocessing's temp folder first.
BOOTSTRAP = """\
import os, signal, sys, threading
signal.signal(signal.SIGINT, signal.SIG_IGN)
secret = sys.stdin.buffer.readline().strip()
pipe = os.fdopen(int(sys.argv[1]), "rb", buffering=0)
def watch():
    while pipe.read(4096):
        pass
    os.write(2, b"rlcollect node: rank 0's process is gone; exiting\\n")
    os._exit(3)
if not secret:
    os._exit(3)
threading.Thread(target=watch, name="rlcollect-rank0-pipe", daemon=True).start()
from rlcollect.distributed.node import main
code = main(sys.argv[2:], secret=secret)
sys.stdout.flush(); sys.stderr.flush()
from rlcollect._pids import remove_multiprocessing_temp_dir
remove_multiprocessing_temp_dir()
os._exit(code)
"""
#: Defaults of submitit's executor parameters; ``slurm_kwargs`` entries win.
SLURM_DEFAULTS = {"timeout_min": 24 * 60, "nodes": 1, "tasks_per_node": 1}


def node_command(master_addr: str, master_port: int, rank: int, world_size: int, timeout: float,
                 secret_file: Any = None, rank0_timeout: float | None = None) -> list[str]:
    """The command line that starts node ``rank`` (what the user types for "external")."""
    command = ["rlcollect", "node", "--master-addr", master_addr, "--master-port", str(master_port),
               "--rank", str(rank), "--world-size", str(world_size), "--timeout", f"{timeout:g}"]
    if rank0_timeout is not None:
        command += ["--rank0-timeout", f"{rank0_timeout:g}"]
    return command + (["--secret-file", str(secret_file)] if secret_file is not None else [])


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

    def __init__(self, secret: bytes = b"", secret_file: Any = None, rank0_timeout: float = 60.0):
        self.secret, self.secret_file, self.rank0_timeout = secret, secret_file, rank0_timeout

    def start(self, master_addr: str, master_port: int, world_size: int, timeout: float,
              start_timeout: float | None = None) -> None:
        ranks = range(1, world_size)
        commands = "\n".join("  " + " ".join(node_command(master_addr, master_port, r, world_size, timeout,
                                                          self.secret_file)) for r in ranks)
        where = "" if self.secret_file is not None else " (each with the run's secret in $RLCOLLECT_SECRET)"
        # The user must act on this, logging configured or not: stderr, not only the logger
        # (whose NullHandler keeps it silent by default). The bound is the start-up one.
        message = (f"rlcollect: waiting up to {start_timeout or timeout:g} s (start_timeout) for {len(ranks)} "
                   f"node(s) to join {master_addr}:{master_port}; start them with{where}:\n{commands}")
        print(message, file=sys.stderr, flush=True)
        logger.info(message)

    def dead(self) -> dict[int, str]:
        """``{rank: cause}`` for nodes whose process is known to have ended."""
        return {}

    def pids(self) -> dict[int, int]:
        return {}

    def stop(self, timeout: float, failed: set[int] = frozenset()) -> None:
        """Make sure no node is left (``failed``: nodes known dead or hung, not waited for).
        Here nothing to do: nodes exit on "close", or when rank 0's channel goes away."""

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

    def __init__(self, secret: bytes = b"", secret_file: Any = None, rank0_timeout: float = 60.0) -> None:
        super().__init__(secret, None, rank0_timeout)
        self.processes: dict[int, subprocess.Popen] = {}
        # The lifeline (read end, write end): every node inherits the read end; closed at stop.
        self.lifeline: tuple[int, int] | None = None
        self._launch: tuple | None = None

    def start(self, master_addr: str, master_port: int, world_size: int, timeout: float,
              start_timeout: float | None = None) -> None:
        env = dict(os.environ)
        env.pop("RLCOLLECT_SECRET", None)  # the node's secret comes through its pipe
        # Local nodes share this terminal: only their warnings and errors, unless asked.
        env.setdefault(LOG_LEVEL_ENV, "WARNING")
        # What multiprocessing's "spawn" does too: functions pickled by reference (from the
        # user's modules) import in the node as they do here.
        env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)
        self._launch = (master_addr, master_port, world_size, timeout, env)
        if self.lifeline is None:
            self.lifeline = os.pipe()  # both ends non-inheritable: only pass_fds hands the read end on
        for rank in range(1, world_size):
            self.relaunch(rank)

    def relaunch(self, rank: int) -> None:
        master_addr, master_port, world_size, timeout, env = self._launch
        read = self.lifeline[0]
        command = [sys.executable, "-c", BOOTSTRAP, str(read), *node_command(
            master_addr, master_port, rank, world_size, timeout, rank0_timeout=self.rank0_timeout)[2:]]
        # A process group of its own (nodes ignore SIGINT: a Ctrl-C is rank 0's to handle), so
        # that a node is killed with what it started: its watcher, its envs' processes.
        process = self.processes[rank] = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, pass_fds=(read,),
                                                          start_new_session=True)
        # The secret fits the pipe's buffer: written at once, even if the node has not started
        # reading (or died: then the write fails, and the node is reported dead as any other).
        try:
            process.stdin.write(self.secret + b"\n")
        except OSError:
            pass
        finally:
            try:
                process.stdin.close()
            except OSError:
                pass

    def _close_lifeline(self) -> None:
        # Forgotten before closed: a second stop (after a Ctrl-C in the first) never closes a
        # descriptor number that may have been reused meanwhile.
        fds, self.lifeline = self.lifeline or (), None
        for fd in fds:
            os.close(fd)

    def kill(self, rank: int, timeout: float = 5.0) -> None:
        """Kill node ``rank`` and its process group (its watcher, its envs' processes: a stopped
        watcher would otherwise outlive the run)."""
        process = self.processes.get(rank)
        if process is not None:
            end_group(process.pid, signal.SIGKILL)
            if process.poll() is None:
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
        try:
            _stop_processes(list(self.processes.values()), timeout)
        finally:
            for process in self.processes.values():  # what a node left behind (a stopped watcher)
                end_group(process.pid, signal.SIGKILL)
            self._close_lifeline()


def end_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid`` (a node's: it leads its own); False when there is
    no such group (nothing of it is left; a group id stays reserved while a member lives, so a
    recycled pid is never hit)."""
    try:
        os.killpg(pgid, sig)
    except OSError:
        return False
    return True


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
def require_submitit() -> Any:
    """The ``submitit`` module; ImportError naming the extra that installs it when it is missing
    (submitit is not a dependency of rlcollect's default install)."""
    try:
        import submitit
    except ImportError as err:
        raise ImportError("launcher='submitit' and submit_nodes need the submitit package, which rlcollect does "
                          "not install by default: pip install 'rlcollect[slurm]'") from err
    return submitit


def make_executor(slurm_kwargs: dict | None, default_folder: str = "rlcollect-submitit") -> Any:
    """A submitit executor: ``slurm_kwargs["executor"]`` is ``"auto"`` (default: SLURM when
    there is one), ``"slurm"`` or ``"local"`` (local processes, for tests and single machines);
    ``slurm_kwargs["folder"]`` is where submitit keeps its logs; every other entry is an
    executor parameter (``timeout_min``, ``slurm_partition``, ``cpus_per_task``, ...)."""
    submitit = require_submitit()
    kwargs = dict(slurm_kwargs or {})
    kind = kwargs.pop("executor", "auto")
    folder = kwargs.pop("folder", default_folder)
    executors = {"auto": submitit.AutoExecutor, "slurm": submitit.SlurmExecutor, "local": submitit.LocalExecutor}
    if kind not in executors:
        raise ValueError(f"slurm_kwargs['executor'] must be one of {sorted(executors)}, got {kind!r}")
    private_folder(folder)
    executor = executors[kind](folder=folder)
    # SlurmExecutor takes slurm's own parameter names: the user's, unchanged.
    executor.update_parameters(**(kwargs if kind == "slurm" else {**SLURM_DEFAULTS, **kwargs}))
    return executor


def private_folder(folder: Any) -> str:
    """Make sure the job folder ``folder`` (submitit's ``folder``: its part before any ``%j``-like
    placeholder) is private: created mode 0700 when missing; refused (``ValueError``) when it is
    owned by another user or writable by group or others.  The job pickles in it run code on
    the nodes: whoever can replace them runs code there."""
    import stat

    path = os.path.abspath(os.path.expanduser(str(folder)))
    static = path.split("%", 1)[0]
    static = static if static.endswith(os.sep) or "%" not in path else os.path.dirname(static)
    static = static.rstrip(os.sep) or os.sep
    if not os.path.exists(static):
        os.makedirs(static, mode=0o700, exist_ok=True)
        os.chmod(static, 0o700)
        return path
    info = os.stat(static)
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"slurm_kwargs['folder']={str(folder)!r}: {static} is not a directory")
    if info.st_uid != os.geteuid():
        raise ValueError(f"slurm_kwargs['folder']={str(folder)!r}: {static} belongs to another user (uid "
                         f"{info.st_uid}); the job pickles in it run code on the nodes: use a folder of your own")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"slurm_kwargs['folder']={str(folder)!r}: {static} is writable by other users (mode "
                         f"{stat.filemode(info.st_mode)}); the job pickles in it run code on the nodes: run "
                         f"chmod 700 {static}, or use another folder")
    return path


def submit_nodes(master_addr: str, master_port: int, world_size: int, *, secret_file: Any,
                 slurm_kwargs: dict | None = None, timeout: float = 300.0, ranks: list[int] | None = None,
                 rank0_timeout: float = 60.0, parent: tuple[int, str] | None = None) -> list:
    """Submit node jobs through submitit that wait (up to ``timeout`` s) for a rank 0 at
    ``master_addr:master_port``: the jobs of ``launcher="submitit_delayed"``.  ``secret_file``:
    a 0600 file with the run's secret that the jobs can read (a shared file system), the same
    that rank 0 is given.  Returns the submitit jobs.

    Example (not run: it needs a rank 0 to join)::

        jobs = submit_nodes("10.0.0.1", 29500, world_size=3, secret_file="~/.rlcollect-secret",
                            slurm_kwargs={"slurm_partition": "cpu"})
        collector = DistributedCollector([make_env] * 2, policy, frames_per_batch=1000,
                                         launcher="submitit_delayed", master_addr="10.0.0.1", tcp_port=29500,
                                         secret_file="~/.rlcollect-secret")
    """
    from rlcollect.distributed.control.auth import read_secret_file
    from rlcollect.distributed.node import run_node

    secret_file = os.path.abspath(os.path.expanduser(str(secret_file)))
    read_secret_file(secret_file)  # a missing or unprotected file is reported here, not in the jobs
    executor = make_executor(slurm_kwargs)
    if parent is not None and getattr(executor, "cluster", type(executor).__name__) not in ("local", "LocalExecutor"):
        parent = None  # rank 0 runs on another host than a SLURM job: its channel tells its death
    ranks = list(range(1, world_size)) if ranks is None else ranks
    return [executor.submit(run_node, master_addr, master_port, rank, world_size, timeout, secret_file=secret_file,
                            rank0_timeout=rank0_timeout, parent=parent) for rank in ranks]


class SubmititLauncher(Launcher):
    """One submitit job per node, submitted by rank 0."""

    name = "submitit"
    owns_processes = True

    def __init__(self, slurm_kwargs: dict | None, secret: bytes = b"", secret_file: Any = None,
                 rank0_timeout: float = 60.0):
        super().__init__(secret, secret_file, rank0_timeout)
        self.slurm_kwargs = slurm_kwargs
        self.jobs: dict[int, Any] = {}
        self.retired: list[Any] = []  # jobs of killed incarnations: reaped at stop
        self._launch: tuple | None = None
        self._own_file = None

    def start(self, master_addr: str, master_port: int, world_size: int, timeout: float,
              start_timeout: float | None = None) -> None:
        import socket

        from rlcollect.distributed.control.auth import write_secret_file

        if self.secret_file is None:  # a 0600 file in the job folder, removed at stop
            folder = (self.slurm_kwargs or {}).get("folder", "rlcollect-submitit")
            private_folder(folder)  # 0700 before the secret is in it (or refused when shared)
            self.secret_file = self._own_file = write_secret_file(self.secret, os.path.abspath(str(folder)))
        self._launch = (master_addr, master_port, world_size, timeout, (os.getpid(), socket.gethostname()))
        self.jobs = dict(zip(range(1, world_size), self._submit(list(range(1, world_size)))))

    def _submit(self, ranks: list[int]) -> list:
        import runpy
        from pathlib import Path

        master_addr, master_port, world_size, timeout, parent = self._launch
        executor = make_executor(self.slurm_kwargs)
        if getattr(executor, "cluster", type(executor).__name__) not in ("local", "LocalExecutor"):
            parent = None  # rank 0 runs on another host than a SLURM job: its channel tells its death
        # The job is job_bootstrap.py run by path: it watches rank 0 before its slow imports.
        script = str(Path(__file__).with_name("job_bootstrap.py"))
        return [executor.submit(runpy.run_path, script, {"RLCOLLECT_NODE_ARGS": dict(
            master_addr=master_addr, master_port=master_port, rank=rank, world_size=world_size, timeout=timeout,
            secret_file=str(self.secret_file), rank0_timeout=self.rank0_timeout, parent=parent)})
            for rank in ranks]

    def relaunch(self, rank: int) -> None:
        [job] = self._submit([rank])
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
        try:
            _stop_processes(local, max(0.4 * timeout, 2.0))
        finally:
            from rlcollect.distributed.control.auth import remove_secret_file

            remove_secret_file(self._own_file)
            self._own_file = None


class SubmititDelayedLauncher(Launcher):
    """Jobs submitted beforehand with ``submit_nodes``: rank 0 only waits for them."""

    name = "submitit_delayed"

    def start(self, master_addr: str, master_port: int, world_size: int, timeout: float,
              start_timeout: float | None = None) -> None:
        logger.info("rlcollect: waiting up to %g s for %d submitit node job(s) to join %s:%d",
                    start_timeout or timeout, world_size - 1, master_addr, master_port)


def make_launcher(name: str, slurm_kwargs: dict | None, secret: bytes = b"", secret_file: Any = None,
                  rank0_timeout: float = 60.0) -> Launcher:
    """The launcher ``name``; ``secret`` is the run's, ``secret_file`` a file that holds it (the
    one the user's nodes read, for "external" and "submitit_delayed").  ``slurm_kwargs`` are the
    launcher's options: submitit's, or the checked ``ray_options`` for "ray"."""
    if name == "mp":
        return MpLauncher(secret, None, rank0_timeout)
    if name == "submitit":
        return SubmititLauncher(slurm_kwargs, secret, secret_file, rank0_timeout)
    if name == "submitit_delayed":
        return SubmititDelayedLauncher(secret, secret_file, rank0_timeout)
    if name == "external":
        return Launcher(secret, secret_file, rank0_timeout)
    if name == "ray":  # ray_launcher.py; imported (with Ray) only when used
        from rlcollect.distributed.launch.ray_launcher import RayLauncher

        return RayLauncher(slurm_kwargs, secret, secret_file, rank0_timeout)
    raise ValueError(f"launcher must be one of {LAUNCHERS}, got {name!r}")
