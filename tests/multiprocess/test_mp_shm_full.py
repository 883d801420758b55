"""Issue 13.10: a /dev/shm too small for the batch slots gives a clear error (``OSError``
ENOSPC naming the sizes and what to do) as soon as the sizes are known, before any slot is
allocated, and leaves nothing behind; a real allocation failure in torch is turned into the
same error and removes the empty file torch leaves in /dev/shm."""

from __future__ import annotations

import errno
import functools
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlcollect import MultiSyncCollector
from rlcollect.envs.testing import CountingEnv
from rlcollect.multiprocess import shm

START = "forkserver"
multiprocessing.get_context(START).set_forkserver_preload(["torch", "tensordict", "rlcollect.multiprocess.worker"])
SCRIPT = Path(__file__).with_name("mp_shm_full_script.py")
env = functools.partial(CountingEnv, obs_dim=256, max_steps=None)


def _own_torch_files() -> set[str]:
    return {f for f in os.listdir(shm.SHM_DIR) if f.startswith(f"torch_{os.getpid()}_")}


@pytest.mark.timeout(90)
def test_free_space_is_checked_before_any_slot_is_allocated(monkeypatch):
    real_statvfs = os.statvfs
    free_blocks = 100  # 100 blocks of 4 KiB: 400 KiB free

    def statvfs(path):
        result = real_statvfs(path)
        if os.fspath(path) != shm.SHM_DIR:
            return result
        fields = list(result)
        fields[0] = fields[1] = 4096  # f_bsize, f_frsize
        fields[3] = fields[4] = free_blocks  # f_bfree, f_bavail
        return os.statvfs_result(fields)

    monkeypatch.setattr(shm.os, "statvfs", statvfs)
    allocated = []
    real_allocate = shm.allocate_slot
    record = lambda layout: allocated.append(layout) or real_allocate(layout)  # noqa: E731
    monkeypatch.setattr("rlcollect.multiprocess.slots.allocate_slot", record)
    monkeypatch.setattr(shm, "allocate_slot", record)  # what MultiSync's stacked slots allocate through
    before = _own_torch_files()
    with pytest.raises(OSError) as info:
        MultiSyncCollector(env, num_workers=2, frames_per_batch=2000, mp_start_method=START)
    err = info.value
    assert err.errno == errno.ENOSPC
    needed = 2 * (2 * 1000 * 256 * 4 + 64 * 20)  # two 1000-step slots of obs + next obs dominate
    message = str(err)
    assert "not enough shared memory for the batch slots of 2 workers" in message, message
    assert "/dev/shm" in message and "only 400.0 KiB are free" in message and "--shm-size" in message, message
    assert "MiB are needed" in message and needed > free_blocks * 4096
    assert allocated == []  # refused before the first slot
    assert _own_torch_files() == before


def _namespace_available() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /dev/shm"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.timeout(180)
@pytest.mark.skipif(not _namespace_available(), reason="needs root and unshare -m to mount a private tiny /dev/shm")
@pytest.mark.parametrize("case", ["precheck", "torch"])
def test_tiny_dev_shm_clear_error_nothing_left(case):
    """A real 1 MiB /dev/shm, private to the script's mount namespace (the machine's /dev/shm
    is untouched)."""
    started = time.monotonic()
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1M tmpfs /dev/shm && exec "$0" "$1" "$2"',
         sys.executable, str(SCRIPT), case],
        capture_output=True, text=True, timeout=150)
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert "error" in lines, out.stdout + out.stderr
    assert lines["error"].startswith(f"{errno.ENOSPC} [Errno 28] not enough shared memory for "), lines["error"]
    if case == "precheck":
        assert "the batch slots of 2 workers" in lines["error"] and "are free" in lines["error"], lines["error"]
    else:
        error = lines["error"]
        assert "a batch slot" in error and "the allocation failed (it is full)" in error, error
    assert lines["left"] == "[]", lines["left"]  # no torch_<pid>_* file, nothing else either
    assert time.monotonic() - started < 150
