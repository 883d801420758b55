"""examples/ippo_vmas.py runs end to end, shortened, and learns: its mean reward per agent-step
ends clearly above the random policy's."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vmas")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "ippo_vmas.py"


@pytest.mark.processes
@pytest.mark.timeout(300)
def test_ippo_vmas_learns_above_the_random_policy(tmp_path):
    out = tmp_path / "curve.png"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--seed", "1", "--total-frames", "300000", "--out", str(out)],
                          capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out.with_suffix(".csv"), newline="") as f:
        rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    assert len(rows) == 30
    random = rows[0]["random_mean_reward"]
    last = sum(r["mean_reward"] for r in rows[-5:]) / 5
    assert random < 0 and last > random + 0.01, (random, last)
