"""``RayCollector``: torchrl's Ray collector by name, built as ``DistributedCollector(launcher="ray")``.

torchrl's arguments mapped onto ours:

- ``ray_init_config`` (``ray.init`` kwargs): its ``address`` becomes ``ray_options["address"]``,
  the rest ``ray_options["init_kwargs"]``; used only when Ray is not initialised yet.
- ``remote_configs`` (``ray.remote`` kwargs, one dict or one per collector): ``ray_options``'s
  ``num_cpus``, ``num_gpus``, ``memory``, ``resources``, ``runtime_env``,
  ``scheduling_strategy`` (every collector the same).
- ``num_collectors``: ``num_nodes``.
- ``num_workers_per_collector``, ``collector_class``, ``collector_kwargs``,
  ``update_after_each_batch``, ``max_weight_update_interval``, ``sync``: the same.

The failure semantics are ours, not torchrl's: see docs/ray.md.
"""

from __future__ import annotations

from typing import Any

from rlcollect.distributed.collector import DistributedCollector

#: ``remote_configs`` keys that map onto ``ray_options``.
REMOTE_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "runtime_env", "scheduling_strategy")
#: torchrl arguments accepted for a script's sake and without effect here (None/False: their defaults).
_NO_EFFECT = ("use_env_creator", "no_cuda_sync", "trust_policy")


def ray_options_from_torchrl(ray_init_config: dict | None, remote_configs: dict | list | None,
                             ray_options: dict | None = None) -> dict:
    """``ray_options`` from torchrl's ``ray_init_config`` and ``remote_configs`` (and ours, which win).

    Example:
        >>> ray_options_from_torchrl({"address": "auto", "num_cpus": 8}, {"num_cpus": 2, "memory": 2**30})
        {'address': 'auto', 'init_kwargs': {'num_cpus': 8}, 'num_cpus': 2, 'memory': 1073741824}
    """
    out: dict[str, Any] = {}
    if ray_init_config is not None:
        if not isinstance(ray_init_config, dict):
            raise TypeError(f"ray_init_config must be a dict of ray.init arguments, got "
                            f"{type(ray_init_config).__name__}")
        init = {k: v for k, v in ray_init_config.items() if v is not None}
        if init.get("address") is not None:
            out["address"] = init.pop("address")
        if init:
            out["init_kwargs"] = init
    if remote_configs is not None:
        configs = remote_configs if isinstance(remote_configs, (list, tuple)) else [remote_configs]
        if not all(isinstance(c, dict) for c in configs):
            raise TypeError(f"remote_configs must be a dict of ray.remote options (or a list of them), got "
                            f"{remote_configs!r}")
        if any(c != configs[0] for c in configs):
            raise ValueError("remote_configs: every collector takes the same Ray options here (one ray_options for "
                             f"all nodes), got {list(configs)}")
        config = {k: v for k, v in (configs[0] if configs else {}).items() if v is not None}
        unknown = sorted(set(config) - set(REMOTE_KEYS))
        if unknown:
            raise ValueError(f"remote_configs has key(s) {unknown} with no counterpart here; accepted: {REMOTE_KEYS} "
                             "(actor restarts are the collector's own: on_node_failure='restart')")
        out.update(config)
    out.update(ray_options or {})
    return out


class RayCollector(DistributedCollector):
    """torchrl's ``RayCollector``: a ``DistributedCollector`` whose nodes are Ray actors
    (``launcher="ray"``), taking torchrl's argument names.

    Args:
        create_env_fn: one env constructor (repeated ``num_collectors`` times) or one per node.
        policy: the policy (its weights are rank 0's, sent with ``update_policy_weights_``).
        ray_init_config: ``ray.init`` arguments, used only when Ray is not initialised yet
            (``address``: the cluster; without it ``$RAY_ADDRESS``, else a local instance).
        remote_configs: the actors' ``ray.remote`` options (``num_cpus``, ``num_gpus``,
            ``memory``, ``resources``, ``runtime_env``, ``scheduling_strategy``): one dict, or a
            list of equal ones.
        num_collectors: how many nodes (actors); default: ``len(create_env_fn)`` for a list, else 1.
        ray_options: ours (docs/ray.md), merged over what the two above give.
        **kwargs: every other ``DistributedCollector`` argument (``frames_per_batch``,
            ``total_frames``, ``sync``, ``collector_class``, ``collector_kwargs``,
            ``num_workers_per_collector``, ``update_after_each_batch``,
            ``max_weight_update_interval``, ``on_node_failure``, ...); torchrl's
            ``use_env_creator``, ``no_cuda_sync`` and ``trust_policy`` are accepted and have no
            effect; ``launcher`` other than "ray" is refused.

    Example (needs Ray: ``pip install 'rlcollect[ray]'``)::

        collector = RayCollector(["CartPole-v1"] * 2, frames_per_batch=200, total_frames=1000,
                                 remote_configs={"num_cpus": 1}, ray_init_config={"address": "auto"})
        for batch in collector:
            ...
        collector.shutdown()
    """

    def __init__(self, create_env_fn: Any, policy: Any = None, *, ray_init_config: dict | None = None,
                 remote_configs: dict | list | None = None, num_collectors: int | None = None,
                 ray_options: dict | None = None, **kwargs: Any) -> None:
        for name in _NO_EFFECT:
            kwargs.pop(name, None)
        launcher = kwargs.pop("launcher", "ray")
        if launcher != "ray":
            raise ValueError(f"RayCollector runs launcher='ray', got launcher={launcher!r}")
        if kwargs.get("replay_buffer") is not None:
            raise ValueError("RayCollector: replay_buffer is not supported here; extend your buffer with the batches "
                             "the collector yields")
        kwargs.pop("replay_buffer", None)
        if isinstance(create_env_fn, (list, tuple)):
            if num_collectors is not None and num_collectors != len(create_env_fn):
                raise ValueError(f"num_collectors={num_collectors} does not match the {len(create_env_fn)} env "
                                 "constructors of create_env_fn")
        else:
            create_env_fn = [create_env_fn] * (1 if num_collectors is None else num_collectors)
        options = ray_options_from_torchrl(ray_init_config, remote_configs, ray_options)
        super().__init__(create_env_fn, policy, launcher="ray", ray_options=options, **kwargs)
