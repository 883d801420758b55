"""Multi-process collectors.  One module per role:

- ``worker.py``: the worker process (builds its collector, serves commands);
- ``protocol.py``: the command/reply protocol and how exceptions travel back;
- ``shm.py``: the shared-memory batch slots, where a batch crosses the process boundary;
- ``pool.py``, ``handle.py``, ``reaper.py``, ``start.py``: supervision (start-up, each worker's
  state, liveness, timeouts, shutdown);
- ``restart.py``: where a failed worker is replaced; ``weight_sync.py``: the workers' weights;
  ``freerun.py``: workers writing a replay buffer on their own; ``stats.py``: their statistics;
- ``config.py``: the validated options and the workers' specs;
- ``base.py``, ``sync.py``, ``asynchronous.py``, ``factory.py``: the public collector classes.

Nothing is imported here, so that a worker importing ``worker.py`` stays light.
"""
