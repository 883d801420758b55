"""The distributed collector: nodes on other processes or hosts, joined over torch.distributed.

One module per role:

- ``collector.py``: ``DistributedCollector``, the rank 0 side (what the trainer holds): the
  public calls, wiring the parts below;
- ``gather.py``: ``Gather``, the sync and async gathering of the nodes' batches;
- ``config.py``: its arguments, validated once before anything starts;
- ``pool.py``: ``NodePool``, rank 0's nodes (start, batch notices and batches, credits,
  weights, relaunch, close) and the waiting with liveness checks;
- ``nodes.py``: ``NodeHandle``, one per node, with its explicit state (``NodeState``);
- ``handshake.py``: hello, configuration and "started", at start-up and when a node rejoins;
- ``recovery.py``: what the collector does with a failed node (``on_node_failure``);
- ``node_weights.py``: which nodes get which weights, packed for each node's policy;
- ``stats.py``: ``stats()``;
- ``node.py``: the node process (``rlcollect node``): rendezvous, inner collector, command loop;
  ``node_args.py``: its options;
- ``protocol.py``: the control messages that travel through the TCPStore (keys, formats,
  validation), and the restricted decoding of what nodes send back;
- ``channel.py``: the control plane's inbox thread, and rank 0's side of it: commands out,
  replies and "batch ready" notices in;
- ``transport.py``: where a batch crosses the process boundary: the store server, the gloo
  pair process groups (one per node), flat batch buffers and weight packing;
- ``heartbeat.py``: liveness in both directions;
- ``auth.py``: the run's secret and the keys that authenticate the control plane;
- ``launchers.py``: how node processes are started ("mp", "submitit", "submitit_delayed",
  "external"); ``job_bootstrap.py``: the submitit job.

Nothing is imported here, so that a node process importing ``node.py`` stays light.
"""
