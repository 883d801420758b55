"""Every test's pytest-timeout bound, stretched by the machine's load when the test starts (a
pytest plugin, registered by conftest.py).

A test's ``@pytest.mark.timeout(N)`` (or the ini's ``timeout``) is a hang guard sized on a quiet
machine; the suite also runs beside other jobs (``make test-loaded``: load 6 or more on 2 cores),
where the same work takes several times longer on the clock and a fixed bound fails tests that
are only slow (issue 38). The bound is multiplied by ``loadscale.slowdown()`` read when the test
starts, at most ``MAX_FACTOR`` times, so that a real hang is still caught. The waits inside a test
scale themselves (``loadscale.scaled``); this only keeps the outer bound from firing first.
"""

from __future__ import annotations

import time

import pytest
from loadscale import slowdown

MAX_FACTOR = 4.0
_READ_EVERY_S = 10.0  # the load is read at most this often (a reading samples /proc for 0.2 s)
_last: list[float] = [float("-inf"), 1.0]  # when it was read, the factor


def factor() -> float:
    now = time.monotonic()
    if now - _last[0] > _READ_EVERY_S:
        _last[:] = [now, min(slowdown(), MAX_FACTOR)]
    return _last[1]


def _bound(item: pytest.Item) -> tuple[float | None, dict]:
    """The test's timeout in seconds (None: none) and the marker's other options."""
    marker = item.get_closest_marker("timeout")
    if marker is None:
        ini = item.config.getini("timeout")
        return (float(ini) if ini else None), {}
    options = dict(marker.kwargs)
    seconds = marker.args[0] if marker.args else options.pop("timeout", None)
    if len(marker.args) > 1:
        options["method"] = marker.args[1]
    return (float(seconds) if seconds else None), options


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    # Runs before pytest-timeout's own wrapper, which reads the closest timeout marker.
    seconds, options = _bound(item)
    stretch = factor()
    if seconds and stretch > 1.0:
        item.add_marker(pytest.mark.timeout(round(seconds * stretch, 1), **options), append=False)
    yield


def pytest_report_header(config: pytest.Config) -> str:
    return (f"timeouts: each test's bound x the load per core when it starts (now x{factor():.1f}, "
            f"at most x{MAX_FACTOR:.0f}; tests/timeouts.py)")
