"""The loggers (rlcollect/loggers/): one interface (``StatsLogger``: ``log``, ``watch``,
``close``) and its three backends, each written for real and read back: TensorBoard event files,
a Weights & Biases offline run, an MLflow file store. Attached to a collector iterated, one
running free (``start()``) and a ``DistributedCollector``."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from rlcollect import Collector, CountingEnv, DistributedCollector, MLflowLogger, ReplayBuffer, StatsLogger, \
    TensorBoardLogger, WandbLogger

pytestmark = [pytest.mark.timeout(180), pytest.mark.processes]  # wandb runs its wandb-core service


class ListLogger(StatsLogger):
    """Keeps every point written (the interface with nothing behind it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.points: list[tuple[int, dict[str, float]]] = []
        self.closed = 0

    def write(self, values, step):
        self.points.append((step, values))

    def close(self):
        self.closed += 1


# -- reading each backend's files back ---------------------------------------------------------------
def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


WANDB_BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of chunked records


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of an offline run's ``run-<id>.wandb`` file. Call it once the program
    that wrote the run has ended, or after ``wandb.teardown()``: ``finish()`` may return before
    wandb-core has written the file's last records."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:7])[0] == b":W&B"
    rows, pos, chunks = [], 7, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):  # the padding at a block's end
            pos += left
            continue
        chunks += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path
    wandb.teardown()  # stops wandb-core, the service process wandb.init started


@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this flag
    return "file://" + str(tmp_path / "mlruns")


def mlflow_metric(store: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return [(m.step, m.value) for m in MlflowClient(store).get_metric_history(run_id, key)]


# -- the interface ----------------------------------------------------------------------------------
def test_log_takes_a_collector_or_a_stats_dict_with_the_frames_as_default_step():
    c = Collector(CountingEnv, frames_per_batch=10, total_frames=20)
    with ListLogger(prefix="c") as logger:
        for _ in c:
            logger.log(c)
        logger.log({"frames": 99, "policy_lag_mean": 0.5, "launcher": "mp", "fps_steady": None, "workers": []}, step=7)
    c.shutdown()
    assert [step for step, _ in logger.points] == [10, 20, 7]
    assert logger.points[1][1]["c/frames"] == 20.0 and logger.points[1][1]["c/worker0/alive"] == 1.0
    assert logger.points[2][1] == {"c/frames": 99.0, "c/policy_lag_mean": 0.5}
    assert logger.closed == 1


def test_the_interface_checks_its_arguments():
    logger = ListLogger()
    with pytest.raises(ValueError, match="prefix must be a non-empty string, got ''"):
        ListLogger(prefix="")
    with pytest.raises(TypeError, match=r"log\(\) takes a collector \(anything with stats\(\)\) or a stats\(\) dict, "
                                        "got int"):
        logger.log(42)
    with pytest.raises(TypeError, match="step must be an int .*, got 1.5"):
        logger.log({"frames": 1}, step=1.5)
    with pytest.raises(ValueError, match="every_s must be a positive number of seconds, got 0"):
        logger.watch(Collector(CountingEnv, frames_per_batch=10, total_frames=10), every_s=0)
    with pytest.raises(TypeError, match=r"watch\(\) takes a collector \(anything with stats\(\)\), got dict"):
        logger.watch({}, every_s=1)


def test_watch_logs_a_collector_running_free():
    rb = ReplayBuffer(10_000)
    c = Collector(CountingEnv, frames_per_batch=10, replay_buffer=rb)
    logger = ListLogger()
    try:
        c.start()
        watcher = logger.watch(c, every_s=0.01)
        while len(logger.points) < 3:  # the thread's points, while collection runs
            with c.pause():
                pass
        with c.pause():  # no frame is written in this block
            watcher.stop()
            frames = c.stats()["frames"]
            assert not watcher.running
            watcher.stop()  # idempotent: no second last point
    finally:
        c.async_shutdown()
        rb.close()
    steps = [step for step, _ in logger.points]
    assert steps == sorted(steps) and steps[-1] == frames > 0
    assert all(step % 10 == 0 for step in steps)
    assert all(values["collector/frames"] == step for step, values in logger.points)


def test_watch_reraises_what_stopped_it():
    class Broken:
        def stats(self):
            raise RuntimeError("stats failed")

    watcher = ListLogger().watch(Broken(), every_s=0.01)
    watcher._thread.join(10)  # noqa: SLF001  (the thread stops at the first error)
    with pytest.raises(RuntimeError, match="stats failed"):
        watcher.stop()


def test_the_old_tensorboard_path_is_the_same_logger():
    import rlcollect.tensorboard as old
    from rlcollect.loggers import scalars

    assert old.TensorBoardLogger is TensorBoardLogger and old.scalars is scalars
    assert issubclass(TensorBoardLogger, StatsLogger) and issubclass(WandbLogger, StatsLogger)
    assert issubclass(MLflowLogger, StatsLogger)


# -- the three backends, read back ----------------------------------------------------------------------
def test_the_three_backends_write_the_same_scalars(tmp_path, wandb_offline, mlflow_store):
    import wandb

    c = Collector(CountingEnv, frames_per_batch=10, total_frames=30)
    tb = TensorBoardLogger(tmp_path / "tb")
    wb = WandbLogger("rlcollect-test", name="three")
    ml = MLflowLogger("rlcollect-test", tracking_uri=mlflow_store, run_name="three")
    written = []
    with tb, wb, ml:
        for _ in c:
            stats = c.stats()
            written.append(tb.log(stats))
            assert wb.log(stats) == ml.log(stats) == written[-1]
    c.shutdown()
    wandb.teardown()
    tags = set().union(*written)  # fps_steady is known from the second batch on
    assert {"collector/frames", "collector/fps_steady", "collector/worker0/env_step_p95_s"} <= tags

    frames = [(10, 10.0), (20, 20.0), (30, 30.0)]
    assert tensorboard_scalars(tmp_path / "tb")["collector/frames"] == frames
    assert set(tensorboard_scalars(tmp_path / "tb")) == tags

    (run_dir,) = (wandb_offline / "wandb").glob("offline-run-*")
    rows = wandb_history(run_dir)
    assert [(row["collector/step"], row["collector/frames"]) for row in rows] == frames
    assert [set(row) - {"_step", "_runtime", "_timestamp", "collector/step"} for row in rows] == [
        set(w) for w in written]

    assert mlflow_metric(mlflow_store, ml.run_id, "collector/frames") == frames
    p95 = [(step, pytest.approx(values["collector/worker0/env_step_p95_s"]))
           for step, values in zip((10, 20, 30), written)]
    assert mlflow_metric(mlflow_store, ml.run_id, "collector/worker0/env_step_p95_s") == p95
    assert ml.client.get_run(ml.run_id).info.status == "FINISHED"


def test_loggers_write_into_a_run_you_started(wandb_offline, mlflow_store):
    import wandb
    from mlflow.tracking import MlflowClient

    run = wandb.init(project="rlcollect-test", name="mine")
    with WandbLogger(run=run) as wb:
        wb.log({"frames": 5, "workers": []})
        run.log({"train/loss": 0.5})
    assert not run._is_finished  # noqa: SLF001  (close() left the caller's run open)
    run.finish()
    wandb.teardown()
    (run_dir,) = (wandb_offline / "wandb").glob("offline-run-*")
    assert [(row.get("collector/frames"), row.get("train/loss")) for row in wandb_history(run_dir)] == [
        (5, None), (None, 0.5)]

    client = MlflowClient(mlflow_store)
    mine = client.create_run(client.create_experiment("mine")).info.run_id
    with MLflowLogger(run_id=mine, tracking_uri=mlflow_store) as ml:
        ml.log({"frames": 5, "workers": []})
    assert mlflow_metric(mlflow_store, mine, "collector/frames") == [(5, 5.0)]
    assert client.get_run(mine).info.status == "RUNNING"


def test_backends_check_their_arguments(tmp_path, wandb_offline, mlflow_store):
    with pytest.raises(ValueError, match=r"mode must be one of \('online', 'offline', 'disabled'\) or None .*, "
                                         "got 'off'"):
        WandbLogger(mode="off")
    with pytest.raises(TypeError, match="config must be a dict .*, got list"):
        WandbLogger(config=[1])
    with pytest.raises(ValueError, match=r"run= logs into your own run: leave out \['name'\]"):
        WandbLogger(run=object(), name="x")
    with pytest.raises(TypeError, match="run must be a W&B run .*, got object"):
        WandbLogger(run=object())
    with pytest.raises(ValueError, match="experiment must be a non-empty string .*, got ''"):
        MLflowLogger("")
    with pytest.raises(ValueError, match="run_id= logs into your own run: leave out run_name"):
        MLflowLogger(run_id="abc", run_name="x", tracking_uri=mlflow_store)
    with pytest.raises(TypeError, match="log_dir must be a folder path"):
        TensorBoardLogger(None)


@pytest.mark.parametrize(("name", "package", "extra"), [("WandbLogger", "wandb", "wandb"),
                                                      ("MLflowLogger", "mlflow", "mlflow"),
                                                      ("TensorBoardLogger", "tensorboard", "tensorboard")])
def test_a_missing_package_names_its_extra(name, package, extra, tmp_path, monkeypatch):
    import sys

    import rlcollect

    for module in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, package, None)  # importing it now raises ImportError
    with pytest.raises(ImportError, match=rf"pip install 'rlcollect\[{extra}\]'"):
        getattr(rlcollect, name)(str(tmp_path)) if name == "TensorBoardLogger" else getattr(rlcollect, name)()


# -- attached to the distributed collector ------------------------------------------------------------
def test_a_distributed_collector_logs_its_nodes(mlflow_store):
    with DistributedCollector([CountingEnv] * 2, None, frames_per_batch=20, total_frames=40, sync=True,
                              timeout=120.0) as c, MLflowLogger(tracking_uri=mlflow_store) as ml:
        for _ in c:
            ml.log(c)
    assert mlflow_metric(mlflow_store, ml.run_id, "collector/frames") == [(20, 20.0), (40, 40.0)]
    for node in (0, 1):
        assert mlflow_metric(mlflow_store, ml.run_id, f"collector/worker{node}/frames") == [(20, 10.0), (40, 20.0)]


# -- the command line ---------------------------------------------------------------------------------
def test_cli_collect_writes_to_wandb_and_mlflow(wandb_offline, mlflow_store, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from rlcollect import cli

    import wandb

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_store)
    assert cli.main(["collect", "--frames", "400", "--frames-per-batch", "200", "--no-progress",
                     "--wandb", "cli-test", "--mlflow", "cli-exp"]) == 0
    out = capsys.readouterr().out
    assert "wandb                cli-test\n" in out and "mlflow               cli-exp\n" in out
    wandb.teardown()
    (run_dir,) = (wandb_offline / "wandb").glob("offline-run-*")
    assert [(row["collector/step"], row["collector/frames"]) for row in wandb_history(run_dir)] == [
        (200, 200), (400, 400)]
    client = MlflowClient(mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("cli-exp").experiment_id])
    assert mlflow_metric(mlflow_store, run.info.run_id, "collector/frames") == [(200, 200.0), (400, 400.0)]
    assert run.info.status == "FINISHED"


def test_cli_names_the_extra_of_a_missing_logger(monkeypatch, capsys):
    import sys

    from rlcollect import cli

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["collect", "--frames", "10", "--wandb", "p"])
    assert exit_info.value.code == 2
    assert "argument --wandb: WandbLogger needs the wandb package" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_the_ppo_example_writes_to_the_three(tmp_path, mlflow_store):
    import os
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    example = Path(__file__).resolve().parent.parent / "examples" / "ppo_cartpole.py"
    store = mlflow_store
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": store, "MLFLOW_ALLOW_FILE_STORE": "true"}
    proc = subprocess.run([sys.executable, str(example), "--total-frames", "4000", "--out", str(tmp_path / "curve.png"),
                           "--tensorboard", str(tmp_path / "tb"), "--wandb", "ppo", "--mlflow", "ppo"],
                          capture_output=True, text=True, timeout=200, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the start-up phases, logged at INFO (issue 38, item 3)
    assert " starting 2 worker processes (each imports torch and makes its envs)\n" in proc.stderr
    assert " 2 worker processes started (" in proc.stderr
    wanted = {"train/policy_loss", "train/value_loss", "collector/policy_lag_max", "collector/worker1/env_step_mean_s"}

    board = tensorboard_scalars(tmp_path / "tb")
    assert [step for step, _ in board["collector/frames"]] == [2000, 4000]
    assert wanted <= set(board)

    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = wandb_history(run_dir)
    # each batch: a row of the collector's scalars, then one of the example's (write(), the same step)
    assert [row["collector/step"] for row in rows] == [2000, 2000, 4000, 4000]
    assert wanted <= set().union(*rows)

    client = MlflowClient(store)
    (run,) = client.search_runs([client.get_experiment_by_name("ppo").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "collector/frames")] == [2000, 4000]
    assert wanted <= set(run.data.metrics)


def test_the_extras_exist_and_ci_installs_them():
    import re
    import tomllib

    root = Path(__file__).resolve().parent.parent
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [extras[name][0].split(">")[0] for name in ("wandb", "mlflow", "hydra")] == [
        "wandb", "mlflow-skinny", "hydra-core"]
    stamp = (root / "Makefile").read_text().split("\n$(STAMP):", 1)[1].split("\n\n", 1)[0]  # the main venv's recipe
    installed = re.search(r"\$\(PIP_INSTALL\) -e '\.\[([\w,]+)\]'", stamp)
    assert {"tensorboard", "wandb", "mlflow", "hydra"} <= set(installed.group(1).split(","))
