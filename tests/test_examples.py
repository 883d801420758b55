"""The training examples run end to end, shortened, and learn something.

Each example runs as a script (a fresh interpreter, as a user runs it) with a small frame budget;
it must exit cleanly, write its PNG and CSV, and its curve must show learning.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
DOCS = EXAMPLES.parent / "docs"
RUN_TIMEOUT_S = 170  # ~25 s on an idle 2-core machine; start-up alone can take 30 s on a busy one


TIMING = ("fps", "elapsed_s", "collect_s", "train_s")  # the CSV columns that are clock readings


def run_examples(script: str, tmp_path: Path, *args: str, copies: int = 1) -> list[list[dict]]:
    """Run `copies` instances of the script at once (each in its own directory); their CSVs."""
    outs, procs = [], []
    tmp_path.mkdir(parents=True, exist_ok=True)
    for i in range(copies):
        (tmp_path / str(i)).mkdir()
        outs.append(tmp_path / str(i) / "curve.png")
        procs.append(subprocess.Popen([sys.executable, str(EXAMPLES / script), "--out", str(outs[-1]), *args],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path / str(i)))
    try:
        results = [proc.communicate(timeout=RUN_TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    curves = []
    for proc, (stdout, stderr), out in zip(procs, results, outs):
        assert proc.returncode == 0, f"{script} failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
        with open(out.with_suffix(".csv"), newline="") as f:
            curves.append([{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)])
        if importlib.util.find_spec("matplotlib") is not None:
            assert out.stat().st_size > 0
    return curves


def run_example(script: str, tmp_path: Path, *args: str) -> list[dict]:
    return run_examples(script, tmp_path, *args)[0]


@pytest.mark.timeout(RUN_TIMEOUT_S + 10)
def test_ppo_cartpole_learns_and_is_reproducible(tmp_path):
    # 4 updates of 2,000 frames, run twice at once (so the two runs' timings differ). Seeded sync
    # collection and a one-thread learner make the run deterministic on one machine: both CSVs
    # are equal in every column but the clock's, and the mean return goes from ~20 (random) to
    # ~49. The two runs are compared with each other, never with docs/ppo_cartpole_seed1.csv:
    # torch's floating-point kernels differ between CPUs (AVX-512 or not), and the losses of
    # another machine differ in the 7th digit from the first row on.
    rows, again = run_examples("ppo_cartpole.py", tmp_path, "--total-frames", "8000", "--seed", "1", copies=2)
    strip = [{k: v for k, v in row.items() if k not in TIMING} for row in rows]
    assert strip == [{k: v for k, v in row.items() if k not in TIMING} for row in again]
    assert [row["frames"] for row in rows] == [2000, 4000, 6000, 8000]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("policy_loss", "value_loss", "entropy", "approx_kl"))
    assert rows[0]["mean_return"] < 30
    assert rows[-1]["mean_return"] > 1.5 * rows[0]["mean_return"]
    assert rows[-1]["entropy"] < rows[0]["entropy"]  # the policy moves away from uniform


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 10)
def test_ppo_cartpole_async_recorded_then_replayed_gives_the_same_csv(tmp_path):
    # Async collection: which worker's batch comes next, and which actor collected it, depend on
    # the timing; recorded (--record), the run is replayed (--replay) to the same CSV in every
    # column but the clock's.
    schedule = tmp_path / "run.jsonl"
    common = ("--collector", "async", "--total-frames", "6000", "--seed", "1", "--max-policy-lag", "1")
    (first,) = run_examples("ppo_cartpole.py", tmp_path / "a", *common, "--record", str(schedule))
    (again,) = run_examples("ppo_cartpole.py", tmp_path / "b", *common, "--replay", str(schedule))
    strip = [{k: v for k, v in row.items() if k not in TIMING} for row in first]
    assert strip == [{k: v for k, v in row.items() if k not in TIMING} for row in again]
    assert [row["frames"] for row in first] == list(range(1000, 6001, 1000))
    assert {row["worker"] for row in first} == {0.0, 1.0}


def test_the_docs_csv_is_the_demo_run():
    # docs/ppo_cartpole_seed1.csv is what `make demo` wrote (`--seed 1`, 300,000 frames, one row
    # per 2,000-frame batch); its columns are the ones the example writes today.
    with open(DOCS / "ppo_cartpole_seed1.csv", newline="") as f:
        reader = csv.DictReader(f)
        docs = list(reader)
    assert [float(row["frames"]) for row in docs] == list(range(2000, 300_001, 2000))
    source = (EXAMPLES / "ppo_cartpole.py").read_text()
    assert all(f'"{column}"' in source for column in reader.fieldnames)


def test_ppo_cartpole_help():
    proc = subprocess.run([sys.executable, str(EXAMPLES / "ppo_cartpole.py"), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for option in ("--seed", "--total-frames", "--out", "--workers", "--envs-per-worker"):
        assert option in proc.stdout
    assert "frames in each batch" in proc.stdout  # the dataclass field docstrings are the help


@pytest.mark.timeout(RUN_TIMEOUT_S + 10)
def test_dqn_cartpole_learns(tmp_path):
    # 30,000 frames, ~6,800 gradient steps while the workers run free, with settings that learn
    # fast (a bigger learning rate, 4 frames per step, a target copied every 250 steps).
    # Asynchronous collection is not reproducible, so the check has a wide margin: the first
    # line is the random policy's return (~21); the best line was 215-370 in trials.
    rows = run_example("dqn_cartpole.py", tmp_path, "--total-frames", "30000", "--learning-starts", "2000",
                       "--frames-per-update", "4", "--target-update-every", "250", "--learning-rate", "1e-3",
                       "--log-every", "500", "--seed", "1")
    assert rows[-1]["frames"] >= 30000 and rows[-1]["updates"] > 5000
    assert all(math.isfinite(row["loss"]) for row in rows)
    returns = [row["mean_return"] for row in rows if math.isfinite(row["mean_return"])]
    assert max(returns) > 2 * returns[0]


@pytest.mark.timeout(RUN_TIMEOUT_S + 10)
def test_ppo_mujoco_learns(tmp_path):
    # 4 updates of 1,000 frames on Hopper-v5 (seeded, deterministic): the mean return of the
    # finished episodes rises from 10.3 (a nearly random Gaussian policy) to 33.8.
    pytest.importorskip("mujoco", reason="the [mujoco] extra is not installed")
    rows = run_example("ppo_mujoco.py", tmp_path, "--total-frames", "4000", "--frames-per-batch", "1000", "--seed", "1")
    assert [row["frames"] for row in rows] == [1000, 2000, 3000, 4000]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("mean_return", "policy_loss", "value_loss", "entropy", "approx_kl"))
        assert row["collect_s"] > 0 and row["train_s"] > 0
    assert rows[-1]["mean_return"] > 2 * rows[0]["mean_return"]
    assert rows[-1]["entropy"] < rows[0]["entropy"]  # the Gaussian narrows


@pytest.mark.timeout(RUN_TIMEOUT_S + 10)
def test_ppo_atari_runs(tmp_path):
    # 3 updates of 256 frames on Breakout (8 games x 32 steps each): too short to learn or to end
    # a game (a random one lasts ~200 steps), long enough to check that pixels (uint8 4x84x84
    # stacks) go through collection, GAE and the CNN update.
    pytest.importorskip("ale_py", reason="the [atari] extra is not installed")
    rows = run_example("ppo_atari.py", tmp_path, "--total-frames", "768", "--frames-per-batch", "256",
                       "--minibatch-size", "128", "--seed", "1")
    assert [row["frames"] for row in rows] == [256, 512, 768]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in ("policy_loss", "value_loss", "entropy", "approx_kl"))
        assert 0 < row["entropy"] <= math.log(4) + 1e-6  # Breakout's 4 actions, a near-uniform policy
        assert row["value_loss"] > 0 and row["collect_s"] > 0 and row["train_s"] > 0


@pytest.mark.parametrize("script", ["ppo_mujoco.py", "ppo_atari.py"])
def test_new_examples_help(script):
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for option in ("--seed", "--total-frames", "--out", "--workers", "--envs-per-worker", "--epochs"):
        assert option in proc.stdout


def load_example(script: str):
    """The example as a module (its ``__main__`` block does not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{Path(script).stem}", EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["ppo_cartpole.py", "ppo_lstm_masked_cartpole.py"])
def test_the_target_return_is_the_envs_own(script, monkeypatch, capsys):
    # CartPole's 475 was once the target of every env (issue 38, item 7): the default is now the
    # env's reward_threshold in gymnasium's registry; --target-return still overrides it.
    example = load_example(script)
    for argv, target in ([], 475.0), (["--env-id", "Acrobot-v1"], -100.0), (["--env-id", "LunarLander-v3"], 200.0), \
            (["--env-id", "Acrobot-v1", "--target-return", "-80"], -80.0):
        monkeypatch.setattr(sys, "argv", [script, *argv])
        assert example.parse_args().target_return == target, argv
    # an env without a threshold: no target, said in the summary (and no line on the plot)
    args = example.Args(env_id="NoThreshold-v0", target_return=None)
    row = {"frames": 2000, "mean_return": 10.0, "episodes": 3, "fps": 100.0, "elapsed_s": 20.0, "carry_error": 0.0}
    example.summarize([row], args)
    assert ("no target return: NoThreshold-v0 has no reward_threshold in gymnasium's registry (--target-return)"
            in capsys.readouterr().out)
