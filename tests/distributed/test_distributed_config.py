"""Bad arguments are refused on rank 0 before anything starts, with a message that names the
argument (SPEC 10).  No process is started."""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from dist_helpers import ValuePolicy, counting5
from rlcollect import CountingEnv, DistributedCollector, DistributedWeightSyncScheme, SharedMemWeightSyncScheme


def _make(**kwargs):
    options = {"frames_per_batch": 10}
    options.update(kwargs)
    return DistributedCollector(options.pop("create_env_fn", [counting5] * 2), options.pop("policy", None), **options)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"launcher": "kubernetes"}, ValueError, "launcher must be one of"),
    ({"backend": "mpi"}, ValueError, "backend must be one of"),
    ({"backend": "nccl"}, ValueError, "nccl"),
    ({"frames_per_batch": 0}, ValueError, "frames_per_batch must be a positive int"),
    ({"frames_per_batch": 11, "sync": True}, RuntimeError, "not divisible by the 2 nodes"),
    ({"total_frames": 0}, ValueError, "total_frames"),
    ({"sync": "yes"}, TypeError, "sync must be True or False"),
    ({"collector_class": "threads"}, ValueError, "collector_class"),
    ({"num_workers_per_collector": 2}, ValueError, "num_workers_per_collector=2 needs a multi-process"),
    ({"num_workers_per_collector": 0, "collector_class": "sync"}, ValueError, "num_workers_per_collector"),
    ({"update_after_each_batch": True, "max_weight_update_interval": 2, "policy": ValuePolicy()}, RuntimeError,
     "cannot be used together"),
    ({"max_weight_update_interval": 0}, ValueError, "max_weight_update_interval"),
    ({"update_interval": 0}, ValueError, "update_interval"),
    ({"update_interval": 2}, ValueError, "pass policy="),
    ({"tcp_port": 70000}, ValueError, "tcp_port must be a port number"),
    ({"launcher": "external"}, ValueError, "needs tcp_port"),
    ({"launcher": "submitit_delayed"}, ValueError, "needs tcp_port"),
    ({"master_addr": "0.0.0.0"}, ValueError, "wildcard"),
    ({"master_addr": "no-such-host.invalid"}, ValueError, "cannot resolve"),
    ({"timeout": 0}, ValueError, "timeout must be a positive number"),
    ({"heartbeat_timeout": -1}, ValueError, "heartbeat_timeout"),
    ({"on_node_failure": "ignore"}, ValueError, r"on_node_failure must be one of \('raise', 'continue', 'restart'\)"),
    ({"on_node_failure": "continue", "sync": True}, ValueError, "on_node_failure='continue' needs sync=False"),
    ({"on_node_failure": "restart", "launcher": "external", "tcp_port": 29999}, ValueError,
     r"on_node_failure='restart' needs a launcher that starts the nodes itself \('mp', 'submitit', 'ray'\), got "
     "launcher='external'"),
    ({"on_node_failure": "restart", "max_node_restarts": -1}, ValueError, "max_node_restarts must be an int >= 0"),
    ({"node_timeout": 0}, ValueError, "node_timeout must be a positive number of seconds"),
    ({"weight_sync_schemes": {"policy": SharedMemWeightSyncScheme()}}, ValueError, "DistributedWeightSyncScheme"),
    ({"weight_sync_schemes": {"critic": "distributed"}}, ValueError, "only the 'policy' model"),
    ({"policy": ValuePolicy(), "policy_factory": ValuePolicy}, ValueError, "policy and policy_factory"),
    ({"device": ["cpu"] * 3}, ValueError, "per-node list of length 3, but there are 2 nodes"),
    ({"collector_kwargs": [{}]}, ValueError, "collector_kwargs is a per-node list"),
    ({"collector_kwargs": {"max_frames_per_traj": -3}}, ValueError, "max_frames_per_traj"),
    ({"create_env_fn": []}, ValueError, "empty list"),
    ({"create_env_fn": [counting5], "num_nodes": 2}, ValueError, "num_nodes=2"),
    ({"create_env_fn": [functools.partial(CountingEnv, max_steps=threading.Lock())]}, TypeError, "cannot be pickled"),
])
def test_bad_arguments_are_refused_before_any_node_starts(kwargs, error, match):
    with pytest.raises(error, match=match):
        _make(**kwargs)


def test_a_scheme_with_policy_factory_is_accepted_by_validation():
    from rlcollect.distributed.config import DistributedConfig

    cfg = DistributedConfig(
        [counting5] * 2, ValuePolicy(), num_nodes=None, policy_factory=ValuePolicy, frames_per_batch=10,
        total_frames=-1, devices=dict.fromkeys(("device", "storing_device", "env_device", "policy_device")),
        create_env_kwargs=None, inner_options={}, init_random_frames=None, postproc=None, split_trajs=False,
        collector_class="async", collector_kwargs=[{"num_workers": 3}, {"num_workers": 2}],
        num_workers_per_collector=2, sync=False, slurm_kwargs=None, backend="gloo", update_after_each_batch=False,
        max_weight_update_interval=-1, update_interval=None, launcher="mp", tcp_port=None, master_addr=None,
        timeout=10.0, heartbeat_timeout=5.0, weight_sync_schemes={"policy": DistributedWeightSyncScheme()},
    )
    assert cfg.num_nodes == 2 and cfg.slots == 2 and cfg.master_addr == "127.0.0.1"
    assert len(cfg.payloads) == 2 and cfg.weight_source is not None
    import cloudpickle

    specs = [cloudpickle.loads(p) for p in cfg.payloads]
    # Trajectory-id blocks: node 0's 3 workers take blocks 0-2, node 1's 2 workers blocks 4-5.
    assert [s["kwargs"]["worker_idx"] for s in specs] == [0, 2]
    assert [s["kwargs"]["num_workers"] for s in specs] == [3, 2]
    assert all(s["policy"] is None and s["kwargs"]["policy_factory"] is ValuePolicy for s in specs)
    assert torch.equal(cfg.weight_source.w, torch.zeros(1))


@pytest.mark.parametrize("name", ["start_timeout", "rank0_timeout"])
@pytest.mark.parametrize("value", [0, -1.0, "5", None, True])
def test_liveness_timeouts_are_positive_seconds(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a positive number of seconds"):
        _make(**{name: value})


def test_secret_file_is_checked_before_anything_starts(tmp_path, monkeypatch):
    import os

    from rlcollect.distributed.control.auth import SECRET_ENV, new_secret, write_secret_file

    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = write_secret_file(new_secret(), tmp_path)
    os.chmod(path, 0o640)
    with pytest.raises(ValueError, match=r"secret_file=.*readable by other users.*chmod 600"):
        _make(secret_file=path)
    with pytest.raises(ValueError, match="cannot read the secret file"):
        _make(secret_file=tmp_path / "missing")
    with pytest.raises(TypeError, match="secret_file must be a path"):
        _make(secret_file=123)
    with pytest.raises(ValueError, match="submitit_delayed' needs secret_file=PATH"):
        _make(launcher="submitit_delayed", tcp_port=29999)
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16 are needed"):
        _make(launcher="external", tcp_port=29999)

