"""The Hydra/OmegaConf side: what OmegaConf hands a collector (a ``ListConfig`` of envs) is
taken as the list it is."""

from __future__ import annotations

import pytest

from rlcollect import MultiSyncCollector

pytestmark = pytest.mark.timeout(120)


def test_a_listconfig_of_envs_is_one_env_per_worker():
    omegaconf = pytest.importorskip("omegaconf")

    envs = omegaconf.ListConfig(["CartPole-v1", "CartPole-v1"])
    with MultiSyncCollector(envs, None, frames_per_batch=20, total_frames=20) as c:
        assert c.num_workers == 2
        assert [batch.numel() for batch in c] == [20]
