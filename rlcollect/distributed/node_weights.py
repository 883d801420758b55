"""Weights of a ``DistributedCollector``'s nodes: which nodes an automatic update is due for,
which nodes an explicit update targets, and the packing of the weights for each node's policy
(the pool sends them, and gives a relaunched node the last ones)."""

from __future__ import annotations

from typing import Any

from rlcollect.distributed.control import transport
from rlcollect.distributed.nodes import NodeState
from rlcollect.weights.store import as_state_dict


class NodeWeights:
    """What to send to ``pool``'s nodes, by ``config``'s update options
    (``update_after_each_batch``, ``max_weight_update_interval``, ``update_interval``) and
    its ``weight_source`` (rank 0's policy).

    Example (needs running nodes)::

        weights = NodeWeights(config, pool)
        targets = weights.targets(policy, worker_ids=[0])  # {0: policy}
        pool.push_weights(weights.pack(targets), version=1)
    """

    def __init__(self, config: Any, pool: Any):
        self.config, self.pool = config, pool

    def due(self, nodes: Any, yielded: int) -> dict[int, Any]:
        """The automatic updates due before the next batch of ``nodes``, ``yielded`` batches
        (this one included, in async mode) into the run: ``{node: weights}``."""
        cfg, handles = self.config, self.pool.handles
        due = set()
        if cfg.update_after_each_batch:
            due.update(nodes)
        if cfg.max_weight_update_interval > 0:
            # In flight counts: a batch granted before the update may start before it arrives.
            due.update(i for i in nodes
                       if handles[i].since_update + handles[i].outstanding >= cfg.max_weight_update_interval)
        if cfg.update_interval is not None and yielded and yielded % cfg.update_interval == 0:
            due.update(range(cfg.num_nodes))
        return {i: cfg.weight_source for i in sorted(due)}

    def targets(self, weights: Any, worker_ids: Any) -> dict[int, Any]:
        """``{node: weights}`` for ``update_policy_weights_(weights, worker_ids=...)``."""
        n = self.config.num_nodes
        if worker_ids is None:
            ids = list(range(n))
        else:
            ids = [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
        bad = [i for i in ids if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(f"worker_ids must be node indices in [0, {n}), got {bad}")
        if isinstance(weights, dict) and weights and all(isinstance(k, int) for k in weights):
            unknown = sorted(set(weights) - set(range(n)))
            if unknown:
                raise ValueError(f"per-node weights for unknown nodes {unknown}; nodes are 0..{n - 1}")
            return {i: w for i, w in weights.items() if i in ids}
        if weights is None:
            weights = self.config.weight_source
            if weights is None:
                raise RuntimeError("update_policy_weights_() without weights needs a policy with weights on rank 0; "
                                   "pass the weights explicitly")
        return {i: weights for i in ids}

    def pack(self, targets: dict[int, Any]) -> dict[int, Any]:
        """Each targeted node's weights packed for its policy (a dropped node is skipped).
        Everything is packed first: weights that do not fit raise before any node is touched."""
        handles = self.pool.handles
        targets = {i: w for i, w in targets.items() if handles[i].state is not NodeState.DROPPED}
        missing = [i for i in targets if handles[i].info["weights"] is None]
        if missing:
            raise RuntimeError(f"update_policy_weights_: the policy of nodes {missing} has no parameters or buffers, "
                               "so there are no weights to update (a random policy?)")
        packed, cache = {}, {}
        for i, source in targets.items():
            spec = handles[i].info["weights"]
            key = (id(source), tuple((k, s, d) for k, (s, d) in spec.items()))
            if key not in cache:
                cache[key] = transport.pack_weights(as_state_dict(source), spec)
            packed[i] = cache[key]
        return packed
