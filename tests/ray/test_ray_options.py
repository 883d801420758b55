"""``ray_options`` and the ``ray`` extra, without a Ray cluster: errors name the argument, the
value and what is accepted; Ray is imported only when the launcher is used; without Ray,
``launcher="ray"`` says which extra installs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlcollect import DistributedCollector
from rlcollect.distributed.launch.ray_launcher import check_ray_options, default_master_addr, describe_death


@pytest.mark.parametrize("options, message", [
    ({"cpus": 1}, "ray_options has unknown key(s) ['cpus']; accepted: ("),
    ({"num_cpus": -1}, "ray_options['num_cpus'] must be a non-negative number, got -1"),
    ({"num_gpus": "1"}, "ray_options['num_gpus'] must be a non-negative number, got '1'"),
    ({"memory": 1.5}, "ray_options['memory'] must be a non-negative int, got 1.5"),
    ({"resources": {"CPU": 1}}, "ray_options['resources'] must not hold 'CPU'"),
    ({"placement_group": "spread"}, "ray_options['placement_group'] must be one of ('PACK', 'SPREAD', 'STRICT_PACK', "
                                    "'STRICT_SPREAD') (one bundle per node) or None, got 'spread'"),
    ({"placement_group": "PACK", "scheduling_strategy": "SPREAD"}, "give placement_group or scheduling_strategy"),
    ({"scheduling_strategy": "NODE"}, "ray_options['scheduling_strategy'] must be 'DEFAULT', 'SPREAD' or a Ray"),
    ({"address": ""}, "ray_options['address'] must be a Ray address string"),
])
def test_bad_ray_options_name_key_value_and_accepted(options, message):
    with pytest.raises(ValueError) as info:
        check_ray_options(options, [1, 1])
    assert message in str(info.value)


def test_ray_options_defaults_one_cpu_per_worker():
    assert check_ray_options(None, [1, 3])["num_cpus"] == [1, 3]
    assert check_ray_options({"num_cpus": 0.5}, [1, 3])["num_cpus"] == [0.5, 0.5]
    with pytest.raises(TypeError, match="ray_options must be a dict or None, got list"):
        check_ray_options([], [1])


def test_ray_options_need_the_ray_launcher():
    with pytest.raises(ValueError, match="ray_options is for launcher='ray', got launcher='mp'"):
        DistributedCollector(["CartPole-v1"], frames_per_batch=10, ray_options={"num_cpus": 1})


def test_default_master_addr(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if "ray" not in sys.modules:
        assert default_master_addr({}) == "127.0.0.1"  # a local instance: every node on this host
    assert default_master_addr({"address": "127.0.0.1:6379"}) == "127.0.0.1"  # the interface facing the cluster


def test_death_cause_is_one_line():
    text = ("The actor died unexpectedly before finishing this task.\n\tclass_name: RayNode\n\tpid: 7\nThe actor is "
            "dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: Worker "
            "unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) ...")
    assert describe_death(RuntimeError(text)) == (
        "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
        "Worker unexpectedly exits with a connection error code 2. End of file.")


def test_without_ray_the_launcher_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'rlcollect\[ray\]'"):
        DistributedCollector(["CartPole-v1"], frames_per_batch=10, launcher="ray")


def test_ray_is_imported_only_when_the_launcher_is_used():
    code = ("import sys, rlcollect\n"
            "from rlcollect import Collector, DistributedCollector, MultiSyncCollector\n"
            "import rlcollect.backends\n"
            "import rlcollect.distributed.launch.ray_launcher, rlcollect.distributed.launch.ray_node\n"
            "with DistributedCollector(['CartPole-v1'], frames_per_batch=10, total_frames=10) as c:\n"
            "    list(c)\n"
            "with Collector('CartPole-v1', frames_per_batch=10, total_frames=10) as c:\n"
            "    list(c)\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_torchrl_ray_arguments_map_onto_ray_options():
    from rlcollect.distributed.ray_collector import ray_options_from_torchrl

    assert ray_options_from_torchrl({"address": "10.0.0.1:6379", "num_cpus": None, "namespace": "rl"},
                                    [{"num_cpus": 2, "num_gpus": None}] * 3, {"placement_group": "SPREAD"}) == {
        "address": "10.0.0.1:6379", "init_kwargs": {"namespace": "rl"}, "num_cpus": 2, "placement_group": "SPREAD"}
    assert ray_options_from_torchrl(None, None) == {}
    with pytest.raises(ValueError, match=r"remote_configs has key\(s\) \['max_restarts'\] with no counterpart here"):
        ray_options_from_torchrl(None, {"max_restarts": 3})
    with pytest.raises(ValueError, match="every collector takes the same Ray options here"):
        ray_options_from_torchrl(None, [{"num_cpus": 1}, {"num_cpus": 2}])
    with pytest.raises(TypeError, match="ray_init_config must be a dict of ray.init arguments, got list"):
        ray_options_from_torchrl([], None)


def test_ray_collector_refuses_another_launcher_and_a_replay_buffer():
    from rlcollect import RayCollector

    with pytest.raises(ValueError, match="RayCollector runs launcher='ray', got launcher='mp'"):
        RayCollector("CartPole-v1", frames_per_batch=10, launcher="mp")
    with pytest.raises(ValueError, match="replay_buffer is not supported here"):
        RayCollector("CartPole-v1", frames_per_batch=10, replay_buffer=object())
    with pytest.raises(ValueError, match="num_collectors=3 does not match the 2 env constructors"):
        RayCollector(["CartPole-v1"] * 2, frames_per_batch=10, num_collectors=3)
