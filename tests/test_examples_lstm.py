"""examples/ppo_lstm_masked_cartpole.py runs end to end, shortened (a few batches), in both of its
modes, and the collector's carry is exact: the learner's replay of each batch, from the LSTM
state stored at the first step, reproduces the state stored at every frame (``carry_error``).
Whether it *learns* is shown by the full runs in docs/examples.md (minutes, not a test)."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "ppo_lstm_masked_cartpole.py"
RUN_TIMEOUT_S = 170  # ~20 s on an idle 2-core machine; worker start-up alone can take 30 s on a busy one


def run(tmp_path: Path, *args: str) -> tuple[list[dict], str]:
    out = tmp_path / "curve.png"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, f"failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert out.stat().st_size > 0
    with open(out.with_suffix(".csv"), newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)], proc.stdout


@pytest.mark.timeout(RUN_TIMEOUT_S + 10)
@pytest.mark.parametrize("memory", ["lstm", "none"])
def test_runs_and_the_carried_state_is_exact(tmp_path, memory):
    rows, stdout = run(tmp_path, "--total-frames", "6144", "--memory", memory, "--seed", "1")
    assert [row["frames"] for row in rows] == [2048, 4096, 6144]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("policy_loss", "value_loss", "entropy", "approx_kl"))
        assert row["episodes"] > 0 and 8 < row["mean_return"] < 500
        # The LSTM state of every frame, recomputed from the batch's first step, equals the one
        # the collector carried (were the carry lost, the stored states would be zeros and this
        # would be ~0.1-1). Without memory the state stays zero and the check is trivially 0.
        assert row["carry_error"] <= 1e-5
    assert "largest carry error" in stdout


def test_help_and_bad_arguments(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for option in ("--memory", "--seq-len", "--keep", "--total-frames", "--out"):
        assert option in proc.stdout
    assert "training sequence length" in proc.stdout  # the dataclass field docstrings are the help
    for bad, message in ((["--memory", "gru"], "--memory must be 'lstm' or 'none'"),
                         (["--seq-len", "15"], "must be a multiple of")):
        proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "x.png"), *bad],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
