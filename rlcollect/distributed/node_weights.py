"""Weights of a ``DistributedCollector``'s nodes: automatic and explicit updates, versions, and
the weights a relaunched node is given before it collects."""

from __future__ import annotations

from typing import Any

from rlcollect.distributed import transport
from rlcollect.weights.models import UnknownModelError, delegate_to_updater, update_targets
from rlcollect.weights.schemes import NoWeightSyncScheme
from rlcollect.weights.store import as_state_dict

#: Weight sends not yet taken by a slow node before we wait for the oldest.
MAX_PENDING_WEIGHTS = 8


class NodeWeights:
    """Mixin of ``DistributedCollector``: pushing weights to the nodes over their pair groups."""

    def _push_due(self, nodes: Any, yielded: int) -> None:
        """The automatic updates due before the next batch of ``nodes``, ``yielded`` batches
        (this one included, in async mode) into the run."""
        cfg = self.config
        due = set()
        if cfg.update_after_each_batch:
            due.update(nodes)
        if cfg.max_weight_update_interval > 0:
            # In flight counts: a batch granted before the update may start before it arrives.
            due.update(i for i in nodes if self._since_update[i] + self._outstanding[i] >= cfg.max_weight_update_interval)
        if cfg.update_interval is not None and yielded and yielded % cfg.update_interval == 0:
            due.update(range(self.num_nodes))
        if due:
            self._push({i: cfg.weight_source for i in sorted(due)})

    def update_policy_weights_(self, policy_or_weights: Any = None, *, weights: Any = None, policy: Any = None,
                               worker_ids: Any = None, model_id: str | None = None,
                               weights_dict: dict | None = None) -> None:
        """Send new weights to every node (or the node indices ``worker_ids``), with a new
        version; each node passes them to its workers and acts with them from its next batch.
        A node being relaunched gets them when it rejoins; a dropped node is skipped.

        The weights (positionally, ``weights=`` or ``policy=``): None (rank 0's ``policy``), an
        ``nn.Module``, a TensorDict of parameters, a state dict, or ``{node_index: weights}``.
        ``model_id`` / ``weights_dict`` accept torchrl's forms, but a DistributedCollector has
        only the ``"policy"`` model: any other id raises ``UnknownModelError`` (a KeyError).
        With ``weight_updater`` the call goes to it (torchrl's legacy path).

        Example (needs running nodes)::

            collector.update_policy_weights_(policy)                  # every node
            collector.update_policy_weights_(policy, worker_ids=[0])  # node 0 only
        """
        self._check_open()
        if delegate_to_updater(self, policy_or_weights, weights=weights, policy=policy, model_id=model_id,
                               weights_dict=weights_dict, worker_ids=worker_ids):
            return
        models = update_targets(policy_or_weights, weights=weights, policy=policy, model_id=model_id,
                                weights_dict=weights_dict)
        unknown = sorted(set(models) - {"policy"})
        if unknown:
            raise UnknownModelError(f"model_id {unknown}: a DistributedCollector has only the 'policy' model")
        weights = models["policy"]
        if isinstance(self.config.scheme, NoWeightSyncScheme):
            return
        targets = self._targets(weights, worker_ids)
        with self._guard():
            # A node that fails meanwhile is dropped or relaunched (on_node_failure) and the
            # push is made again: the relaunched node gets these weights when it rejoins.
            self._recovering(lambda: self._push(targets))

    def get_model(self, model_id: str) -> Any:
        """Rank 0's model ``model_id``: only ``"policy"`` (the ``policy`` given) exists here."""
        if model_id != "policy" or self.policy is None:
            raise UnknownModelError(f"model_id {model_id!r}: a DistributedCollector has only the 'policy' model, "
                                    "given as policy= on rank 0")
        return self.policy

    def get_cached_weights(self, model_id: str) -> Any:
        """None: nothing is cached on rank 0 (weights are sent from the source on each update)."""
        return None

    def _targets(self, weights: Any, worker_ids: Any) -> dict[int, Any]:
        n = self.num_nodes
        ids = list(range(n)) if worker_ids is None else [worker_ids] if isinstance(worker_ids, int) else list(worker_ids)
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

    def _push(self, targets: dict[int, Any]) -> None:
        targets = {i: w for i, w in targets.items() if i + 1 not in self._sup.dropped}
        missing = [i for i in targets if self._nodes[i]["weights"] is None]
        if missing:
            raise RuntimeError(f"update_policy_weights_: the policy of nodes {missing} has no parameters or buffers, "
                               "so there are no weights to update (a random policy?)")
        # Pack everything first: weights that do not fit raise before any node is touched.
        packed, cache = {}, {}
        for i, source in targets.items():
            spec = self._nodes[i]["weights"]
            key = (id(source), tuple((k, s, d) for k, (s, d) in spec.items()))
            if key not in cache:
                cache[key] = transport.pack_weights(as_state_dict(source), spec)
            packed[i] = cache[key]
        self._version += 1
        for i, flat in packed.items():
            if self.config.on_node_failure == "restart":
                self._last_packed[i] = (self._version, flat)  # what a relaunched node starts from
            self._node_versions[i] = self._version
            self._since_update[i] = 0
            if self._serving(i):  # a node being relaunched gets them when it rejoins
                self._send_weights(i, self._version, flat)

    def _send_weights(self, i: int, version: int, flat: Any) -> None:
        sup = self._sup
        self._channel.command(i + 1, "weights", version=version, nbytes=flat.numel())
        sends = sup.weight_sends[i]
        try:
            work = sup.pgs[i + 1].send([flat], transport.NODE_IN_PAIR, transport.WEIGHTS_TAG)
        except RuntimeError as err:  # gloo refuses at once on a pair whose peer is gone
            raise sup.lost(i + 1, "while receiving weights", err) from None
        sends.append((version, work))
        if len(sends) > MAX_PENDING_WEIGHTS:
            self._wait_send(i, sends.popleft()[1])

    def _wait_send(self, i: int, work: Any) -> None:
        try:
            transport.wait(work, self.config.timeout)
        except RuntimeError as err:
            raise self._sup.lost(i + 1, "while receiving weights", err) from None

    def worker_policy_versions(self) -> list[int]:
        """The weights version each node acts with (from its next batch on)."""
        return list(self._node_versions)

    @property
    def policy_version(self) -> int:
        return self._version
