"""A script without the ``__main__`` guard works while the default start method is "fork", and
fails once a thread runs (the default then picks the fork server, whose workers import the main
module): the error must say so, not call the fork server "the default" (issue 25, item 7)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import threading
    from rlcollect import CountingEnv, MultiSyncCollector
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="like-a-tensorboard-writer", daemon=True).start()
    collector = MultiSyncCollector([CountingEnv] * 2, None, frames_per_batch=20, total_frames=20, start_timeout=60)
    list(collector)
    collector.shutdown()
    stop.set()
""")


@pytest.mark.timeout(180)
def test_an_unguarded_script_with_a_thread_is_told_why_the_guard_matters(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlcollect.errors.WorkerError: worker "), proc.stderr[-3000:]
    assert "guard it with `if __name__ == '__main__':`" in last
    assert "'forkserver', which the default picks instead of 'fork' once another thread runs" in last
    assert "'forkserver', the default" not in proc.stderr
