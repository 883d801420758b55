"""bench/marl.py's configuration of ``python -m bench`` (``--only marl``): its table, and one
short run of rlcollect's side (torchrl's runs under ``--torchrl-python``, not here)."""

from __future__ import annotations

import pytest

from bench import marl

pytestmark = pytest.mark.timeout(300)


def test_the_table_has_a_line_per_row_with_the_ratio():
    result = marl.MarlResult(best={"vmas-navigation-1024": {"rlcollect": (2000.0, 0.004), "torchrl": (1000.0, 0.005)}})
    table = result.table()
    assert "| vmas-navigation-1024 | 2,000 | 1,000 | 2.00x | 0.0040 | 0.0050 |" in table
    assert "| pettingzoo-simple_spread | 0 | 0 | - |" in table
    assert marl.MarlResult(skip="vmas not installed").table().endswith("skipped: vmas not installed")


def test_a_short_run_measures_every_row_on_rlcollects_side(monkeypatch):
    pytest.importorskip("vmas")
    pytest.importorskip("mpe2")
    # (the 4,096-instance row alike, but slower to build)
    monkeypatch.setattr(marl, "ROWS", {k: v for k, v in marl.ROWS.items() if k != "vmas-navigation-4096"})
    logged = []
    result = marl.MarlConfig().run(seconds=0.5, rounds=1, log=logged.append)
    assert set(result.best) == set(marl.ROWS)
    for row in marl.ROWS:
        fps, cpu = result.best[row]["rlcollect"]
        assert fps > 0 and cpu > 0
        assert "torchrl" not in result.best[row]
    assert "torchrl not measured" in result.table()
