"""Multi-process collectors.  One module per role:

- ``worker.py``: the worker process (builds its collector, serves commands);
- ``protocol.py``: the command/reply protocol and how exceptions travel back;
- ``shm.py``: the shared-memory batch slots, where a batch crosses the process boundary;
- ``pool.py``: supervision (start-up, liveness, timeouts, shutdown);
- ``base.py``, ``sync.py``, ``asynchronous.py``, ``factory.py``: the public collector classes.

Nothing is imported here, so that a worker importing ``worker.py`` stays light.
"""
