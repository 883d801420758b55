"""How node processes come to exist, and the node's options.

- ``launchers.py``: the "mp", "submitit", "submitit_delayed" and "external" launchers, and
  ``submit_nodes``; ``job_bootstrap.py``: the submitit job (run by path);
- ``ray_launcher.py``: the "ray" launcher (imported, with Ray, only when used); ``ray_node.py``:
  the Ray actor that runs a node;
- ``node_args.py``: the node's command-line options (``rlcollect node``; standard library and
  ``auth.py`` only).

May import: the standard library, rlcollect's modules outside ``rlcollect.distributed``,
``control/``, ``launch/`` itself, and the node's entry point ``rlcollect.distributed.node``
(the process a launcher starts runs it); nothing else of the collector's parts
(tests/test_architecture.py holds it). Nothing is imported here.
"""
