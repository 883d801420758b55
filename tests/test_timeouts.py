"""tests/timeouts.py: a test's pytest-timeout bound is stretched by the load factor, options kept."""

from __future__ import annotations

import pytest
import timeouts

INNER = """
import time
import pytest

@pytest.mark.timeout(1, method="signal")
def test_takes_1_5_s():
    time.sleep(1.5)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("stretch", "passed"), [(1.0, False), (2.0, True)])
def test_the_bound_is_stretched_by_the_load(pytester, monkeypatch, stretch, passed):
    monkeypatch.setattr(timeouts, "factor", lambda: stretch)
    pytester.makepyfile(INNER)
    result = pytester.runpytest("-p", "timeouts", "-q")
    result.assert_outcomes(passed=int(passed), failed=int(not passed))
    if not passed:
        result.stdout.fnmatch_lines(["*Timeout*"])


def test_the_header_says_the_factor(pytester, monkeypatch):
    monkeypatch.setattr(timeouts, "factor", lambda: 2.5)
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("-p", "timeouts")
    result.stdout.fnmatch_lines(["timeouts: each test's bound x the load per core when it starts (now x2.5, *"])
