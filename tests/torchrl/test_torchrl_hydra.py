"""torchrl's own Hydra configs with ``_target_`` pointed at rlcollect: torchrl 0.14's
``MultiSyncCollectorConfig`` / ``MultiAsyncCollectorConfig`` (every torchrl argument a field,
its env list a ``ListConfig`` of torchrl ``GymEnvConfig`` partials) instantiate rlcollect's
collectors, which collect from those torchrl envs.

Runs in ``.venv-torchrl`` (``make test-torchrl``, with the ``hydra`` extra); skipped where
torchrl or hydra-core is not installed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchrl.collectors")
pytest.importorskip("hydra")

from hydra.utils import instantiate  # noqa: E402
from omegaconf import ListConfig, OmegaConf  # noqa: E402
from torchrl.trainers.algorithms.configs import collectors as torchrl_configs  # noqa: E402
from torchrl.trainers.algorithms.configs.envs_libs import GymEnvConfig  # noqa: E402

import rlcollect  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("name", ["MultiSyncCollector", "MultiAsyncCollector"])
def test_torchrls_config_with_an_rlcollect_target_builds_our_collector(name):
    config = getattr(torchrl_configs, f"{name}Config")(
        create_env_fn=[GymEnvConfig(env_name="CartPole-v1"), GymEnvConfig(env_name="CartPole-v1")],
        frames_per_batch=20, total_frames=40, _target_=f"rlcollect.{name}")
    node = OmegaConf.structured(config)
    assert isinstance(node.create_env_fn, ListConfig)  # what instantiate hands the collector
    collector = instantiate(node)
    try:
        assert type(collector) is getattr(rlcollect, name) and collector.num_workers == 2
        batches = list(collector)
        assert sum(batch.numel() for batch in batches) == 40
        assert ("next", "observation") in batches[0].keys(True)
    finally:
        collector.shutdown()
