"""The distributed collector: nodes on other processes or hosts, joined over torch.distributed.

Three floors, by role:

- ``control/``: the wires between rank 0 and the nodes (the run's secret and keys, the
  handshake, the channel and its wire format, the control messages, heartbeats, the node's
  watcher, and the transport of batches and weights over gloo). It imports nothing of the
  floors above.
- ``launch/``: how node processes come to exist (``"mp"``, submitit, external, Ray) and the
  node's command-line options. It imports ``control/`` and, in the process it starts, the
  node's entry point (``node.py``).
- here, the collector's parts:

  - ``collector.py``: ``DistributedCollector``, the rank 0 side (what the trainer holds): the
    public calls, wiring the parts below; ``ray_collector.py``: ``RayCollector``;
  - ``gather.py``: ``Gather``, the sync and async gathering of the nodes' batches;
  - ``config.py``: its arguments, validated once before anything starts;
  - ``pool.py``: ``NodePool``, rank 0's nodes (start, batch notices and batches, credits,
    weights, relaunch, close) and the waiting with liveness checks;
  - ``nodes.py``: ``NodeHandle``, one per node, with its explicit state (``NodeState``);
  - ``recovery.py``: what the collector does with a failed node (``on_node_failure``);
  - ``node_weights.py``: which nodes get which weights, packed for each node's policy;
  - ``stats.py``: ``stats()``;
  - ``node.py``: the node process (``rlcollect node``): rendezvous, inner collector, command loop.

These may import ``control/`` and ``launch/`` (tests/test_architecture.py holds the floors).
Nothing is imported here, so that a node process importing ``node.py`` stays light.
"""
