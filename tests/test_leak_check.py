"""The leak check (leaks.py, registered by conftest.py) sees what it should, and fails (only) the
tests that leak."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from loadscale import scaled

LEAKS = Path(__file__).with_name("leaks.py")
PROCS = Path(__file__).with_name("procs.py")


def _sleep_forever() -> None:
    time.sleep(3600)


def test_reports_a_live_child_and_not_a_finished_one(leak_checker):
    before = leak_checker.Snapshot.take()
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        leaks = leak_checker.find_leaks(before, child_grace=0.2)
        assert set(leaks.children) == {alive.pid}
        assert "time.sleep(60)" in leaks.children[alive.pid]
        assert "child process" in leaks.describe()
    finally:
        alive.kill()
        alive.wait()
    assert leak_checker.find_leaks(before, child_grace=0.2).children == {}


def test_sees_grandchildren(leak_checker):
    before = leak_checker.Snapshot.take()
    code = ("import subprocess, sys, time; "
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        leak_checker._wait_until(lambda: len(leak_checker.descendants(parent.pid)) == 1, 10.0)
        (grandchild,) = leak_checker.descendants(parent.pid)
        leaks = leak_checker.find_leaks(before, child_grace=0.1)
        assert set(leaks.children) == {parent.pid, grandchild}
    finally:
        leak_checker.kill_children([parent.pid, grandchild])
        parent.wait()
    assert leak_checker.live_children() == before.children


def test_waits_for_a_child_that_is_exiting(leak_checker):
    before = leak_checker.Snapshot.take()
    proc = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0.5,))
    proc.start()
    leaks = leak_checker.find_leaks(before, child_grace=10.0)
    assert leaks.children == {}
    assert proc.exitcode == 0  # reaped through multiprocessing, which learnt the exit code


def test_leaves_older_zombies_to_their_owner(leak_checker):
    # A process that ended before the test began belongs to someone else (a module-scoped
    # fixture, say): reaping it would rob its owner of the exit code.
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    leak_checker._wait_until(lambda: leak_checker.descendants().get(proc.pid) == "Z", 10.0)
    before = leak_checker.Snapshot.take()
    assert leak_checker.find_leaks(before, child_grace=0.1).kinds() == []
    assert leak_checker.descendants().get(proc.pid) == "Z"
    assert proc.wait() == 3


def test_multiprocessing_helpers_are_not_leaks(leak_checker):
    ctx = multiprocessing.get_context("spawn")
    before = leak_checker.Snapshot.take()
    lock = ctx.Lock()  # starts the resource tracker (a process and a pipe) if not running yet
    del lock
    leaks = leak_checker.find_leaks(before, child_grace=0.2, shm_grace=0.5)
    assert leaks.kinds() == []


def test_reports_a_dev_shm_entry(leak_checker):
    name = f"rlcollect_leakcheck_{os.getpid()}"
    before = leak_checker.Snapshot.take()
    path = Path(leak_checker.SHM_DIR) / name
    path.write_bytes(b"x")
    try:
        leaks = leak_checker.find_leaks(before, shm_grace=0.1)
        assert leaks.shm == {name}
        assert f"/dev/shm/{name}" in leaks.describe()
    finally:
        path.unlink()
    assert leak_checker.find_leaks(before, shm_grace=0.1).shm == set()


def test_ignores_dev_shm_entries_held_only_by_other_processes(leak_checker):
    name = f"rlcollect_leakcheck_foreign_{os.getpid()}"
    path = Path(leak_checker.SHM_DIR) / name
    before = leak_checker.Snapshot.take()
    # A process outside our tree (a double fork: the middle one exits at once) holds the entry.
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    f = open(sys.argv[1], 'wb'); print('ready', flush=True); time.sleep(60)\n"
    )
    middle = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert middle.stdout.readline() == "ready\n"
        middle.wait()
        (holder,) = leak_checker.shm_holders({name})[name]
        assert holder not in leak_checker.descendants()
        assert leak_checker.find_leaks(before, shm_grace=0.1).shm == set()
    finally:
        for pid in leak_checker.shm_holders({name}).get(name, ()):
            os.kill(pid, 9)
        middle.stdout.close()
        middle.wait()
        path.unlink(missing_ok=True)


def test_ignores_torch_files_of_other_live_processes(leak_checker):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert leak_checker._shm_is_foreign(f"torch_{other.pid}_1_0", ours=set())
        assert not leak_checker._shm_is_foreign(f"torch_{other.pid}_1_0", ours={other.pid})
        assert not leak_checker._shm_is_foreign("psm_deadbeef", ours=set())
    finally:
        other.kill()
        other.wait()


def test_reports_fd_growth_over_the_slack_only(leak_checker):
    before = leak_checker.Snapshot.take()
    r, w = os.pipe()
    extra = []
    try:
        assert leak_checker.find_leaks(before, fd_grace=0.0).fds == {}  # 2 fds: within the slack
        extra = [os.pipe() for _ in range(3)]
        leaks = leak_checker.find_leaks(before, fd_grace=0.1)
        assert leaks.fd_growth == 8
        assert {r, w} <= set(leaks.fds)
        assert all(target.startswith("pipe:") for target in leaks.fds.values())
    finally:
        for fd in (r, w, *(fd for pair in extra for fd in pair)):
            os.close(fd)
    assert leak_checker.find_leaks(before, fd_grace=0.1).fds == {}


def _copy_conftest(pytester) -> None:
    """The leak plugin as the inner suite's conftest (with the helpers it imports)."""
    leaks = LEAKS.read_text()
    assert "CHILD_GRACE_S = 3.0" in leaks
    pytester.makepyfile(procs=PROCS.read_text())
    pytester.makeconftest(leaks.replace("CHILD_GRACE_S = 3.0", "CHILD_GRACE_S = 0.5"))  # a faster run


def test_the_autouse_check_fails_leaky_tests_and_honours_the_marker(pytester):
    """Run a small suite under a copy of our conftest in a fresh interpreter."""
    _copy_conftest(pytester)
    pytester.makepyfile(
        test_inner=textwrap.dedent(
            """
            import os, subprocess, sys
            import pytest

            LEFT = []

            def test_clean():
                subprocess.run([sys.executable, "-c", "pass"], check=True)

            def test_leaks_a_child():
                LEFT.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))

            def test_leaks_fds():
                LEFT.extend(os.pipe() for _ in range(4))

            @pytest.mark.allow_leaks("fds")
            def test_leaks_fds_on_purpose():
                LEFT.extend(os.pipe() for _ in range(4))

            @pytest.mark.allow_leaks("fds")
            def test_allowed_fds_do_not_cover_children():
                LEFT.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))

            @pytest.mark.allow_leaks
            def test_leaks_shm_on_purpose():
                path = "/dev/shm/rlcollect_leakcheck_inner_%d" % os.getpid()
                open(path, "wb").close()
                LEFT.append(path)

            def test_leaks_shm():
                open("/dev/shm/rlcollect_leakcheck_inner2_%d" % os.getpid(), "wb").close()

            def test_reported_shm_was_removed():
                assert not os.path.exists("/dev/shm/rlcollect_leakcheck_inner2_%d" % os.getpid())

            def test_cleanup():
                for path in [x for x in LEFT if isinstance(x, str)]:
                    os.unlink(path)
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "addopts=", "-q")
    result.assert_outcomes(passed=9, errors=4)
    out = result.stdout.str()
    assert "ERROR at teardown of test_leaks_a_child" in out
    assert "ERROR at teardown of test_leaks_fds " in out or "ERROR at teardown of test_leaks_fds\n" in out
    assert "ERROR at teardown of test_allowed_fds_do_not_cover_children" in out
    assert "ERROR at teardown of test_leaks_shm " in out or "ERROR at teardown of test_leaks_shm\n" in out
    assert "new entr(y/ies) left in /dev/shm" in out
    assert "child process(es) still alive" in out
    assert "more open file descriptor(s) than before" in out
    # The fds allowed in one test and the leaked ones in the other stay open until the end,
    # but the session check counts only the unallowed ones; the leaked children were killed.
    assert "the test session leaked" not in out


def test_the_session_check_adds_up_small_leaks(pytester):
    _copy_conftest(pytester)
    pytester.makepyfile(
        test_inner=textwrap.dedent(
            """
            import os
            import pytest

            LEFT = []

            @pytest.mark.parametrize("i", range(12))
            def test_leaks_a_little(i):
                LEFT.append(os.pipe())
                LEFT.append(os.open(os.devnull, os.O_RDONLY))  # 3 fds: under the per-test slack
            """
        )
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-o", "addopts=", "-q")
    result.assert_outcomes(passed=12, errors=1)
    assert "the test session leaked resources" in result.stdout.str()


@pytest.mark.timeout(60)
def test_remove_shm_spares_an_entry_another_process_holds(leak_checker, tmp_path):
    """/dev/shm is shared with the whole machine: an entry a process outside this test's tree
    holds is never unlinked (say, a concurrent test run's), one nobody holds is."""
    name = f"rlcollect-leakcheck-{os.getpid()}"
    path = os.path.join(leak_checker.SHM_DIR, name)
    pid_file = tmp_path / "pid"
    with open(path, "wb") as f:
        f.write(b"x")
    # A daemon (double fork: reparented away from this process) that keeps the entry open.
    code = textwrap.dedent(f"""
        import os, time
        if os.fork() == 0:
            os.setsid()
            f = open({path!r}, "rb")
            with open({str(pid_file)!r} + ".tmp", "w") as out:
                out.write(str(os.getpid()))
            os.rename({str(pid_file)!r} + ".tmp", {str(pid_file)!r})
            time.sleep(60)
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
    leak_checker._wait_until(pid_file.exists, 10.0)
    holder = int(pid_file.read_text())
    try:
        assert holder not in leak_checker.descendants()
        leak_checker.remove_shm({name})
        assert os.path.exists(path)  # held by a foreign process: spared
    finally:
        os.kill(holder, 9)
    leak_checker._wait_until(lambda: not leak_checker.shm_holders({name})[name], 10.0)
    leak_checker.remove_shm({name})
    assert not os.path.exists(path)  # nobody holds it now: removed


@pytest.mark.timeout(60)
def test_a_semaphore_is_found_by_its_inode(leak_checker):
    """glibc maps a semaphore under a temporary name (``sem.XXXXXX (deleted)`` in
    /proc/PID/maps) before linking it as ``sem.mp-...``: only the inode ties the two."""
    sem = multiprocessing.get_context("spawn").Semaphore(1)  # spawn: the name stays while alive
    name = "sem." + sem._semlock.name.lstrip("/")
    try:
        assert os.path.exists(os.path.join(leak_checker.SHM_DIR, name))
        assert os.getpid() in leak_checker.shm_holders({name})[name]
    finally:
        del sem


def _foreign_process(code: str, tmp_path) -> None:
    """Run ``code`` in a process outside this one's tree (a double fork: it waits until its
    parent has exited) and wait for it to finish."""
    done = tmp_path / "done"
    script = textwrap.dedent("""
        import os, time
        parent = os.getpid()  # read before the fork: the child may run only after we exited
        if os.fork() == 0:
            os.setsid()
            deadline = time.monotonic() + 30
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.01)
        """) + textwrap.indent(textwrap.dedent(code), "    ") + f"    open({str(done)!r}, 'w').close()\n"
    subprocess.run([sys.executable, "-c", script], check=True)
    leak_checker_wait = time.monotonic() + scaled(20, cap=80)
    while not done.exists() and time.monotonic() < leak_checker_wait:
        time.sleep(0.02)
    assert done.exists()


@pytest.mark.timeout(60)
def test_an_entry_another_process_left_unheld_is_neither_reported_nor_removed(leak_checker, tmp_path):
    """On a busy machine another program's entry may exist, held by nobody, at our check:
    nothing ties it to this tree, so it is not ours to report or to unlink."""
    name = f"rlcollect-leakcheck-other-{os.getpid()}"
    path = os.path.join(leak_checker.SHM_DIR, name)
    before = leak_checker.Snapshot.take()
    _foreign_process(f"open({path!r}, 'wb').close()\n", tmp_path)
    try:
        assert os.path.exists(path)
        assert leak_checker.shm_holders({name})[name] == set()
        assert leak_checker.find_leaks(before, shm_grace=0.1).shm == set()
        leak_checker.remove_shm({name})
        assert os.path.exists(path)
    finally:
        os.unlink(path)


@pytest.mark.timeout(60)
def test_an_entry_a_killed_child_held_is_reported_and_removed(leak_checker):
    """The leak that matters: a child of ours maps an entry and dies without removing it; once
    nobody holds it, the inode it held still ties it to this tree."""
    name = f"rlcollect-leakcheck-killed-{os.getpid()}"
    path = os.path.join(leak_checker.SHM_DIR, name)
    before = leak_checker.Snapshot.take()
    code = (
        "import mmap, sys, time\n"
        "f = open(sys.argv[1], 'w+b'); f.truncate(4096); m = mmap.mmap(f.fileno(), 4096)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        time.sleep(5 * leak_checker.SHM_POLL_S)  # a few polls while it is held
        child.kill()
        child.wait()
        leaks = leak_checker.find_leaks(before, shm_grace=0.1)
        assert leaks.shm == {name}
        leak_checker.remove_shm(leaks.shm)
        assert not os.path.exists(path)
    finally:
        child.stdout.close()
        if os.path.exists(path):
            os.unlink(path)
