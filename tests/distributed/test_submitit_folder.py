"""Issue 36, item 6: the submitit job folder rlcollect creates is private (0700) before the
run's secret is written into it (it was created 0755 by the secret's writer, and
``private_folder`` found it existing and not group-writable)."""

from __future__ import annotations

import stat

import pytest

from rlcollect.distributed.control.auth import new_secret
from rlcollect.distributed.launch.launchers import SubmititLauncher

pytestmark = pytest.mark.timeout(60)


def test_the_job_folder_holding_the_secret_is_created_0700(tmp_path):
    pytest.importorskip("submitit")
    folder = tmp_path / "jobs"
    launcher = SubmititLauncher({"executor": "local", "folder": str(folder)}, new_secret())
    launcher.start("127.0.0.1", 1, world_size=1, timeout=5.0)  # no node: the folder and the secret only
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE(launcher.secret_file.stat().st_mode) == 0o600
    finally:
        launcher.stop(1.0)
    assert not launcher.secret_file.exists()
