"""bench/scale.py (issue 35): the table's structure, the descriptor classes, and one real row at
N=2 ``--quick`` (its columns are checked, never its timings)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from loadscale import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import scale  # noqa: E402


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_a_row_has_a_cell_per_column_and_a_failed_row_says_why():
    row = scale.Row(4, "async", "small", first_batch_s=20.0, cpu_ms_per_batch=1.2, cpu_s_per_mb=1.1,
                    mb_per_batch=0.001, rss_mb=400, fds=40, fds_per_node=10.0, batches_per_s=300, fps=3000,
                    bare_fps=3600, threads=20, push_p50_ms=40, push_p99_ms=90, replace_s=12.0, load=4.2)
    header, rule = scale.header().splitlines()
    assert _cells(header) == list(scale.COLUMNS)
    assert len(_cells(rule)) == len(scale.COLUMNS)
    cells = _cells(scale.format_row(row))
    assert len(cells) == len(scale.COLUMNS)
    assert cells[:3] == ["4", "async", "small"] and cells[scale.COLUMNS.index("of bare")] == "0.83"
    failed = _cells(scale.format_row(scale.Row(2, "sync", "large", error="boom")))
    assert len(failed) == len(scale.COLUMNS) and failed[3] == "failed: boom"


def test_descriptors_are_classified_by_port_and_kind():
    store, channel, other = socket.socket(), socket.socket(), socket.socket()
    read, write = os.pipe()
    try:
        for s in (store, channel, other):
            s.bind(("127.0.0.1", 0))
            s.listen()
        new = {fd: target for fd, target in scale.open_fds().items()
               if fd in (store.fileno(), channel.fileno(), other.fileno(), read, write)}
        kinds = scale.classify_fds(new, store.getsockname()[1], channel.getsockname()[1])
    finally:
        for s in (store, channel, other):
            s.close()
        os.close(read)
        os.close(write)
    assert kinds == {"channel": 1, "other tcp (gloo)": 1, "pipe": 2, "store": 1}


def test_bad_lists_are_refused(capsys):
    with pytest.raises(SystemExit):
        scale.main(["--modes", "sometimes"])
    assert "expected a comma-separated list" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_python_m_bench_scale_measures_every_column_of_a_two_node_row(tmp_path):
    path = tmp_path / "scale.json"
    argv = ["--nodes", "2", "--quick", "--modes", "async", "--sizes", "small", "--json", str(path)]
    proc = subprocess.run([sys.executable, "-m", "bench.scale", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=scaled(280, cap=1150))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert _cells(lines[0]) == list(scale.COLUMNS) and len(lines) == 3
    cells = _cells(lines[2])
    assert cells[:3] == ["2", "async", "small"]
    assert all(cell not in ("", "-") for cell in cells), cells
    (row,) = json.loads(path.read_text())
    assert row["error"] is None
    assert row["first_batch_s"] > 0 and row["cpu_ms_per_batch"] > 0 and row["fps"] > 0 and row["bare_fps"] > 0
    assert row["push_p50_ms"] > 0 and row["replace_s"] > 0 and row["rss_mb"] > 0
    # Rank 0 opened descriptors for the nodes' store connections, channels and process groups.
    assert row["fds"] > 0 and {"store", "channel", "other tcp (gloo)"} <= set(row["fds_by_kind"])
    assert row["threads"] > 0
