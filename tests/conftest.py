"""Test-wide setup. The fixtures every folder shares are in plugin modules, so that this file
stays a map:

- ``leaks.py``: the leak check around every test and the whole session (child processes,
  /dev/shm entries, file descriptors; ``@pytest.mark.allow_leaks``), and the ``leak_checker``
  fixture;
- ``tiers.py``: the ``processes`` marker, set on every test that may start a process, and
  ``make test-fast`` (``-m "not processes"``), in which starting a process fails the test;
- ``procs.py`` (not a plugin): pid / descendants / /dev/shm helpers for any test.
"""

pytest_plugins = ["pytester", "leaks", "tiers"]
