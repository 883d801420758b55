"""A DistributedCollector's start-up says each phase at INFO (issue 38 item 3: building one took
23-69 s on a loaded machine with nothing logged)."""

from __future__ import annotations

import logging
import os
import re
import sys

import pytest

from dist_helpers import ValuePolicy, counting5
from rlcollect.distributed.collector import DistributedCollector

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from loadscale import scaled  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_each_start_up_phase_is_one_info_line(caplog):
    caplog.set_level(logging.INFO, logger="rlcollect")
    collector = DistributedCollector([counting5] * 2, ValuePolicy(), frames_per_batch=20, total_frames=20,
                                     sync=True, timeout=120.0, start_timeout=scaled(120, cap=480))
    try:
        assert sum(b.numel() for b in collector) == 20
    finally:
        collector.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.name == "rlcollect" and r.levelno == logging.INFO]
    phases = [line for line in lines if re.match(r"rlcollect: (starting|\d/2 node|connecting|2 node\(s\) serving)",
                                                 line)]
    assert re.fullmatch(r"rlcollect: starting 2 node\(s\) \(launcher='mp'\), rank 0 at \S+:\d+", phases[0]), phases
    reached = [p for p in phases if "reached rank 0" in p]
    built = [p for p in phases if "built their collector" in p]
    assert [p.split(" node")[0] for p in reached] == ["rlcollect: 1/2", "rlcollect: 2/2"], phases
    assert [p.split(" node")[0] for p in built] == ["rlcollect: 1/2", "rlcollect: 2/2"], phases
    assert phases[-2] == "rlcollect: connecting the 2 node(s)' process groups", phases
    assert re.fullmatch(r"rlcollect: 2 node\(s\) serving, \d+\.\d s after the launch", phases[-1]), phases
    assert len(phases) == 7, phases
