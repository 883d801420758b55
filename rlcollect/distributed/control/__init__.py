"""The wires between rank 0 and the nodes: one module per part of the control plane, and the
transport of batches and weights.

- ``auth.py``: the run's secret and the keys that authenticate the control plane;
- ``messages.py``: the control messages (standard library and ``auth.py`` only: the watcher
  uses it without torch); ``protocol.py``: their keys, formats and validation, and the
  restricted decoding of what nodes send back (it re-exports ``messages.py``);
- ``wire.py``: a length-prefixed message stream over a socket, and its listener (rank 0's one
  port);
- ``channel.py``: the control plane's inbox thread, and rank 0's side of it: hellos, commands
  out, replies and "batch ready" notices in;
- ``channel_store.py``: the pair groups' rendezvous store, reached by the nodes through their
  channel (rank 0 hosts no store server);
- ``handshake.py``: hello, configuration and "started", at start-up and when a node rejoins;
- ``heartbeat.py``: liveness in both directions;
- ``watcher.py``: the tiny process beside each node that reports its state;
- ``env_state.py``: pickled env state found, stripped and refused in what crosses the network;
- ``transport.py``: where a batch crosses the process boundary: the gloo pair process groups
  (one per node) and their store, flat batch buffers and weight packing; ``pair_ports.py``
  closes each pair's gloo listener once the pair is connected.

May import: the standard library, torch, tensordict, rlcollect's modules outside
``rlcollect.distributed`` and ``control/`` itself; nothing of ``launch/`` or of the collector's
parts above (tests/test_architecture.py holds it). Nothing is imported here: the watcher
(``python -m rlcollect.distributed.control.watcher``) must start without torch.
"""
