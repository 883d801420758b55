"""Hydra/OmegaConf structured configs of the collectors, in torchrl's ``_target_`` style.

One dataclass per collector (``MultiSyncCollectorConfig``, ...), made from the collector's
signature when this module is imported, so that a new or renamed argument is a field at once
and no field can drift from what the constructor takes: one field per named argument, with its
default; a required argument defaults to ``"???"`` (OmegaConf's missing value: set it, or
``instantiate`` says which one is missing); a default that is a class (``collector_class``) is
written as a nested ``hydra.utils.get_class`` node that ``instantiate`` turns back into that
class. ``_target_`` is the collector's public path (``rlcollect.MultiSyncCollector``).
``**inner_options`` (options passed on to each worker's ``Collector``) are not fields: a
struct config refuses unknown keys, so give them as ``collector_kwargs``-style fields of your
own config, or construct the collector in code.

:func:`register_configs` stores them in Hydra's ``ConfigStore`` (``pip install
'rlcollect[hydra]'``); the dataclasses themselves need neither Hydra nor OmegaConf. See
docs/configs.md.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

#: The collectors with a config: ``<name>Config`` for each, ``_target_: rlcollect.<name>``.
COLLECTORS = ("Collector", "MultiSyncCollector", "MultiAsyncCollector", "MultiCollector", "AsyncBatchedCollector",
              "DistributedCollector")
#: OmegaConf's missing value: a required field not set yet.
MISSING = "???"
#: The names :func:`register_configs` stores them under, in its group.
STORE_NAMES = {"Collector": "collector", "MultiSyncCollector": "multi_sync", "MultiAsyncCollector": "multi_async",
               "MultiCollector": "multi", "AsyncBatchedCollector": "async_batched",
               "DistributedCollector": "distributed"}
_PLAIN = (type(None), bool, int, float, str)


def _default(collector: str, name: str, value: Any) -> Any:
    """A constructor default as a config value (a field of a frozen-free dataclass)."""
    if value is inspect.Parameter.empty:
        return dataclasses.field(default=MISSING)
    if isinstance(value, _PLAIN):
        return dataclasses.field(default=value)
    if inspect.isclass(value) or inspect.isfunction(value):
        node = {"_target_": "hydra.utils.get_class" if inspect.isclass(value) else "hydra.utils.get_method",
                "path": f"{value.__module__}.{value.__qualname__}"}
        return dataclasses.field(default_factory=lambda: dict(node))
    raise TypeError(f"{collector}({name}=...) has a default that no config can hold: {value!r} "
                    "(rlcollect/configs.py: write it as a node that instantiate builds)")


def config_class(collector: str) -> type:
    """The structured config of ``rlcollect.<collector>``, made from its signature.

    Args:
        collector: the collector's name, one of :data:`COLLECTORS`.

    Example:
        >>> import dataclasses
        >>> config = config_class("MultiSyncCollector")
        >>> config.__name__, config()._target_
        ('MultiSyncCollectorConfig', 'rlcollect.MultiSyncCollector')
        >>> fields = {f.name: f.default for f in dataclasses.fields(config)}
        >>> fields["create_env_fn"], fields["total_frames"], "inner_options" in fields
        ('???', -1, False)
    """
    if collector not in COLLECTORS:
        raise ValueError(f"collector must be one of {COLLECTORS}, got {collector!r}")
    import rlcollect

    signature = inspect.signature(getattr(rlcollect, collector))
    fields: list[tuple[str, Any, Any]] = [
        (name, Any, _default(collector, name, parameter.default))
        for name, parameter in signature.parameters.items()
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
    ]
    fields.append(("_target_", str, dataclasses.field(default=f"rlcollect.{collector}")))
    fields.append(("_partial_", bool, dataclasses.field(default=False)))
    doc = (f"Hydra/OmegaConf structured config of :class:`rlcollect.{collector}`: one field per argument of its "
           f"constructor, with its default (required ones ``'???'``); ``_target_`` is ``rlcollect.{collector}``.")
    return dataclasses.make_dataclass(f"{collector}Config", fields, namespace={"__doc__": doc,
                                                                           "__module__": __name__})


def register_configs(group: str = "collector") -> list[str]:
    """Store every collector's config in Hydra's ``ConfigStore``, in ``group``, under the names
    of :data:`STORE_NAMES` (``collector=multi_sync`` in a defaults list or on the command line).
    Needs ``hydra-core`` (``pip install 'rlcollect[hydra]'``).

    Args:
        group: the config group (default ``"collector"``).

    Returns:
        the stored names.

    Example:
        >>> from hydra import compose, initialize
        >>> names = register_configs()
        >>> with initialize(version_base=None):
        ...     cfg = compose(config_name="rlcollect_collectors", overrides=[
        ...         "+collector=multi_sync", "collector.create_env_fn=[CartPole-v1,CartPole-v1]",
        ...         "collector.frames_per_batch=20", "collector.total_frames=20"])
        >>> cfg.collector._target_, list(cfg.collector.create_env_fn)
        ('rlcollect.MultiSyncCollector', ['CartPole-v1', 'CartPole-v1'])
    """
    try:
        from hydra.core.config_store import ConfigStore
    except ImportError as err:
        raise ImportError("register_configs needs hydra-core, which rlcollect does not install by default: "
                          "pip install 'rlcollect[hydra]' (or pip install hydra-core)") from err
    if not isinstance(group, str) or not group:
        raise ValueError(f"group must be a non-empty string (a config group), got {group!r}")
    store = ConfigStore.instance()
    for collector in COLLECTORS:
        store.store(group=group, name=STORE_NAMES[collector], node=__getattr__(f"{collector}Config"))
    store.store(name="rlcollect_collectors", node={})  # an empty primary config to compose onto
    return [STORE_NAMES[collector] for collector in COLLECTORS]


def __getattr__(name: str) -> Any:
    # The configs are made on first use: making one imports its collector's module (torch).
    if name in globals():
        return globals()[name]
    collector = name[:-len("Config")] if name.endswith("Config") else None
    if collector not in COLLECTORS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    made = globals()[name] = config_class(collector)
    return made


__all__ = ["COLLECTORS", "MISSING", "STORE_NAMES", "config_class", "register_configs",
           *(f"{collector}Config" for collector in COLLECTORS)]
