"""bench/importtime.py's reading of ``python -X importtime`` (nothing is timed here)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.importtime import added_after, parse  # noqa: E402

SAMPLE = """\
import time: self [us] | cumulative | imported package
import time:       100 |        100 |   torch._C
import time:      2000 |       2100 | torch
import time:        50 |         50 |   gymnasium.core
import time:       200 |        250 | gymnasium
import time:        30 |         30 |     rlcollect.envs.base
import time:        70 |        100 |   rlcollect.envs
import time:       400 |        500 | rlcollect.collector
import time:        10 |         10 | rlcollect
Traceback or other lines are ignored
"""


def test_parse_reads_depth_and_times():
    entries = parse(SAMPLE)
    assert entries[0] == (100, 100, 1, "torch._C")
    assert entries[4] == (30, 30, 2, "rlcollect.envs.base")
    assert len(entries) == 8


def test_what_follows_the_last_dependency_is_rlcollects():
    total, modules = added_after(parse(SAMPLE), "gymnasium")
    assert total == 510  # the top-level imports after gymnasium: 500 + 10
    assert modules[:2] == [(500, "rlcollect.collector"), (100, "rlcollect.envs")]


def test_a_missing_dependency_line_is_an_error():
    with pytest.raises(ValueError, match="'tensordict' is not imported at the top level"):
        added_after(parse(SAMPLE), "tensordict")
