"""examples/ppo_torchrl_cartpole.py (torchrl's PPO with our ``MultiSyncCollector``) runs end to
end, shortened, in the torchrl venv (``make test-torchrl``); the same script with torchrl's own
``MultiSyncCollector`` imported instead runs too (the one-line diff that
docs/migrating-from-torchrl.md shows is the whole migration). The diff in the docs is checked
against the example everywhere; the runs are skipped where torchrl is not installed."""

from __future__ import annotations

import csv
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "examples" / "ppo_torchrl_cartpole.py"
GUIDE = ROOT / "docs" / "migrating-from-torchrl.md"
OURS = "from rlcollect import MultiSyncCollector"
THEIRS = "from torchrl.collectors import MultiSyncCollector"
RUN_TIMEOUT_S = 200  # ~30 s on an idle 2-core machine; torchrl's imports and spawn start-up are slow on a busy one


def needs_torchrl():
    # (torchrl.collectors, not torchrl: without torchrl, "torchrl" would import tests/torchrl)
    pytest.importorskip("torchrl.collectors")


def run(script: Path, tmp_path: Path) -> list[dict]:
    out = tmp_path / "curve.png"
    proc = subprocess.run([sys.executable, str(script), "--out", str(out), "--total-frames", "2000", "--seed", "1"],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=tmp_path)
    assert proc.returncode == 0, f"failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(out.with_suffix(".csv"), newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def check_rows(rows: list[dict]) -> None:
    assert [row["frames"] for row in rows] == [1000, 2000]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("loss_objective", "loss_critic", "loss_entropy"))
        assert row["episodes"] > 0 and 8 < row["mean_return"] <= 500


@pytest.mark.timeout(RUN_TIMEOUT_S + 10)
def test_example_runs_with_our_collector(tmp_path):
    needs_torchrl()
    check_rows(run(SCRIPT, tmp_path))


@pytest.mark.timeout(RUN_TIMEOUT_S + 10)
def test_the_torchrl_original_runs_too(tmp_path):
    # The example with torchrl's collector imported instead: the torchrl original, unchanged
    # otherwise (arguments, iteration, update_policy_weights_, set_seed, shutdown).
    needs_torchrl()
    source = SCRIPT.read_text()
    assert source.count(OURS) == 1
    original = tmp_path / "ppo_torchrl_original.py"
    original.write_text(source.replace(OURS, THEIRS))
    check_rows(run(original, tmp_path))


def test_the_guides_diff_is_the_example():
    # The section "From torchrl, line by line" shows a diff whose - lines are torchrl's original
    # and whose + lines are in the example; the only changed line is the import.
    guide = GUIDE.read_text()
    section = guide[guide.index("## From torchrl, line by line"):]
    blocks = re.findall(r"```diff\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    diff = "".join(blocks).splitlines()
    removed = [line[1:].strip() for line in diff if line.startswith("-")]
    added = [line[1:].strip() for line in diff if line.startswith("+")]
    context = [line[1:].strip() for line in diff if line.startswith(" ") and line.strip()]
    assert [r.split("  #")[0] for r in removed] == [THEIRS]
    assert [a.split("  #")[0] for a in added] == [OURS]
    source = [line.strip() for line in SCRIPT.read_text().splitlines()]
    assert any(line.startswith(OURS) for line in source)
    for line in context:  # the unchanged lines shown are the example's
        assert line in source, line
