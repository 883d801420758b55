"""Multi-process collectors.  One module per role:

- ``worker.py``: the worker process (builds its collector, serves commands);
- ``protocol.py``: the command/reply protocol and how exceptions travel back;
- ``shm.py``: the shared-memory batch slots, where a batch crosses the process boundary;
- ``pool.py``, ``handle.py``, ``reaper.py``, ``start.py``: supervision (start-up, each worker's
  state, liveness, timeouts, shutdown); ``lifecycle.py``: a collector's workers started (start
  method, torch threads, acting, pool) and stopped, in reverse;
- ``collector.py``: the public collector classes (``MultiSyncCollector``,
  ``MultiAsyncCollector``, ``MultiCollector``), thin faces that wire the parts below in one
  place, as ``distributed/collector.py`` does for nodes;
- ``slots.py``: the batch slots lent to the user and reclaimed; ``gather.py``: how batches are
  gathered (``SyncGather``; ``AsyncGather`` in ``gather_async.py``);
- ``acting.py``: where the policy acts, in the workers (``InWorkers``: their weights) or in
  this process for all of them (``Central``: rlcollect/inference/);
- ``recovery.py``: where a failed worker is replaced; ``freerun.py``: free running (the workers
  writing a replay buffer on their own, or a background thread); statistics: rlcollect/members.py's ``MemberStats``;
- ``config.py``: the validated options and the workers' specs.

Nothing is imported here, so that a worker importing ``worker.py`` stays light.
"""
