"""The Hydra/OmegaConf structured configs (rlcollect/configs.py): one field per constructor
argument of every collector, read from the signature; ``instantiate`` builds the collector from
a structured config, from a config composed through the ConfigStore with command-line
overrides, and from a torchrl-style YAML node; what OmegaConf hands a collector (a
``ListConfig`` of envs) is taken as the list it is. torchrl's own ``MultiSyncCollectorConfig``
pointed at rlcollect: tests/torchrl/test_torchrl_hydra.py."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import rlcollect
from rlcollect import MultiSyncCollector

pytestmark = pytest.mark.timeout(180)
omegaconf = pytest.importorskip("omegaconf")
hydra_utils = pytest.importorskip("hydra.utils")

from rlcollect import configs  # noqa: E402  (after the importorskip: the configs test hydra-core)


@pytest.mark.parametrize("name", configs.COLLECTORS)
def test_every_constructor_argument_is_a_field_with_its_default(name):
    config = getattr(configs, f"{name}Config")
    fields = {f.name: f for f in dataclasses.fields(config)}
    parameters = {p.name: p for p in inspect.signature(getattr(rlcollect, name)).parameters.values()
                  if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    assert list(fields) == [*parameters, "_target_", "_partial_"]
    made = config()
    assert made._target_ == f"rlcollect.{name}" and made._partial_ is False
    for key, parameter in parameters.items():
        value = getattr(made, key)
        if parameter.default is inspect.Parameter.empty:
            assert value == "???", key
        elif inspect.isclass(parameter.default):
            assert hydra_utils.instantiate(value) is parameter.default, key
        else:
            assert value == parameter.default, key
    omegaconf.OmegaConf.structured(made)  # every default is one OmegaConf holds


def test_a_structured_config_instantiates_its_collector():
    config = configs.MultiSyncCollectorConfig(create_env_fn=["CartPole-v1"] * 2, frames_per_batch=20, total_frames=40)
    node = omegaconf.OmegaConf.structured(config)
    with pytest.raises(omegaconf.errors.ConfigAttributeError, match="num_thread"):
        node.num_thread = 1  # a typo: the config is a struct
    with hydra_utils.instantiate(node) as collector:
        assert type(collector) is MultiSyncCollector and collector.num_workers == 2
        assert [batch.numel() for batch in collector] == [20, 20]


def test_a_composed_config_with_overrides_instantiates_its_collector():
    from hydra import compose, initialize

    assert configs.register_configs() == ["collector", "multi_sync", "multi_async", "multi", "async_batched",
                                          "distributed"]
    with initialize(version_base=None):
        cfg = compose(config_name="rlcollect_collectors", overrides=[
            "+collector=multi_async", "collector.create_env_fn=CartPole-v1", "collector.num_workers=2",
            "collector.frames_per_batch=10", "collector.total_frames=40"])
    with hydra_utils.instantiate(cfg.collector) as collector:
        assert type(collector).__name__ == "MultiAsyncCollector" and collector.num_workers == 2
        assert sum(batch.numel() for batch in collector) == 40


def test_a_torchrl_style_yaml_node_instantiates_its_collector():
    node = omegaconf.OmegaConf.create("""
    _target_: rlcollect.Collector
    create_env_fn: CartPole-v1
    frames_per_batch: 50
    total_frames: 100
    """)
    collector = hydra_utils.instantiate(node)
    try:
        assert [batch.numel() for batch in collector] == [50, 50]
    finally:
        collector.shutdown()


def test_a_missing_required_field_is_named():
    node = omegaconf.OmegaConf.structured(configs.CollectorConfig(create_env_fn="CartPole-v1"))
    with pytest.raises(omegaconf.errors.MissingMandatoryValue, match="frames_per_batch"):
        hydra_utils.instantiate(node)


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match=r"collector must be one of \('Collector', .*\), got 'Nope'"):
        configs.config_class("Nope")
    with pytest.raises(AttributeError, match="has no attribute 'NopeConfig'"):
        configs.NopeConfig  # noqa: B018
    with pytest.raises(ValueError, match="group must be a non-empty string"):
        configs.register_configs("")


def test_a_listconfig_of_envs_is_one_env_per_worker():
    envs = omegaconf.ListConfig(["CartPole-v1", "CartPole-v1"])
    with MultiSyncCollector(envs, None, frames_per_batch=20, total_frames=20) as c:
        assert c.num_workers == 2
        assert [batch.numel() for batch in c] == [20]


def test_a_single_env_id_is_still_not_a_list():
    # (a str is a Sequence too: it stays one env factory, which needs num_workers)
    with pytest.raises(ValueError, match="num_workers is required when create_env_fn is not a list"):
        MultiSyncCollector("CartPole-v1", None, frames_per_batch=20, total_frames=20)
    with pytest.raises(ValueError, match="create_env_fn is an empty list"):
        MultiSyncCollector(omegaconf.ListConfig([]), None, frames_per_batch=20, total_frames=20)
