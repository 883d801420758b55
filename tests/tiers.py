"""The test tiers, a pytest plugin (registered by conftest.py).

Every test that may start a process (a worker, a node, a subprocess, a fork) is marked
``processes``: by hand, or here, when its module names anything that starts one (a
multi-process or distributed collector, ``subprocess``, ``multiprocessing``, ``os.fork``).
``make test-fast`` runs ``-m "not processes"``: the in-process tests, for the edit-run loop;
CI still runs everything (``make test``).

In that tier starting a process is itself a failure ("mark it processes"), so a test that
slipped through the marking is found the first time the fast tier runs it, not trusted.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest

#: What a test module names when it starts processes.
STARTS_PROCESSES = (
    "MultiSyncCollector", "MultiAsyncCollector", "MultiCollector", "AsyncBatchedCollector", "DistributedCollector",
    "subprocess",
    "multiprocessing", "os.fork", "run_node", "runpytest_subprocess", "ReplayBuffer(", "collector_class",
    "mp_helpers", "dist_helpers", "ray_helpers", "launcher=",
)

#: Modules whose tests start processes through what they run (the docs' examples).
PROCESS_MODULES = ("test_docs.py", "test_examples.py", "test_examples_lstm.py", "test_bench.py",
                   "test_bench_startup.py")

_sources: dict[Path, str] = {}


def _source(path: Path) -> str:
    if path not in _sources:
        try:
            _sources[path] = path.read_text()
        except OSError:
            _sources[path] = ""
    return _sources[path]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "processes: the test may start a process (deselected by make test-fast)")


def pytest_collection_finish(session: pytest.Session) -> None:
    if _fast(session.config):  # (after collection: a module may probe a tool at import, for a skipif)
        _refuse_processes()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.fspath)
        if item.get_closest_marker("processes") is None and (path.name in PROCESS_MODULES or any(
                word in _source(path) for word in STARTS_PROCESSES)):
            item.add_marker(pytest.mark.processes)


def _fast(config: pytest.Config) -> bool:
    return "not processes" in (config.getoption("markexpr", "") or "")


def _refuse_processes() -> None:
    """In the fast tier a test that starts a process fails, naming the marker it lacks."""

    def refuse(*args, **kwargs):
        raise RuntimeError("this test starts a process: mark it @pytest.mark.processes (tests/tiers.py)")

    subprocess.Popen.__init__ = refuse
    multiprocessing.process.BaseProcess.start = refuse
    os.fork = refuse
