"""torchrl 0.14's collector API on rlcollect, each item side by side with torchrl 0.14's own
collector on the same seeded env (issue 28): policy versions, collect hooks,
``requested_frames_per_batch``, MultiAsync ``init_random_frames``, the literal defaults of
torchrl's signatures, ``iterator()`` / ``receive_weights()``.

Runs in ``.venv-torchrl`` (``make test-torchrl``); skipped where torchrl is not installed.
"""

from __future__ import annotations


import pytest

pytest.importorskip("torchrl.collectors")

import torch  # noqa: E402
from torchrl import collectors as trc  # noqa: E402

import rlcollect  # noqa: E402

from helpers_torchrl import cartpole, serial_cartpole, zero_policy  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def run(collector, between=None) -> list:
    """Every batch (cloned); ``between(collector)`` after each."""
    out = []
    try:
        for batch in collector:
            out.append(batch.clone())
            if between is not None:
                between(collector)
    finally:
        collector.shutdown()
    return out


# -- policy versions: root and ("next", ...) as torchrl's PolicyVersion transform writes them -----------
def test_policy_versions_match_torchrls():
    runs = {}
    for name, cls in (("torchrl", trc.Collector), ("ours", rlcollect.Collector)):
        env = cartpole()
        env.set_seed(0)
        c = cls(env, zero_policy(), frames_per_batch=30, total_frames=90, track_policy_version=True)
        runs[name] = run(c, between=lambda c: c.increment_version())
    for theirs, ours in zip(runs["torchrl"], runs["ours"], strict=True):
        for key in ("policy_version", ("next", "policy_version")):
            assert ours[key].dtype == theirs[key].dtype == torch.int64
            assert ours[key].tolist() == theirs[key].tolist()
        assert ours["collector", "policy_version"].tolist() == ours["next", "policy_version"].tolist()
    assert runs["ours"][1]["policy_version"][:2].tolist() == [0, 1]  # the step before acted with version 0


# -- collect hooks ---------------------------------------------------------------------------------------
def _hooked(cls, **kwargs):
    calls = []
    c = cls(cartpole(), zero_policy(), frames_per_batch=20, total_frames=60,
            postproc=lambda b: b.set("seen", b["action"]), pre_collect_hook=lambda: calls.append("pre"), **kwargs)
    c.post_collect_hook = lambda b: calls.append(("post", b.numel(), "seen" in b.keys()))
    return c, calls


def test_collect_hooks_are_called_as_torchrl_calls_them():
    results = {}
    for name, cls in (("torchrl", trc.Collector), ("ours", rlcollect.Collector)):
        c, calls = _hooked(cls)
        run(c)
        results[name] = calls
    assert results["ours"] == results["torchrl"] == ["pre", ("post", 20, True)] * 3


def test_set_post_collect_hook_and_clearing():
    c = rlcollect.Collector(cartpole(), zero_policy(), frames_per_batch=10, total_frames=30)
    seen = []
    c.set_post_collect_hook(lambda b: seen.append(b.numel()))
    it = iter(c)
    next(it)
    c.post_collect_hook = None
    next(it)
    c.shutdown()
    assert seen == [10] and c.post_collect_hook is None
    with pytest.raises(TypeError, match="post_collect_hook must be a callable or None"):
        c.post_collect_hook = 3


def test_collect_hooks_of_multiprocess_collectors_run_per_delivered_batch():
    calls = []  # (the hooks live in CollectorBase: one multi-process collector shows it)
    c = rlcollect.MultiAsyncCollector([cartpole, cartpole], zero_policy(), frames_per_batch=20, total_frames=80,
            pre_collect_hook=lambda: calls.append("pre"))
    c.set_post_collect_hook(lambda b: calls.append(b.numel()))
    run(c)
    assert calls == ["pre", 20] * 4


# -- requested_frames_per_batch and MultiAsync init_random_frames -------------------------------------
def test_multiasync_requested_frames_and_init_random_frames_like_torchrl():
    """(torchrl's collectors start slowly: one run each checks both.)"""
    kinds, requested, init_random_frames = {}, {}, 100
    for cls in (trc.MultiAsyncCollector, rlcollect.MultiAsyncCollector):
        c = cls([cartpole, cartpole], zero_policy(), frames_per_batch=50, total_frames=400,
                init_random_frames=init_random_frames)
        requested[cls.__module__] = c.requested_frames_per_batch
        kinds[cls.__module__] = "".join("R" if b["action"].any() else "P" for b in run(c))
    assert list(requested.values()) == [50, 50]  # one worker's batch, not the workers' sum
    theirs, ours = kinds.values()
    random = 1 + init_random_frames // 50  # both workers' first batches, then one per batch delivered below the mark
    assert theirs.count("R") == ours.count("R") == random and len(theirs) == len(ours) == 8
    # torchrl may deliver a random batch after a policy batch (a worker's random rollout arriving
    # late); ours never does (documented).
    assert ours == "R" * random + "P" * (8 - random)


# -- torchrl's literal defaults, iterator(), receive_weights(), enable_profile ---------------------------
def counted_cartpole():
    from torchrl.envs import StepCounter, TransformedEnv

    return TransformedEnv(cartpole(), StepCounter())


def _keys(cls, **kwargs) -> set:
    env = counted_cartpole()
    env.set_seed(0)
    c = cls(env, zero_policy(), frames_per_batch=10, total_frames=10, **kwargs)
    try:
        batch = next(c.iterator())
        c.receive_weights()
        return {str(k) for k in batch.keys(True, True)}
    finally:
        c.shutdown()


@pytest.mark.parametrize("options", [{"use_buffers": None, "weight_recv_schemes": None}, {"track_traj_ids": False},
                                     {"compact_obs": True}], ids=["literal-defaults", "no-traj-ids", "compact-obs"])
def test_single_collector_options_give_torchrls_keys(options):
    theirs, ours = _keys(trc.Collector, **options), _keys(rlcollect.Collector, **options)
    assert ours == theirs
    if "track_traj_ids" in options:
        assert "('collector', 'traj_ids')" not in ours
    if "compact_obs" in options:
        assert "('next', 'observation')" not in ours and "('next', 'reward')" in ours


def test_multisync_takes_torchrls_literal_defaults_and_face_options():
    c = rlcollect.MultiSyncCollector([counted_cartpole, counted_cartpole], zero_policy(), frames_per_batch=20,
                                     total_frames=20, collector_class=None, use_buffers=None, weight_recv_schemes=None,
                                     compact_obs=True, track_traj_ids=False)
    (batch,) = run(c)
    keys = {str(k) for k in batch.keys(True, True)}
    assert "('next', 'observation')" not in keys and "('collector', 'traj_ids')" not in keys
    assert batch.shape == (2, 10)


def test_refused_values_say_what_is_accepted():
    with pytest.raises(ValueError, match="weight_recv_schemes=.* is not supported"):
        rlcollect.Collector(cartpole(), frames_per_batch=10, weight_recv_schemes={"policy": object()})
    with pytest.raises(ValueError, match="split_trajs=True needs the trajectory ids"):
        rlcollect.Collector(cartpole(), frames_per_batch=10, split_trajs=True, track_traj_ids=False)
    c = rlcollect.Collector(cartpole(), frames_per_batch=10)
    with pytest.raises(TypeError, match="enable_profile got unexpected arguments \\['bogus'\\]"):
        c.enable_profile(bogus=1)
    c.shutdown()


def test_enable_profile_with_torchrls_arguments_writes_a_trace(tmp_path):
    c = rlcollect.Collector(cartpole(), zero_policy(), frames_per_batch=10, total_frames=30)
    c.enable_profile(workers=[0], num_rollouts=2, warmup_rollouts=1, save_path=str(tmp_path / "trace.json"),
                     activities=["cpu"], record_shapes=False)
    run(c)
    assert (tmp_path / "trace.json").stat().st_size > 0


# -- torchrl's face: BaseCollector, stats() keys, init_random_frames ------------------------------------
def test_our_collectors_are_torchrl_base_collectors():
    c = rlcollect.Collector(cartpole(), frames_per_batch=10, total_frames=10, init_random_frames=None)
    try:
        assert isinstance(c, trc.BaseCollector)
        assert issubclass(rlcollect.MultiAsyncCollector, trc.BaseCollector)
        assert c.init_random_frames == 0  # torchrl's Trainer reads it
    finally:
        c.shutdown()


def test_stats_have_torchrls_keys_with_torchrls_values():
    stats = {}
    for cls in (trc.Collector, rlcollect.Collector):
        c = cls(cartpole(), zero_policy(), frames_per_batch=10, total_frames=20)
        run(c)
        stats[cls.__module__] = c.stats()
    theirs, ours = stats.values()
    assert set(theirs) <= set(ours)
    assert {k: ours[k] for k in theirs} == theirs == {"frames": 20, "batches": 2, "total_frames": 20, "completed": True,
                                                       "requested_frames_per_batch": 10}


# -- the unified constructor ---------------------------------------------------------------------------
def test_num_collectors_alone_builds_torchrls_class():
    """torchrl 0.14.1's ``Collector(env, None, frames_per_batch=20, num_collectors=2)`` is a
    ``MultiAsyncCollector`` ("process" inferred, async by default; checked by hand: starting
    torchrl's workers here would cost the CI a minute)."""
    c = rlcollect.Collector(cartpole, None, frames_per_batch=20, total_frames=40, num_collectors=2)
    try:
        assert type(c).__name__ == "MultiAsyncCollector" and c.num_workers == 2
    finally:
        c.shutdown()


# -- DistributedCollector: collector_kwargs={"postproc": f}, state_dict() with torchrl envs on the nodes --
def mark(batch):
    return batch.set("marked", torch.ones(batch.shape, dtype=torch.bool))


@pytest.mark.filterwarnings("ignore:rlcollect. env TransformedEnv does not expose")
def test_distributed_node_postproc_and_state_dict_with_torchrl_envs():
    """(one run: a distributed collector starts slowly)"""
    c = rlcollect.DistributedCollector([counted_cartpole, counted_cartpole], zero_policy(), frames_per_batch=20,
                                       total_frames=None, collector_kwargs={"postproc": mark}, timeout=120.0)
    try:
        it = iter(c)
        assert next(it)["marked"].all()
        state = c.state_dict()
        assert sorted(state) == ["frames", "iter", "node0", "node1", "policy_version"]
        c.load_state_dict(state)
        batch = next(iter(c))
        assert batch.shape == (20,) and batch["marked"].all()
    finally:
        c.shutdown()
    with pytest.raises(ValueError, match=r"collector_kwargs\['postproc'\] with sync=True"):
        rlcollect.DistributedCollector([cartpole, cartpole], frames_per_batch=20, sync=True,
                                       collector_kwargs={"postproc": mark})
    with pytest.raises(ValueError, match=r"collector_kwargs\['postproc'\] is not applied"):
        rlcollect.MultiSyncCollector([cartpole, cartpole], frames_per_batch=20, collector_kwargs={"postproc": mark})


# -- MultiSyncCollector, a batched env, split_trajs=True ---------------------------------------------------
def test_multisync_batched_env_split_trajs_keeps_torchrls_shape():
    """torchrl 0.14.1 gives (2, 2, 5) here (each row one whole trajectory: its split_trajectories
    keeps the shape; checked by hand, its workers start slowly)."""
    c = rlcollect.MultiSyncCollector([serial_cartpole, serial_cartpole], zero_policy(), frames_per_batch=20,
                                     total_frames=20, split_trajs=True)
    (batch,) = run(c)
    assert batch.shape == (2, 2, 5) and batch["collector", "mask"].all()


# -- examples/torchrl014_port.py: a torchrl 0.14 script, the diff is its import line --------------------
def test_ported_torchrl_014_script_prints_what_torchrl_prints(tmp_path, capsys):
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent.parent / "examples" / "torchrl014_port.py"
    ours_line = "from rlcollect import Collector  # torchrl 0.14: from torchrl.collectors import Collector"
    text = script.read_text()
    assert text.count(ours_line) == 1
    theirs = tmp_path / "theirs.py"
    theirs.write_text(text.replace(ours_line, "from torchrl.collectors import Collector"))
    outputs = []
    for path in (script, theirs):
        runpy.run_path(str(path), run_name="__main__")
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert "hooks: ['start', 50, 'start', 50, 'start', 50]" in outputs[0]


def test_multiprocess_collectors_take_torchrls_other_defaults():
    defaults = {"auto_register_policy_transforms": None, "init_fn": None, "trajs_per_batch": None,
                "trajs_per_write": None, "traj_format": None}
    c = rlcollect.MultiAsyncCollector([cartpole], zero_policy(), frames_per_batch=10, total_frames=10, **defaults)
    assert [b.shape for b in run(c)] == [(10,)]
    with pytest.raises(TypeError, match="init_fn must be a callable taking no argument, or None, got int"):
        rlcollect.MultiSyncCollector([cartpole], frames_per_batch=10, init_fn=3)


# -- torchrl's Trainer drives our collector ---------------------------------------------------------------
def test_torchrl_trainer_with_a_dqn_loss_trains_on_our_collector():
    from torchrl.modules import MLP, QValueActor
    from torchrl.objectives import DQNLoss
    from torchrl.trainers import Trainer

    torch.manual_seed(0)
    spec = cartpole().action_spec
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"], spec=spec)
    loss = DQNLoss(actor, action_space=spec)
    c = rlcollect.Collector(cartpole(), actor, frames_per_batch=50, total_frames=150, init_random_frames=50)
    before = [p.detach().clone() for p in loss.parameters()]
    try:
        trainer = Trainer(collector=c, total_frames=150, frame_skip=1, optim_steps_per_batch=1, loss_module=loss,
                          optimizer=torch.optim.Adam(loss.parameters(), 1e-3), progress_bar=False)
        trainer.train()
        assert c.stats()["frames"] == 150 and c.init_random_frames == 50
    finally:
        c.shutdown()
    assert any(not torch.equal(b, p) for b, p in zip(before, loss.parameters()))
