"""bench/startup.py's plumbing: the rows it registers and how one run feeds both the cold and
the warm row of a start method. Nothing here measures for real (the rows run with
``python -m bench --only start-up``)."""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import startup, suite  # noqa: E402


def test_startup_rows_are_registered_for_each_method_cold_and_warm():
    names = [c.name for c in suite.CONFIGS if c.name.startswith("start-up:")]
    assert names == [f"start-up: first batch, CartPole-v1 random, 4 workers, MultiSync, {method}, {run}"
                     for method in ("the default", "forkserver", "spawn") for run in ("cold", "warm")]
    keyed = [c.name for c in startup.startup_configs() if c.torchrl]
    assert keyed == ["start-up: first batch, CartPole-v1 random, 4 workers, MultiSync, the default, cold"]


def test_one_interpreter_per_round_feeds_the_cold_and_the_warm_row(monkeypatch):
    runs = []

    def fake(method):
        runs.append(method)
        n = len(runs)
        return {"load": 1.5, "cold": 3.0 + n, "cold_construct": 2.0, "warm": 0.25 + n, "warm_construct": 0.125}

    monkeypatch.setattr(startup, "_measure", fake)
    cold, warm = startup.startup_configs()[4:6]  # spawn
    assert [cold.measure().seconds for _ in range(2)] == [4.0, 5.0]
    first = warm.measure()
    assert (first.seconds, warm.measure().seconds) == (1.25, 2.25)
    assert first.how == "second collector of the interpreter; 'spawn'; construction 0.12 s; load 1.5"
    assert runs == ["spawn", "spawn"]  # the warm rows reused the cold runs
    assert warm.measure().seconds == 3.25 and runs == ["spawn"] * 3  # nothing pending: a run of its own


def test_the_script_times_the_default_when_the_method_is_left_out():
    script = startup._SCRIPT.format(method=None, env="CartPole-v1", workers=4, fpb=1000)
    compile(script, "startup script", "exec")
    assert "options = {} if None is None" in script
