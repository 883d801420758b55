"""The ``rlcollect`` command: collect's summary, its one-line errors, --version, bench's pointer to the
source checkout, and a parser that runs before anything heavy is imported."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

from rlcollect import cli


def phases(err: str) -> list[str]:
    """The start-up phases ``collect`` logged, without their time stamps and seconds."""
    return [re.sub(r" \(\d+\.\d s so far\)$", "", line.split(" ", 1)[1]) for line in err.splitlines()
            if re.match(r"\d\d:\d\d:\d\d start-up ", line)]


def summary(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        name, _, value = line.partition("  ")
        rows[name.strip()] = value.strip()
    return rows


@pytest.mark.parametrize("extra", [[], ["--envs-per-worker", "4", "--policy", "mlp"]])
def test_collect_prints_a_summary(capsys, extra):
    code = cli.main(["collect", "--frames", "600", "--frames-per-batch", "200", "--seed", "1", *extra])
    assert code == 0
    captured = capsys.readouterr()
    rows = summary(captured.out)
    assert rows["frames"] == "600" and rows["batches"] == "3"
    assert int(rows["episodes finished"]) > 0
    assert float(rows["mean episode return"]) > 0
    assert "frames" in captured.err  # the progress bar


@pytest.mark.parametrize(
    "argv, message",
    [
        (["collect", "--frames", "0"], "argument --frames: expected a positive integer, got '0'"),
        (["collect", "--frames-per-batch", "x"], "expected a positive integer, got 'x'"),
        (["collect", "--mode", "fast"], "invalid choice: 'fast'"),
        (["collect", "--env", "NoSuchEnv-v0"], "argument --env: cannot make 'NoSuchEnv-v0'"),
        (["collect", "--env", "Pendulum-v1", "--policy", "mlp"], "mlp needs a flat Box observation"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert message in err


def test_workers_need_the_multiprocess_collectors(capsys, monkeypatch):
    import rlcollect

    # As in a version without them: the lazy export fails to import.
    monkeypatch.delattr(rlcollect, "MultiSyncCollector", raising=False)
    monkeypatch.setitem(sys.modules, "rlcollect.multiprocess.collector", None)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["collect", "--workers", "2", "--frames", "100"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # the start-up phases logged before it, then the error
    assert err.splitlines()[-1] == (
        "rlcollect: error: --workers > 1 needs the multi-process collectors (not available in this version)")
    assert phases(err) == ["start-up 1/3: importing torch and tensordict",
                           "start-up 2/3: starting 2 worker process(es)"]


@pytest.mark.timeout(180)  # two spawned workers each import torch: slow on a loaded 2-core machine
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_collect_with_workers(capsys, mode):
    argv = ["collect", "--workers", "2", "--mode", mode, "--frames", "400", "--frames-per-batch", "200"]
    assert cli.main([*argv, "--no-progress", "--seed", "0"]) == 0
    rows = summary(capsys.readouterr().out)
    assert rows["frames"] == "400"
    assert int(rows["episodes finished"]) > 0


def test_episode_tracker_carries_returns_across_batches():
    def batch(ids, rewards, dones):
        return TensorDict(
            {
                ("collector", "traj_ids"): torch.tensor(ids),
                ("next", "reward"): torch.tensor(rewards, dtype=torch.float32).unsqueeze(-1),
                ("next", "done"): torch.tensor(dones).unsqueeze(-1),
            },
            batch_size=[len(ids)],
        )

    tracker = cli.EpisodeTracker()
    tracker.update(batch([0, 0, 0, 1], [1.0, 1.0, 1.0, 2.0], [False, False, True, False]))
    tracker.update(batch([1, 1, 2, 2], [2.0, 2.0, 5.0, 5.0], [False, True, False, False]))
    assert tracker.returns == [3.0, 6.0]
    assert tracker.mean_return == 4.5
    assert tracker.running == {2: 10.0}


def test_version(capsys):
    import rlcollect

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"rlcollect {rlcollect.__version__}\n"


@pytest.mark.parametrize("argv", [["bench"], ["bench", "--seconds", "1", "--json", "x.json"], ["bench", "--help"]])
def test_bench_points_at_the_source_checkout(capsys, argv):
    # The suite lives in the checkout's bench/, which the installed package neither has nor imports.
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "rlcollect: error: bench: the benchmark suite is not part of the installed package; it lives in the bench/ "
        "folder of rlcollect's source checkout: run `python -m bench` (or `make bench`) from the repository root "
        "there\n"
    )


HEAVY = ("torch", "numpy", "tensordict", "gymnasium", "cloudpickle", "tqdm", "submitit", "matplotlib")


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--help"], 0),
        (["--version"], 0),
        (["collect", "--help"], 0),
        (["node", "--help"], 0),
        (["bench"], 2),
        (["collect", "--frames", "0"], 2),
        (["node", "--rank", "1"], 2),  # missing --master-addr ...: found before the node's imports
    ],
)
def test_parsing_imports_nothing_heavy(argv, code):
    # The installed command's entry point, with -X importtime listing every module imported.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    entry = "import sys; from rlcollect.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", entry, *argv], capture_output=True, text=True,
                          timeout=60, env=env)
    assert proc.returncode == code, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "rlcollect.cli" in imported
    assert sorted(m for m in imported if m.split(".")[0] in HEAVY) == []


def test_a_bad_env_id_answers_before_torch_is_imported():
    # gymnasium checks the id (its registry); torch and tensordict (seconds of imports, 104 s
    # seen at load 11) come only after it. Blocking their import proves the order.
    entry = ("import sys; sys.modules['torch'] = None; sys.modules['tensordict'] = None; "
             "from rlcollect.cli import main; sys.exit(main())")
    proc = subprocess.run([sys.executable, "-c", entry, "collect", "--env", "Nope-v9"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("rlcollect: error: argument --env: cannot make 'Nope-v9': "), proc.stderr


def test_collect_logs_each_start_up_phase(capsys):
    handlers = list(logging.getLogger("rlcollect").handlers)
    assert cli.main(["collect", "--frames", "200", "--frames-per-batch", "100", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert phases(err) == ["start-up 1/3: importing torch and tensordict", "start-up 2/3: making the env",
                           "start-up 3/3: waiting for the first batch"]
    assert re.search(r"^\d\d:\d\d:\d\d collecting CartPole-v1, 1 worker\(s\) x 1 env\(s\), sync, random policy, 200 "
                     r"frames in batches of 100$", err, re.M)
    assert re.search(r"^\d\d:\d\d:\d\d first batch after \d+\.\d s; collecting$", err, re.M)
    assert logging.getLogger("rlcollect").handlers == handlers  # the command's handler is gone
    assert cli.main(["collect", "--frames", "200", "--frames-per-batch", "100", "--no-progress",
                     "--log-level", "WARNING"]) == 0
    assert capsys.readouterr().err == ""


def test_collect_out_saves_a_replay_buffer_that_reads_back(tmp_path, capsys):
    from rlcollect import ReplayBuffer

    out = tmp_path / "frames"
    assert cli.main(["collect", "--frames", "400", "--frames-per-batch", "200", "--envs-per-worker", "2",
                     "--no-progress", "--seed", "3", "--out", str(out)]) == 0
    rows = summary(capsys.readouterr().out)
    assert rows["out"] == f"{out}: 400 frames, read back with ReplayBuffer(400, storage='memmap', path={str(out)!r})"
    buffer = ReplayBuffer(400, storage="memmap", path=out)
    try:
        frames = buffer[:]
        assert len(buffer) == buffer.write_count == 400
        assert frames["observation"].shape == (400, 4) and frames["next", "reward"].sum().item() == 400.0
        # every episode the summary counted ended in a saved frame
        assert int(frames["next", "done"].sum()) == int(rows["episodes finished"]) > 0
    finally:
        buffer.close()


def test_collect_out_must_be_a_new_or_empty_folder(tmp_path, capsys):
    (tmp_path / "x").write_text("x")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["collect", "--frames", "10", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        f"rlcollect: error: argument --out: {str(tmp_path)!r} is not a new or empty folder (it would hold the "
        "collected frames)\n")


def test_help_says_what_each_command_is_for(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per paragraph: the checks read whole sentences
    for argv in (["collect", "--help"], ["node", "--help"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "to check that an env runs under rlcollect and how fast it is collected" in out
    assert "save the frames (--out) as a replay buffer to read back later" in out
    # $RLCOLLECT_SECRET holds the secret itself: the help no longer calls it the file's default
    assert "the secret itself is read from $RLCOLLECT_SECRET (the variable holds the secret, not a path)" in out
    assert "(default: $RLCOLLECT_SECRET)" not in out
