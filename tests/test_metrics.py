"""The measurements behind stats() (rlcollect/metrics.py), ``Collector.stats()``, the
TensorBoard hook (rlcollect/tensorboard.py) and ``rlcollect collect --tensorboard DIR``."""

from __future__ import annotations

import doctest
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from rlcollect import Collector, CountingEnv, SleepEnv, cli
from rlcollect.metrics import BatchClock, StepTimes, batch_meta, merge_meta, policy_lag

pytestmark = pytest.mark.timeout(120)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
STEP_S = 0.002
SLOW = 20


class SkewedSleepEnv(SleepEnv):
    """Sleeps ``STEP_S``, and ``SLOW * STEP_S`` every 10th step (so the p95 is a slow step)."""

    def step_rows(self, action, obs_out, reward, terminated, truncated) -> None:
        self._calls = getattr(self, "_calls", 0) + 1
        time.sleep(self.step_time * (SLOW if self._calls % 10 == 0 else 1))
        self._advance(obs_out, reward, terminated, truncated)


def scalars_in(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# -- the pieces ----------------------------------------------------------------------------------
def test_step_times_keep_the_last_window_and_give_a_nearest_rank_p95():
    times = StepTimes(size=20)
    assert times.summary() == (None, None)
    times.add(np.arange(1.0, 11.0))  # 1..10
    assert times.summary() == (5.5, 10.0)
    times.add(np.arange(11.0, 36.0))  # 25 more: the window holds 16..35
    assert times.summary() == (25.5, 34.0)  # ceil(0.95 * 20) = 19th smallest
    times.add([100.0, 200.0])  # wraps around: 18..35, 100, 200
    mean, p95 = times.summary()
    assert mean == pytest.approx((sum(range(18, 36)) + 300) / 20) and p95 == 100.0
    times.add([])
    assert times.summary()[1] == 100.0


def test_policy_lag_is_frame_weighted_and_ignores_empty_parts():
    parts = [batch_meta(4, 3, 3.0, (None, None)), batch_meta(12, 1, 1.5, (None, None)),
             batch_meta(0, 0, 0.0, (None, None))]
    assert policy_lag(3, parts) == (3 - (4 * 3 + 12 * 1.5) / 16, 2)
    assert policy_lag(5, [batch_meta(0, 0, 0.0, (None, None))]) == (0.0, 0)


def test_merge_meta_combines_versions_and_latency():
    merged = merge_meta([batch_meta(2, 1, 1.0, (0.1, 0.3)), batch_meta(6, 2, 2.5, (0.2, 0.5)),
                         batch_meta(3, 0, 0.0, (None, None))])
    assert merged == {"frames": 11, "version_min": 0, "version_mean": (2 * 1.0 + 6 * 2.5) / 11,
                      "step_mean_s": pytest.approx(0.15), "step_p95_s": 0.5}


def test_batch_clock():
    clock = BatchClock()
    clock.add(0.5)
    clock.add(0.25)
    assert (clock.last_s, clock.total_s) == (0.25, 0.75)


@pytest.mark.parametrize("module", ["rlcollect.metrics", "rlcollect.loggers.base"])
def test_docstring_examples(module):
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


# -- Collector --------------------------------------------------------------------------------------
def test_collector_measures_its_env_steps():
    c = Collector(SkewedSleepEnv(step_time=STEP_S, obs_dim=1), frames_per_batch=50, total_frames=100)
    assert c.stats()["workers"][0]["env_step_mean_s"] is None
    list(c)
    worker = c.stats()["workers"][0]
    mean, p95 = worker["env_step_mean_s"], worker["env_step_p95_s"]
    assert mean >= (0.9 + 0.1 * SLOW) * STEP_S  # every step sleeps, one in ten SLOW times longer
    assert p95 >= SLOW * STEP_S and p95 >= mean
    c.shutdown()


def test_collector_keys_lag_and_wait():
    c = Collector(CountingEnv, frames_per_batch=4, total_frames=8, track_policy_version=True)
    list(c)
    s = json.loads(json.dumps(c.stats()))
    assert list(s) == ["frames", "batches", "elapsed_s", "fps", "fps_steady", "fps_recent", "policy_version", "workers",
                       "restarts", "dropped_frames", "collected_frames", "delivered_frames", "lag_dropped_frames",
                       "lost_batches", "replay_buffer_write_count", "policy_lag_mean",
                       "policy_lag_max", "mean_policy_lag", "batch_wait_s", "wait_s",
                       "total_frames", "completed", "requested_frames_per_batch", "workers_alive"]  # torchrl 0.14's
    assert (s["total_frames"], s["completed"], s["requested_frames_per_batch"], s["workers_alive"]) == (8, True, 4, 1)
    assert list(s["workers"][0]) == ["index", "frames", "alive", "restarts", "policy_version", "env_step_mean_s",
                                     "env_step_p95_s", "lag_dropped_frames", "lost_batches"]
    assert (s["collected_frames"], s["delivered_frames"], s["lag_dropped_frames"], s["lost_batches"]) == (8, 8, 0, 0)
    # one process: the batch is always collected with the current weights, nothing is waited on
    assert (s["policy_lag_mean"], s["policy_lag_max"], s["batch_wait_s"], s["wait_s"]) == (0.0, 0, 0.0, 0.0)
    c.shutdown()


BOOKS = ("collected_frames", "delivered_frames", "dropped_frames", "lag_dropped_frames", "lost_batches", "restarts")


@pytest.mark.timeout(120)
def test_every_collector_keeps_the_same_books():
    """collected, delivered, dropped (preemptive, lag), lost, restarted: the same keys on the
    single-process and both multi-process collectors, per collector and per worker."""
    from rlcollect import MultiAsyncCollector, MultiSyncCollector

    made = [Collector(CountingEnv, frames_per_batch=4, total_frames=8),
            MultiSyncCollector(CountingEnv, num_workers=2, frames_per_batch=4, total_frames=8),
            MultiAsyncCollector(CountingEnv, num_workers=2, frames_per_batch=4, total_frames=8)]
    try:
        for c in made:
            list(c)
            s = c.stats()
            assert [s[k] for k in BOOKS] == [8, 8, 0, 0, 0, 0], type(c).__name__
            for w in s["workers"]:
                assert (w["lag_dropped_frames"], w["lost_batches"], w["restarts"]) == (0, 0, 0)
    finally:
        for c in made:
            c.shutdown()


# -- TensorBoard ------------------------------------------------------------------------------------
def test_tensorboard_logger_writes_the_stats(tmp_path):
    from rlcollect import TensorBoardLogger

    c = Collector(CountingEnv, frames_per_batch=10, total_frames=30)
    written = []
    with TensorBoardLogger(tmp_path) as tb:
        for _ in c:
            written.append(tb.log(c))
        tb.log({"frames": 99, "policy_lag_mean": 0.5, "workers": []}, step=7)
    c.shutdown()
    back = scalars_in(tmp_path)
    assert back["collector/frames"] == [(10, 10.0), (20, 20.0), (30, 30.0), (7, 99.0)]
    assert back["collector/policy_lag_mean"][-1] == (7, 0.5)
    assert [v for _, v in back["collector/worker0/env_step_p95_s"]] == pytest.approx(
        [w["collector/worker0/env_step_p95_s"] for w in written])
    assert "collector/worker0/alive" in back and "collector/wait_s" in back


def test_tensorboard_logger_checks_its_arguments(tmp_path):
    from rlcollect import TensorBoardLogger

    with pytest.raises(TypeError, match="log_dir must be a folder path"):
        TensorBoardLogger(None)
    with pytest.raises(ValueError, match="prefix must be a non-empty string"):
        TensorBoardLogger(tmp_path, prefix="")
    with TensorBoardLogger(tmp_path) as tb:
        with pytest.raises(TypeError, match="a collector .* or a stats\\(\\) dict"):
            tb.log(42)
        with pytest.raises(TypeError, match="step must be an int"):
            tb.log({"frames": 1}, step=1.5)


def test_missing_tensorboard_names_the_extra(tmp_path, monkeypatch):
    from rlcollect import TensorBoardLogger

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'rlcollect\[tensorboard\]'"):
        TensorBoardLogger(tmp_path)
    code = None
    with pytest.raises(SystemExit) as exit_info:
        code = cli.main(["collect", "--frames", "10", "--tensorboard", str(tmp_path / "tb")])
    assert code is None and exit_info.value.code == 2


def test_cli_collect_writes_tensorboard(tmp_path, capsys):
    log_dir = tmp_path / "tb"
    assert cli.main(["collect", "--frames", "600", "--frames-per-batch", "200", "--workers", "2",
                     "--no-progress", "--tensorboard", str(log_dir)]) == 0
    assert f"tensorboard          {log_dir}" in capsys.readouterr().out
    back = scalars_in(log_dir)
    assert back["collector/frames"] == [(200, 200.0), (400, 400.0), (600, 600.0)]
    assert [v for _, v in back["collector/batches"]] == [1.0, 2.0, 3.0]
    assert {f"collector/worker{i}/env_step_p95_s" for i in (0, 1)} <= set(back)
    assert all(v > 0 for _, v in back["collector/wait_s"])


@pytest.mark.parametrize("multi", [False, True], ids=["Collector", "MultiSyncCollector"])
def test_fps_steady_counts_from_the_first_batch(multi):
    # None until a second batch exists; then the frames after the first batch over the time
    # since it (start-up left out), which the first batch's frames do not enter.
    from rlcollect import MultiSyncCollector

    c = (MultiSyncCollector([CountingEnv] * 2, None, frames_per_batch=20, total_frames=60) if multi
         else Collector(CountingEnv, frames_per_batch=20, total_frames=60))
    try:
        it = iter(c)
        next(it)
        first = c.stats()
        assert first["fps_steady"] is None and first["fps"] > 0
        next(it)
        next(it)
        s = c.stats()
        assert isinstance(s["fps_steady"], float) and s["fps_steady"] > 0
        # 40 frames after the first batch, in less time than the whole run's 60: the steady
        # figure is 40 / (elapsed - first batch's time), so it is at least 40 / elapsed.
        assert s["fps_steady"] >= 40 / s["elapsed_s"]
    finally:
        c.shutdown()
