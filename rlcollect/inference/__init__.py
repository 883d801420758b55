"""Central batched inference (``inference="central"``): env workers only step envs, and one
loop in the main process runs the policy for all of them, batched.

- ``block.py``: the shared-memory block the observations and the policy's outputs cross in,
  one row range ("slot") per worker split, and the one-byte messages that say a slot is ready;
- ``client.py``: the worker's side, a runner (``RemoteRunner``) that writes its observations
  into its slot and waits for the actions, and ``RemotePolicy``, the policy a worker's
  collector is built with;
- ``split.py``: a worker's envs in splits stepped alternately (one waits for its actions while
  the other steps), as one env and one rollout to the collector;
- ``server.py``: ``InferenceServer``, the main process's thread that gathers the ready slots,
  runs one forward and writes the actions back.

What a collector holds of it (``CentralInference``) is ``multiprocess/acting.py``'s ``Central``:
where the policy acts is that role's choice, and nothing else in the collectors knows it.
"""
