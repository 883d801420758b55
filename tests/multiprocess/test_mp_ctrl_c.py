"""Issue 13.9: Ctrl-C (SIGINT to the whole foreground process group, as a terminal sends it)
gives one KeyboardInterrupt in the main process, nothing from the workers, and every process
gone within 2 s; ``rlcollect collect`` prints one line and exits 130.

Bound: 2 s from the SIGINT (the issue's requirement) to the last worker, guard and fork server
gone and to the main process's KeyboardInterrupt; the CLI's process itself is gone within 2 s too.
A user script's main process additionally runs the interpreter's teardown (see the allowance
below). This test polls /proc every 20 ms.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from procs import cmdline as _cmdline
from procs import live_descendants as _descendants
from procs import own_tmpdir  # noqa: F401  (fixture)
from procs import pid_alive as _alive

SCRIPT = Path(__file__).with_name("mp_ctrl_c_script.py")
BOUND_S = 2.0
TEARDOWN_ALLOWANCE_S = 8.0


def _maps_shared_slots(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "/dev/shm/torch_" in f.read()
    except OSError:
        return False


class _Stderr:
    """Reads a process's stderr in a thread, noting when each line arrived."""

    def __init__(self, stream):
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in iter(stream.readline, b""):
            self.lines.append((time.monotonic(), line.decode(errors="replace")))

    def text(self) -> str:
        self._thread.join(10)
        return "".join(line for _, line in self.lines)

    def first(self, needle: str) -> float | None:
        self._thread.join(10)
        return next((t for t, line in self.lines if needle in line), None)


def _interrupt(proc: subprocess.Popen, extra: set[int]) -> tuple[float, dict[int, float], dict[int, str]]:
    """SIGINT the process group as a terminal does; when it was sent, and when each process of
    the run was gone (seconds after it; missing: still alive after BOUND_S + 10 s)."""
    everyone = {proc.pid} | extra | _descendants(proc.pid)
    names = {p: _cmdline(p) for p in everyone}
    os.killpg(proc.pid, signal.SIGINT)
    sent = time.monotonic()
    gone: dict[int, float] = {}
    while len(gone) < len(everyone) and time.monotonic() - sent < BOUND_S + 10:
        proc.poll()
        for p in everyone - set(gone):
            if not _alive(p):
                gone[p] = time.monotonic() - sent
        time.sleep(0.02)
    late = {p: _cmdline(p)[:100] for p in everyone - set(gone)}
    assert not late, f"alive {BOUND_S + 10} s after Ctrl-C: {late}"
    return sent, gone, names


def _cleanup(proc: subprocess.Popen) -> None:
    for pid in _descendants(proc.pid) | {proc.pid}:
        if "resource_tracker" not in _cmdline(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    proc.wait(10)
    proc.stdout.close()
    proc.stderr.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("phase", ["start-up", "collect"])
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_ctrl_c_one_traceback_workers_silent_all_gone(method, phase):
    proc = subprocess.Popen([sys.executable, str(SCRIPT), method], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own group, which we interrupt as a terminal would
    stderr = _Stderr(proc.stderr)
    try:
        assert proc.stdout.readline().startswith(b"building")
        extra: set[int] = set()
        if phase == "start-up":
            deadline = time.monotonic() + 60
            while not any("spawn_main" in _cmdline(p) or "forkserver" in _cmdline(p) for p in _descendants(proc.pid)):
                assert time.monotonic() < deadline and proc.poll() is None, stderr.text()[-2000:]
                time.sleep(0.02)
            time.sleep(0.2)  # the workers are importing (or the fork server is)
        else:
            line = proc.stdout.readline().split()
            assert line[:1] == [b"pids"], line
            extra = {int(p) for p in line[1:]}
            assert proc.stdout.readline().startswith(b"collecting")
            time.sleep(0.3)  # mid-batch: batches take about 1 s
        sent, gone, names = _interrupt(proc, extra)
        proc.wait(10)
        stderr_text = stderr.text()
        # multiprocessing's resource tracker (and a fork server started before this collector)
        # serve the whole main process, not one collector: they end after it, when it closes
        # their pipes; one launched just before the Ctrl-C may still be booting Python then
        # (seconds on a loaded machine). _interrupt() requires them gone within 12 s.
        tracker = {p for p in gone if "resource_tracker" in names[p] or "forkserver import main" in names[p]}
        children = {p: t for p, t in gone.items() if p != proc.pid and p not in tracker}
        assert children and max(children.values()) <= BOUND_S, f"{method}/{phase}: {children}\n{stderr_text[-3000:]}"
        raised = stderr.first("KeyboardInterrupt")
        assert raised is not None and raised - sent <= BOUND_S, stderr_text
        assert stderr_text.count("Traceback (most recent call last)") == 1, stderr_text
        assert [line for line in stderr_text.splitlines() if "KeyboardInterrupt" in line] == ["KeyboardInterrupt"], \
            stderr_text
        # The main process itself ends once the interpreter's teardown (torch loaded) is done,
        # which rlcollect does not shorten in a user's program: measured 0.8-4.4 s on a busy
        # 2-core machine, hence the allowance.
        assert gone[proc.pid] <= BOUND_S + TEARDOWN_ALLOWANCE_S, gone
        assert proc.returncode != 0
    finally:
        _cleanup(proc)


@pytest.mark.timeout(180)
def test_cli_collect_ctrl_c_prints_one_line_and_exits_130(own_tmpdir):
    # Its own temp folder: what multiprocessing made there (pymp-*) must be gone after the exit.
    temp = own_tmpdir
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlcollect.cli", "collect", "--workers", "2", "--frames", "100000000",
         "--frames-per-batch", "200", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, env={**os.environ, "TMPDIR": str(temp)})
    try:
        deadline = time.monotonic() + 120
        while True:  # collecting once both workers have mapped their shared batch slots
            # whatever the default start method picked (forks of the main process or of the fork
            # server, or spawned interpreters): the processes below proc that map the batch slots
            workers = [p for p in _descendants(proc.pid) if _maps_shared_slots(p)]
            if len(workers) == 2:
                break
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read().decode()[-2000:]
            time.sleep(0.05)
        time.sleep(0.5)
        sent, gone, _ = _interrupt(proc, set())
        proc.wait(10)
        stdout = proc.stdout.read().decode()
        # The command skips the interpreter's teardown once everything is shut down: the whole
        # run, main process included, is gone within the bound.
        assert max(gone.values()) <= BOUND_S, gone
        # The start-up phases logged at INFO (the CLI's default, "HH:MM:SS message") come
        # first; the Ctrl-C itself adds exactly one line, the last, and no traceback.
        stderr = proc.stderr.read().decode()
        assert [line for line in stderr.splitlines() if not re.match(r"\d\d:\d\d:\d\d ", line)] == \
            ["rlcollect: interrupted"], stderr
        assert stderr.endswith("rlcollect: interrupted\n"), stderr
        assert stdout == ""
        assert proc.returncode == 130
        assert sorted(p.name for p in temp.glob("pymp-*")) == []  # (os._exit skips multiprocessing's own removal)
    finally:
        _cleanup(proc)
