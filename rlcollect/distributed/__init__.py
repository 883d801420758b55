"""The distributed collector: nodes on other processes or hosts, joined over torch.distributed.

One module per role:

- ``collector.py``: ``DistributedCollector``, the rank 0 side (what the trainer holds);
- ``config.py``: its arguments, validated once before anything starts;
- ``accessors.py``: torchrl's accessors (``iterator()``, per-node devices, frames per batch);
- ``node.py``: the node process (``rlcollect node``): rendezvous, inner collector, command loop;
- ``protocol.py``: the control messages that travel through the TCPStore (keys, formats,
  validation), and the restricted decoding of what nodes send back;
- ``channel.py``: rank 0's side of the control plane: commands out, replies and "batch ready"
  notices in, every wait with a deadline and a liveness check;
- ``transport.py``: where a batch crosses the process boundary: the store server, the gloo
  pair process groups (one per node), flat batch buffers and weight packing;
- ``heartbeat.py``: liveness in both directions;
- ``supervisor.py``: rank 0 watching its nodes (liveness checks), relaunching and readmitting a
  failed one, and releasing them at shutdown;
- ``recovery.py``: what the collector does with a failed node (``on_node_failure``);
- ``node_weights.py``: pushing weights to the nodes, and to a relaunched one;
- ``launchers.py``: how node processes are started ("mp", "submitit", "submitit_delayed",
  "external").

Nothing is imported here, so that a node process importing ``node.py`` stays light.
"""
