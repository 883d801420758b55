"""Test-wide setup. The fixtures every folder shares are in plugin modules, so that this file
stays a map:

- ``leaks.py``: the leak check around every test and the whole session (child processes,
  /dev/shm entries, file descriptors; ``@pytest.mark.allow_leaks``), and the ``leak_checker``
  fixture;
- ``timeouts.py``: every test's pytest-timeout bound stretched by the machine's load when it
  starts (at most 4x);
- ``tiers.py``: the ``processes`` marker, set on every test that may start a process, and
  ``make test-fast`` (``-m "not processes"``), in which starting a process fails the test;
- ``procs.py`` (not a plugin): pid / descendants / /dev/shm helpers for any test.

It also gives SIGINT back its default handler when the suite was started with it ignored: a
shell starts a background job (``make test &``, ``nohup``) with SIGINT ignored, every process the
tests start inherits that, and the Ctrl-C tests' scripts then never see their Ctrl-C (they ran
until the tests' timeouts). A user's interactive Python always has the default handler.
"""

import signal

pytest_plugins = ["pytester", "leaks", "tiers", "timeouts"]

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
