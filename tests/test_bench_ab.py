"""bench/ab.py: the alternation, the paired summary and the argument checks (no process is
measured here: a real row takes a minute; the module's figures are never asserted)."""

from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import ab  # noqa: E402


def test_the_order_alternates_round_by_round():
    assert [ab.order(i) for i in range(4)] == [("before", "after"), ("after", "before")] * 2


def test_the_summary_pairs_the_rounds_and_takes_medians():
    m = [
        {"row": "pong-sync", "round": 0, "side": "before", "fps": 100.0, "cpu_per_kframe": 2.0},
        {"row": "pong-sync", "round": 0, "side": "after", "fps": 110.0, "cpu_per_kframe": 2.0},
        {"row": "pong-sync", "round": 1, "side": "after", "fps": 50.0, "cpu_per_kframe": 4.0},
        {"row": "pong-sync", "round": 1, "side": "before", "fps": 50.0, "cpu_per_kframe": 5.0},
        {"row": "pong-sync", "round": 2, "side": "before", "fps": 80.0, "cpu_per_kframe": None},  # after failed
    ]
    fps, cpu = ab.summarize(m)
    assert fps == {"row": "pong-sync", "figure": "fps", "rounds": 2, "before": 80.0, "after": 80.0,
                   "ratio": pytest.approx(1.05), "ratio_min": 1.0, "ratio_max": pytest.approx(1.1)}
    assert cpu["figure"] == "cpu_per_kframe" and cpu["rounds"] == 2
    assert cpu["before"] == 3.5 and cpu["after"] == 3.0 and cpu["ratio"] == pytest.approx(0.9)
    table = ab.format_table([fps, cpu])
    assert table.splitlines()[2].split() == ["pong-sync", "fps", "80", "80", "1.050", "1.00-1.10", "2"]


@pytest.mark.parametrize("argv, says", [
    (["--before", ROOT, "--after", ROOT, "--rows", "breakout-sync"],
     "--rows 'breakout-sync': unknown ['breakout-sync']"),
    (["--before", ROOT, "--after", ROOT, "--rounds", "0"], "--rounds must be at least 1, got 0"),
    (["--before", "/", "--after", ROOT], "--before '/' is not a checkout of rlcollect"),
])
def test_bad_arguments_name_the_argument_and_the_value(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        ab.main(argv)
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
