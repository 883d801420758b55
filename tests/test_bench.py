"""The benchmark suite's plumbing (bench/): the torchrl key, targets, the runner with and
without a torchrl side, the tables and the command line. Nothing here measures for real."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import suite, torchrl_side  # noqa: E402
from bench.config import Config, StartupConfig, Target, torchrl_key  # noqa: E402
from bench.measure import Duration, Rate  # noqa: E402
from bench.multi import _COLD_START, multi_configs  # noqa: E402


def test_torchrl_key_round_trips_through_the_torchrl_side():
    key = torchrl_key("sync", "CartPole-v1", "mlp", workers=2, envs=8, frames_per_batch=2048)
    assert torchrl_side.parse_key(key) == {
        "collector": "sync", "env": "CartPole-v1", "policy": "mlp", "workers": 2, "envs": 8, "fpb": 2048,
        "step_time": None,
    }
    timed = torchrl_side.parse_key(torchrl_key("single", "sleep", frames_per_batch=200, step_time=1e-3))
    assert timed["env"] == "sleep" and timed["step_time"] == 1e-3


@pytest.mark.parametrize("key, message", [
    ("env=CartPole-v1 fpb=10", "lacks"),
    ("collector=threads env=CartPole-v1 fpb=10", "collector must be one of"),
    ("collector=single env=busy fpb=10", "needs step_time"),
    ("collector=single env=CartPole-v1 fpb=10 colour=red", "unknown words"),
])
def test_torchrl_side_rejects_bad_keys(key, message):
    with pytest.raises(ValueError, match=message):
        torchrl_side.parse_key(key)


def test_every_config_with_a_torchrl_side_has_a_key_it_understands():
    for config in suite.CONFIGS:
        if config.torchrl is not None:
            torchrl_side.parse_key(config.torchrl)


def test_the_timed_env_of_the_torchrl_side_spends_its_step_time():
    env = torchrl_side.TimedEnv(step_time=1e-3, busy=True)
    env.reset()
    import time

    start = time.perf_counter()
    obs, reward, terminated, truncated, _ = env.step(0)
    assert time.perf_counter() - start >= 1e-3
    assert obs.tolist() == [1.0] * 4 and reward == 1.0 and not terminated and not truncated


def test_targets_read_their_column():
    at_least = Target("ratio", at_least=0.6)
    assert at_least.met(0.61) and not at_least.met(0.59) and at_least.met(None) is None
    assert at_least.describe() == "≥ 0.6× ideal"
    at_most = Target("vs_torchrl", at_most=0.5)
    assert at_most.met(0.4) and not at_most.met(0.6)
    assert at_most.describe() == "≤ 0.5× torchrl"
    assert Target("of_bare", at_least=0.9).describe() == "≥ 0.9× workers × bare loop"
    with pytest.raises(ValueError, match="column"):
        Target("speed", at_least=1)
    with pytest.raises(ValueError, match="exactly one"):
        Target("ratio")


def _fake(name: str, ideal: float, ours: float, key: str | None, target: Target | None = None) -> Config:
    return Config(name, lambda s: Rate(ideal, "bare"), lambda s: Rate(ours, "ours"), torchrl=key, target=target)


def test_run_measures_torchrl_in_each_round_and_keeps_the_best(monkeypatch):
    calls = []

    def fake_torchrl(python, key, seconds):
        calls.append((python, key, seconds))
        return {"fps": 100.0 * len(calls), "how": "torchrl MultiSyncCollector"}

    monkeypatch.setattr(suite, "torchrl_measure", fake_torchrl)
    configs = [_fake("a", 1000.0, 800.0, "collector=sync env=x fpb=1", Target("vs_torchrl", at_least=5.0)),
               _fake("b", 1000.0, 950.0, None, Target("ratio", at_least=0.9))]
    a, b = suite.run(configs, seconds=3.0, rounds=3, log=lambda msg: None, torchrl_python="/torchrl/python")
    assert [c[1] for c in calls] == ["collector=sync env=x fpb=1"] * 3
    assert calls[0][2] == pytest.approx(1.0)
    assert a.torchrl_fps == 300.0 and a.vs_torchrl == pytest.approx(800 / 300)
    assert a.target_met is False
    assert b.torchrl_fps is None and b.vs_torchrl is None and b.target_met is True
    table = suite.format_table([a, b])
    assert "|         300 |          2.7 | ≥ 5× torchrl: MISSED |" in table
    assert a.at_once_fps is None and a.of_at_once is None
    assert "≥ 0.9× ideal: met" in table
    assert json.dumps(a.as_dict())  # serialisable, target included as text
    assert a.as_dict()["target"] == "≥ 5× torchrl"


def test_run_without_torchrl_leaves_its_columns_blank(monkeypatch):
    monkeypatch.setattr(suite, "torchrl_measure", lambda *a: pytest.fail("torchrl measured without --torchrl-python"))
    (result,) = suite.run([_fake("a", 1000.0, 500.0, "collector=single env=x fpb=1")], 1.0, 1, lambda m: None)
    assert result.torchrl_fps is None
    row = suite.format_table([result]).splitlines()[-1]
    cells = [cell.strip() for cell in row.split("|")[1:-1]]
    assert cells == ["a", "1,000", "500", "0.50", "1000.0", "", "", "", "", "", "", ""]


def test_a_failing_torchrl_side_is_logged_and_not_retried(monkeypatch):
    calls = []

    def failing(python, key, seconds):
        calls.append(key)
        raise RuntimeError("torchrl_side.py exited with code 1")

    monkeypatch.setattr(suite, "torchrl_measure", failing)
    logged = []
    (result,) = suite.run([_fake("a", 10.0, 5.0, "collector=single env=x fpb=1")], 1.0, 3, logged.append, "py")
    assert len(calls) == 1 and result.torchrl_fps is None
    assert any("torchrl side failed" in line for line in logged)


def test_startup_configs_keep_the_fastest_run_of_each_side(monkeypatch):
    ours = iter([3.0, 2.0, 4.0])
    monkeypatch.setattr(suite, "torchrl_measure", lambda python, key, s: {"first_batch_s": 6.0, "how": "torchrl"})
    config = StartupConfig("start", lambda: Duration(next(ours), "cold"), torchrl="collector=first-batch env=x fpb=1",
                           target=Target("vs_torchrl", at_most=0.5))
    (result,) = suite.run([config], 1.0, 3, lambda m: None, torchrl_python="py")
    assert result.seconds == 2.0 and result.samples == [3.0, 2.0, 4.0]
    assert result.torchrl_seconds == 6.0 and result.vs_torchrl == pytest.approx(1 / 3)
    assert result.target_met is True
    assert "| start    |        2.00 |      6.00 |         0.33 | ≤ 0.5× torchrl: met |" in suite.format_startup_table([result])


def test_the_suite_lists_the_multi_process_configurations(capsys):
    assert suite.main(["--list"]) == 0
    names = capsys.readouterr().out.splitlines()
    assert [c.name for c in multi_configs()] == names[-len(multi_configs()):]
    assert any("8 workers" in n and "SleepEnv" in n for n in names)
    assert any(n.startswith("first batch") for n in names)
    # --only "<single-process name>" still selects exactly one configuration
    assert sum("CartPole-v1 random, 1 env" in n for n in names) == 1


def test_torchrl_python_must_be_executable(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        suite.main(["--torchrl-python", str(tmp_path / "missing"), "--list"])
    assert exit_info.value.code == 2
    assert "--torchrl-python" in capsys.readouterr().err


def test_the_cold_start_script_compiles():
    compile(_COLD_START.format(env="CartPole-v1", workers=4, fpb=1000), "<cold start>", "exec")


def test_multi_process_configs_also_measure_bare_loops_at_once():
    config = Config("m", lambda s: Rate(2000.0, "2 × bare"), lambda s: Rate(900.0, "ours"),
                    at_once=lambda s: Rate(1000.0, "2 bare loops at once"))
    (result,) = suite.run([config], 1.0, 2, lambda m: None)
    assert result.at_once_fps == 1000.0 and result.of_at_once == pytest.approx(0.9)
    cells = [cell.strip() for cell in suite.format_table([result]).splitlines()[-1].split("|")[1:-1]]
    assert cells[5:7] == ["1,000", "0.90"]


def test_bare_loops_at_once_add_up():
    from bench.measure import at_once, timed_loop
    import functools

    rate = at_once(functools.partial(timed_loop, 1e-3, False), 2, 0.3)
    assert 1000 < rate.frames_per_s <= 2000


def test_timed_multi_configs_also_measure_workers_times_one_bare_loop():
    config = Config("sleep", lambda s: Rate(8000.0, "8 / step_time"), lambda s: Rate(6800.0, "ours"),
                    at_once=lambda s: Rate(7300.0, "8 bare loops at once"),
                    bare=lambda s: Rate(7400.0, "8 × bare loop alone"), target=Target("of_bare", at_least=0.9))
    (result,) = suite.run([config], 1.0, 2, lambda m: None)
    assert result.ratio == pytest.approx(0.85)  # still against the defined ideal
    assert result.bare_fps == 7400.0 and result.of_bare == pytest.approx(6800 / 7400)
    assert result.target_met is True
    assert result.as_dict()["of_bare"] == pytest.approx(6800 / 7400)
    table = suite.format_table([result])
    assert "workers × bare fps" in table.splitlines()[0]
    cells = [cell.strip() for cell in table.splitlines()[-1].split("|")[1:-1]]
    assert cells[7:9] == ["7,400", "0.92"]
    assert cells[-1] == "≥ 0.9× workers × bare loop: met"


def test_only_the_timed_multi_configs_have_a_bare_figure_and_sleep_is_held_to_it():
    configs = {c.name: c for c in multi_configs() if isinstance(c, Config)}
    with_bare = [name for name, c in configs.items() if c.bare is not None]
    assert sorted(n.split("(")[0] for n in with_bare) == ["BusyEnv", "SleepEnv"]
    sleep = next(c for name, c in configs.items() if name.startswith("SleepEnv"))
    assert sleep.target == Target("of_bare", at_least=0.9)


@pytest.mark.timeout(180)
def test_python_m_bench_runs_the_suite(tmp_path):
    # The suite's entry (`make bench`); once reached through `rlcollect bench` too (tests/test_cli.py).
    import subprocess

    path = tmp_path / "results.json"
    argv = ["--seconds", "0.2", "--rounds", "1", "--only", "CartPole-v1 random, 1 env", "--json", str(path)]
    proc = subprocess.run([sys.executable, "-m", "bench", *argv], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| CartPole-v1 random, 1 env(s)" in proc.stdout
    (result,) = json.loads(path.read_text())["results"]
    assert result["ideal_fps"] > 0 and result["collector_fps"] > 0
    assert result["ratio"] == pytest.approx(result["collector_fps"] / result["ideal_fps"])
