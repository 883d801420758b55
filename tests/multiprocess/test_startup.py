"""Issue 16.7: the default start method ("fork" where it is safe, else "forkserver" with torch and
rlcollect preloaded) and what it must keep working: env factories defined in a test module, lambdas
and closures, the main process's environment, scripts without the ``__main__`` guard, "fork" after
CUDA, and a fork server that somebody else started. Start-up speed is measured by
``python -m bench --only start-up`` (bench/startup.py), not asserted here."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
from multiprocessing import forkserver

import pytest
import torch
from mp_helpers import BLOCK, DEFAULT, TRAJ_IDS, counting5, descendant_pids, make_multi, wait_gone  # noqa: F401

from rlcollect import CountingEnv, MultiAsyncCollector, MultiSyncCollector
from rlcollect.multiprocess import start

pytestmark = pytest.mark.timeout(120)


def counting_env_from_this_module():
    """An env factory pickled by reference: the worker imports this test module to find it."""
    return CountingEnv(max_steps=5)


def counting_env_from_environ():
    return CountingEnv(max_steps=int(os.environ["RLCOLLECT_TEST_MAX_STEPS"]))


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[-1].split()[1])


def _first_obs(batch) -> list:
    return batch["observation"][..., 0].tolist()


@pytest.fixture
def another_thread():
    """A thread of the program's own (this suite's leak checker runs one as well): the default
    start method must not fork while it runs."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="programs-own-thread", daemon=True)
    thread.start()
    yield thread
    stop.set()
    thread.join()


# -- the default ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [MultiSyncCollector, MultiAsyncCollector], ids=lambda c: c.__name__)
def test_default_with_another_thread_is_a_preloaded_fork_server(make_multi, cls, another_thread):
    collector = make_multi(cls, counting5, num_workers=2, frames_per_batch=4, mp_start_method=DEFAULT)
    assert collector.mp_start_method == start.DEFAULT_START_METHOD == "forkserver"
    assert collector._pool.context.get_start_method() == "forkserver"
    server = forkserver._forkserver._forkserver_pid
    # The workers are forks of the one fork server, whose preload list has rlcollect's modules ...
    assert [_ppid(pid) for pid in collector.worker_pids()] == [server, server]
    assert set(start.PRELOAD) <= set(forkserver._forkserver._preload_modules)
    assert forkserver._forkserver._preload_modules[0] == start.SERVER_GUARD  # launched from the main thread
    # ... and which has imported torch (its shared library is mapped) before forking them.
    with open(f"/proc/{server}/maps") as f:
        assert "libtorch_cpu" in f.read()
    batch = next(collector)
    if cls is MultiSyncCollector:
        assert _first_obs(batch) == [[0, 1], [0, 1]]
        assert batch[TRAJ_IDS].tolist() == [[0, 0], [BLOCK, BLOCK]]
    else:
        assert _first_obs(batch) == [0, 1, 2, 3]


def test_none_means_the_default_and_bad_values_are_refused(another_thread):
    assert start.resolve_start_method(None) == "forkserver"
    for method in ("spawn", "fork", "forkserver"):
        assert start.resolve_start_method(method) == method
    with pytest.raises(ValueError, match=r"mp_start_method must be None \(the default: 'fork' where it is safe, else "
                                         r"'forkserver'\) or one of \('spawn', 'fork', 'forkserver'\), got 'Spawn'"):
        MultiSyncCollector(counting5, num_workers=1, frames_per_batch=4, mp_start_method="Spawn")


def _only_this_thread(monkeypatch, *others: str) -> None:
    threads = [threading.current_thread()] + [threading.Thread(name=name) for name in others]
    monkeypatch.setattr(start.threading, "enumerate", lambda: threads)


def test_the_default_forks_only_where_it_is_safe(monkeypatch):
    _only_this_thread(monkeypatch)
    assert start.fork_unsafe_reason() is None and start.resolve_start_method(None) == "fork"
    _only_this_thread(monkeypatch, "rlcollect-watchdog")  # a worker's own watchdog holds no lock
    assert start.resolve_start_method(None) == "fork"
    _only_this_thread(monkeypatch, "tqdm-monitor", "SummaryWriter", "x", "y")
    assert start.fork_unsafe_reason() == "another thread runs in this process ('SummaryWriter', 'tqdm-monitor', 'x')"
    assert start.resolve_start_method(None) == "forkserver"
    _only_this_thread(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert start.fork_unsafe_reason() == "CUDA is initialised in this process"
    assert start.resolve_start_method(None) == "forkserver"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(start.sys, "platform", "darwin")
    assert start.fork_unsafe_reason() == "'fork' is not the safe choice on darwin"


def test_the_default_from_another_thread_is_the_fork_server():
    seen = []
    thread = threading.Thread(
        target=lambda: seen.append((start.fork_unsafe_reason(), start.resolve_start_method(None))), name="builder")
    thread.start()
    thread.join()
    assert seen == [("the collector is built in a thread other than the main one ('builder')", "forkserver")]


FORKING_SCRIPT = textwrap.dedent("""
    import functools, os, threading
    from rlcollect import CountingEnv, MultiAsyncCollector, MultiSyncCollector

    def ppids(collector):
        out = []
        for pid in collector.worker_pids():
            with open(f"/proc/{pid}/stat", "rb") as f:
                out.append(int(f.read().rsplit(b")", 1)[-1].split()[1]) == os.getpid())
        return out

    if __name__ == "__main__":
        env = functools.partial(CountingEnv, max_steps=5)
        for cls in (MultiSyncCollector, MultiAsyncCollector):
            with cls(env, num_workers=2, frames_per_batch=4, total_frames=8) as collector:
                batch = next(iter(collector))
                print(cls.__name__, collector.mp_start_method, ppids(collector), batch["observation"].shape[:-1])
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
        with MultiSyncCollector(env, num_workers=2, frames_per_batch=4, total_frames=4) as collector:
            print("with a thread", collector.mp_start_method, ppids(collector))
        stop.set()
""")


def test_a_script_without_threads_forks_its_workers(tmp_path):
    """What a training script gets: no other thread, no CUDA -> each worker is a fork of the main
    process (its parent), which starts it in a fraction of a second; once the script runs a thread
    of its own, the next collector uses the fork server instead."""
    proc = _run(tmp_path, FORKING_SCRIPT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "MultiSyncCollector fork [True, True] torch.Size([2, 2])",
        "MultiAsyncCollector fork [True, True] torch.Size([4])",
        "with a thread forkserver [False, False]",
    ]


def test_env_factory_defined_in_a_test_module(make_multi):
    collector = make_multi(MultiSyncCollector, counting_env_from_this_module, num_workers=2, frames_per_batch=12,
                           mp_start_method=DEFAULT)
    batch = next(collector)
    assert _first_obs(batch) == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 3, 4, 0]]


def test_lambda_and_closure_env_factories(make_multi):
    steps = 3  # captured by the closure: cloudpickle sends it by value
    collector = make_multi(MultiSyncCollector, [lambda: CountingEnv(max_steps=5), lambda: CountingEnv(max_steps=steps)],
                           frames_per_batch=12, mp_start_method=DEFAULT)
    assert _first_obs(next(collector)) == [[0, 1, 2, 3, 4, 0], [0, 1, 2, 0, 1, 2]]


def test_workers_see_the_environment_of_now_not_of_the_server_launch(make_multi, monkeypatch, another_thread):
    # The fork server runs already (launched by this collector or an earlier one) ...
    make_multi(MultiSyncCollector, counting5, num_workers=1, frames_per_batch=2, mp_start_method=DEFAULT)
    assert forkserver._forkserver._forkserver_pid is not None
    # ... and keeps the environment it was launched with; a worker takes the main process's.
    monkeypatch.setenv("RLCOLLECT_TEST_MAX_STEPS", "2")
    collector = make_multi(MultiSyncCollector, counting_env_from_environ, num_workers=2, frames_per_batch=8,
                           mp_start_method=DEFAULT)
    assert _first_obs(next(collector)) == [[0, 1, 0, 1], [0, 1, 0, 1]]


# -- preload list -------------------------------------------------------------------------------------
def test_preload_list_keeps_the_programs_own_and_replaces_pythons_default(monkeypatch):
    server = forkserver._forkserver
    context = multiprocessing.get_context("forkserver")
    monkeypatch.setattr(server, "_preload_modules", ["__main__"])  # Python's untouched default
    start.get_context("forkserver")
    assert server._preload_modules == list(start.PRELOAD)
    monkeypatch.setattr(server, "_preload_modules", ["json", "__main__"])  # the program's own choice
    start.get_context("forkserver")
    assert server._preload_modules == ["json", "__main__", *start.PRELOAD]
    assert context.get_start_method() == "forkserver"


def test_a_fork_server_started_by_someone_else_is_used_and_noted_once(monkeypatch, caplog):
    server = forkserver._forkserver
    forkserver.ensure_running()
    monkeypatch.setattr(start, "_launched", set())  # as if the program had launched it
    monkeypatch.setattr(start, "_noted", False)
    with caplog.at_level(logging.WARNING, logger="rlcollect"):
        assert start.start_fork_server() == (server._forkserver_pid, False)
        start.start_fork_server()
    notes = [r.getMessage() for r in caplog.records if "fork server" in r.getMessage()]
    assert len(notes) == 1 and "was started before rlcollect could preload torch" in notes[0]


# -- "fork" after CUDA ---------------------------------------------------------------------------------
def test_fork_is_refused_once_cuda_is_initialised_and_workers_use_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match=r"mp_start_method='fork' cannot be used here: CUDA is already initialised "
                                         r"in this process and the workers would use it \(cuda\)"):
        MultiSyncCollector(counting5, num_workers=1, frames_per_batch=4, mp_start_method="fork", device="cuda")
    start.check_fork_is_safe("fork", [None, "cpu"], None)  # CPU-only workers may fork
    start.check_fork_is_safe("forkserver", ["cuda"], None)  # a fork server never had CUDA


# -- scripts without the __main__ guard, a fork server that dies ----------------------------------------
UNGUARDED = textwrap.dedent("""
    import functools
    from rlcollect import CountingEnv, MultiSyncCollector

    collector = MultiSyncCollector(functools.partial(CountingEnv, max_steps=5), num_workers=2, frames_per_batch=4,
                                   mp_start_method=METHOD)
    print("built", flush=True)
    collector.shutdown()
""")


def _run(tmp_path, source: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(source)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100,
                          cwd=tmp_path, start_new_session=True)


def test_a_script_without_the_main_guard_fails_clearly_with_the_fork_server(tmp_path):
    """Each worker imports the main module, as with "spawn", which builds a collector again:
    refused there before anything starts, reported here."""
    proc = _run(tmp_path, UNGUARDED.replace("METHOD", "'forkserver'"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "built" not in proc.stdout
    assert "builds a collector at import time. Guard the code that builds the collector with " \
           "`if __name__ == '__main__':`" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlcollect.errors.WorkerError: worker "), last
    assert "exited with code 1 before it was ready" in last


def test_a_script_without_the_main_guard_works_where_the_default_forks(tmp_path):
    """A forked worker does not import the main module: nothing runs twice."""
    proc = _run(tmp_path, UNGUARDED.replace("METHOD", "None"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == "built\n"


def test_the_check_runs_before_any_process_starts(monkeypatch):
    """In a process that is still importing the main module (what multiprocessing marks with
    ``_inheriting``) nothing is started: with a fork server that imports the main module (Python
    3.13's fixed ``"__main__"`` preload) the server would otherwise launch a fork server of its own,
    which would import the script again, and so on."""
    before = descendant_pids()
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match="builds a collector at import time"):
        MultiSyncCollector(counting5, num_workers=1, frames_per_batch=4)
    assert descendant_pids() <= before  # not even the guard process


DYING_SERVER = textwrap.dedent("""
    import functools, multiprocessing
    if __name__ == "__main__":
        multiprocessing.set_forkserver_preload(["explodes"])  # the program's own list: kept
        from rlcollect import CountingEnv, MultiSyncCollector

        MultiSyncCollector(functools.partial(CountingEnv, max_steps=5), num_workers=2, frames_per_batch=4,
                           mp_start_method="forkserver")
""")


def test_a_fork_server_that_dies_while_preloading_is_reported(tmp_path):
    (tmp_path / "explodes.py").write_text("raise RuntimeError('explodes at import, on purpose')\n")
    proc = _run(tmp_path, DYING_SERVER)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "RuntimeError: explodes at import, on purpose" in proc.stderr  # the server's own traceback
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlcollect.errors.WorkerError: worker 0 could not be started: "
                           "multiprocessing's fork server exited before forking it"), last


BLOCKING_SERVER = textwrap.dedent("""
    import functools, multiprocessing
    if __name__ == "__main__":
        multiprocessing.set_forkserver_preload(["blocks"])
        from rlcollect import CountingEnv, MultiSyncCollector

        MultiSyncCollector(functools.partial(CountingEnv, max_steps=5), num_workers=2, frames_per_batch=4,
                           mp_start_method="forkserver", start_timeout=3)
""")


def test_a_fork_server_that_blocks_while_preloading_is_bounded_by_start_timeout(tmp_path):
    """Before, the first worker's start waited for the server without end (here: until the
    subprocess timeout)."""
    (tmp_path / "blocks.py").write_text("import time\ntime.sleep(600)\n")
    proc = _run(tmp_path, BLOCKING_SERVER)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("rlcollect.errors.WorkerError: worker 0 hung during start-up: multiprocessing's "
                    "fork server did not finish importing its preload list within start_timeout=3 s (a module of the "
                    "list blocks at import?); the fork server was killed"), last


# -- the fork server's guard: it dies with the process that launched it ------------------------------
GUARDED_CHILD = textwrap.dedent("""
    import os, subprocess, sys
    env = dict(os.environ, RLCOLLECT_FORK_SERVER_PARENT=str(os.getpid()))
    code = "import rlcollect.multiprocess._server_guard, time; print('armed', flush=True); time.sleep(100)"
    child = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    assert child.stdout.readline() == b"armed\\n"
    print(child.pid, flush=True)
    child.wait()
""")


def test_the_server_guard_kills_the_server_when_its_launcher_dies():
    """What the guard gives a fork server that is still importing torch when the main process is
    SIGKILLed: the kernel kills it at once (before, it lived until its imports were done)."""
    proc = subprocess.Popen([sys.executable, "-c", GUARDED_CHILD], stdout=subprocess.PIPE, start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert wait_gone([child], timeout=1.0) == []
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def test_the_server_guard_exits_when_its_launcher_died_before_it_was_armed():
    env = dict(os.environ, RLCOLLECT_FORK_SERVER_PARENT="1")  # pid 1 is not this child's parent
    out = subprocess.run([sys.executable, "-c", "import rlcollect.multiprocess._server_guard; print('alive')"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (1, "")
    env.pop("RLCOLLECT_FORK_SERVER_PARENT")  # a server someone else launched: nothing happens
    out = subprocess.run([sys.executable, "-c", "import rlcollect.multiprocess._server_guard; print('alive')"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout) == (0, "alive\n")


def test_a_fork_server_launched_from_another_thread_has_no_guard(monkeypatch):
    server = forkserver._forkserver
    monkeypatch.setattr(server, "_preload_modules", [start.SERVER_GUARD, *start.PRELOAD])
    monkeypatch.setattr(forkserver, "ensure_running", lambda: None)  # nothing is launched here
    thread = threading.Thread(target=start.start_fork_server)
    thread.start()
    thread.join()
    assert server._preload_modules == list(start.PRELOAD)
    assert "RLCOLLECT_FORK_SERVER_PARENT" not in os.environ
