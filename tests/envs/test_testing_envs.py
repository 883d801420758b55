"""The test and benchmark envs: CountingEnv, BusyEnv, SleepEnv and FaultyEnv."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from loadscale import scaled
import torch
from tensordict import TensorDict

from rlcollect._context import current_worker_index, worker_index
from rlcollect.envs import ArraySpec, BusyEnv, CountingEnv, FaultyEnv, InjectedFault, SleepEnv

pytestmark = pytest.mark.timeout(30)


def advance(env, td):
    """One step through the TensorDict interface; returns ``(stepped td, next root)``."""
    td = env.step(env.rand_action(td))
    return td, td["next"].exclude("reward")


# -- CountingEnv -------------------------------------------------------------------------------
def test_counting_counts_exactly_and_terminates_at_max_steps():
    env = CountingEnv(max_steps=3)
    assert env.batch_size == torch.Size([])
    assert env.obs_layout == {"observation": ArraySpec((1,), np.dtype(np.float32))}
    assert env.action_layout == ArraySpec((), np.dtype(np.int64))
    td = env.reset()
    assert td["observation"].tolist() == [0.0]
    for t in (1, 2, 3):
        stepped, td = advance(env, td)
        assert stepped["next", "observation"].tolist() == [float(t)]
        assert stepped["next", "reward"].tolist() == [1.0]
        assert stepped["next", "terminated"].tolist() == [t == 3]
        assert stepped["next", "truncated"].tolist() == [False]
        assert stepped["next", "done"].tolist() == [t == 3]
    assert env.total_steps == 3
    assert env.reset()["observation"].tolist() == [0.0]
    stepped, _ = advance(env, env.reset())
    assert stepped["next", "observation"].tolist() == [1.0]


def test_counting_without_max_steps_never_ends():
    env = CountingEnv(max_steps=None)
    td = env.reset()
    for _ in range(50):
        stepped, td = advance(env, td)
        assert not stepped["next", "done"].item()
    assert stepped["next", "observation"].tolist() == [50.0]


def test_counting_obs_dim_and_batch_sizes():
    env = CountingEnv(max_steps=2, batch_size=4, obs_dim=3)
    assert env.batch_size == torch.Size([4])
    assert env.obs_layout == {"observation": ArraySpec((3,), np.dtype(np.float32))}
    stepped, _ = advance(env, env.reset())
    assert stepped["next", "observation"].tolist() == [[1.0, 1.0, 1.0]] * 4
    env = CountingEnv(batch_size=(2, 3))
    assert env.batch_size == torch.Size([2, 3]) and env.num_rows == 6
    td = env.reset()
    assert td["observation"].shape == (2, 3, 1)
    assert td["done"].shape == (2, 3, 1)
    td = env.rand_action(td)
    assert td["action"].shape == (2, 3)
    assert CountingEnv(batch_size=torch.Size([5])).batch_size == torch.Size([5])
    assert CountingEnv(batch_size=[]).batch_size == torch.Size([])


def test_counting_2d_batch_partial_reset_and_autoreset():
    env = CountingEnv(max_steps=10, batch_size=(2, 3))
    td = env.reset()
    for _ in range(2):
        _, td = advance(env, td)
    mask = torch.tensor([[True, False, False], [False, False, True]]).unsqueeze(-1)
    out = env.reset(TensorDict({"_reset": mask}, batch_size=[2, 3]))
    assert out["observation"].squeeze(-1).tolist() == [[0.0, 2.0, 2.0], [2.0, 2.0, 0.0]]
    stepped, root = env.step_and_maybe_reset(env.rand_action(out))
    assert stepped["next", "observation"].squeeze(-1).tolist() == [[1.0, 3.0, 3.0], [3.0, 3.0, 1.0]]
    assert not stepped["next", "done"].any()


def test_counting_step_and_maybe_reset_batched():
    env = CountingEnv(max_steps=2, batch_size=[2])
    td = env.reset()
    stepped, root = env.step_and_maybe_reset(env.rand_action(td))
    assert root["observation"].tolist() == [[1.0], [1.0]]
    stepped, root = env.step_and_maybe_reset(env.rand_action(root))
    assert stepped["next", "observation"].tolist() == [[2.0], [2.0]]
    assert stepped["next", "done"].tolist() == [[True], [True]]
    assert root["observation"].tolist() == [[0.0], [0.0]]
    assert root["done"].tolist() == [[False], [False]]
    stepped, root = env.step_and_maybe_reset(env.rand_action(root))
    assert stepped["next", "observation"].tolist() == [[1.0], [1.0]]


def test_counting_actions_are_random_in_range_and_seeded():
    env = CountingEnv(batch_size=[8], num_actions=3)
    draws = torch.stack([env.rand_action()["action"] for _ in range(30)])
    assert draws.dtype == torch.int64
    assert set(draws.unique().tolist()) == {0, 1, 2}

    def seq(seed):
        e = CountingEnv(batch_size=[4])
        assert e.set_seed(seed) == seed + 4
        return torch.stack([e.rand_action()["action"] for _ in range(10)])

    assert torch.equal(seq(1), seq(1))
    assert not torch.equal(seq(1), seq(2))


def test_counting_state_dict_round_trip():
    env = CountingEnv(max_steps=None, batch_size=[2])
    td = env.reset()
    _, td = advance(env, td)
    state = env.state_dict()
    first = [advance(env, td)[0]["next", "observation"].clone() for _ in range(2)]
    actions_first = [env.rand_action()["action"] for _ in range(3)]
    env.load_state_dict(state)
    assert env.total_steps == 1
    second = [advance(env, td)[0]["next", "observation"].clone() for _ in range(2)]
    actions_second = [env.rand_action()["action"] for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(torch.equal(a, b) for a, b in zip(actions_first, actions_second))
    assert second[-1].tolist() == [[3.0], [3.0]]


def _actions(env, steps):
    out = np.zeros((steps, env.num_rows), np.int64)
    for row in out:
        env.sample_actions(row)
    return out


RANDOM_ENVS = {
    "counting": lambda: CountingEnv(batch_size=[3], num_actions=5),
    "sleep": lambda: SleepEnv(step_time=0.0, batch_size=[3]),
    "busy": lambda: BusyEnv(step_time=0.0, batch_size=[3]),
}


@pytest.mark.parametrize("kind", sorted(RANDOM_ENVS))
def test_random_actions_come_in_blocks_and_stay_seeded(kind):
    # 600 steps cross two block boundaries (actions are drawn 256 steps at a time).
    def seq(seed):
        env = RANDOM_ENVS[kind]()
        env.set_seed(seed)
        return _actions(env, 600)

    first = seq(7)
    assert np.array_equal(first, seq(7))
    assert not np.array_equal(first, seq(8))
    assert not np.array_equal(first[:256], first[256:512])  # each block is a fresh draw
    assert set(np.unique(first)) == set(range(RANDOM_ENVS[kind]().num_actions))


@pytest.mark.parametrize("rows", [1, 3])
def test_random_action_blocks_give_the_per_step_sequence(rows):
    # Drawing 256 steps at once yields what one draw per step yielded before: seeded runs
    # made before actions came in blocks see the same actions.
    env = CountingEnv(batch_size=[rows], num_actions=3)
    env.set_seed(11)
    rng = np.random.default_rng(11)
    expected = np.stack([rng.integers(0, 3, size=rows) for _ in range(600)])
    assert np.array_equal(_actions(env, 600), expected)


@pytest.mark.parametrize("kind", sorted(RANDOM_ENVS))
def test_random_action_state_round_trips_mid_block(kind):
    env = RANDOM_ENVS[kind]()
    env.set_seed(3)
    _actions(env, 100)
    state = env.state_dict()
    assert state["random_block"].shape == (156, 3)  # the unused rest of the current block
    after = _actions(env, 400)
    env.load_state_dict(state)
    assert np.array_equal(_actions(env, 400), after)
    other = RANDOM_ENVS[kind]()  # a fresh env continues the same stream from the state
    other.load_state_dict(state)
    assert np.array_equal(_actions(other, 400), after)


def test_random_action_state_without_a_block_continues_from_the_generator():
    # A state saved before actions came in blocks has only the generator state.
    env = CountingEnv(batch_size=[2])
    env.set_seed(1)
    _actions(env, 10)
    state = env.state_dict()
    del state["random_block"]
    a, b = CountingEnv(batch_size=[2]), CountingEnv(batch_size=[2])
    a.load_state_dict(state)
    b.load_state_dict(state)
    assert np.array_equal(_actions(a, 300), _actions(b, 300))


def test_counting_load_state_dict_names_missing_keys_and_changes_nothing():
    env = CountingEnv(batch_size=[2])
    advance(env, env.reset())
    before = env.state_dict()
    with pytest.raises(KeyError, match="rng"):
        env.load_state_dict({"count": np.full(2, 3, np.int64), "total_steps": 9})
    after = env.state_dict()
    assert after["count"].tolist() == before["count"].tolist() == [1, 1]
    assert after["total_steps"] == before["total_steps"]


def test_counting_counts_survive_a_state_round_trip_with_partial_resets():
    env = CountingEnv(max_steps=None, batch_size=[3])
    td = env.reset()
    for _ in range(4):
        _, td = advance(env, td)
    env.reset(TensorDict({"_reset": torch.tensor([[False], [True], [False]])}, batch_size=[3]))
    _, td = advance(env, td)
    state = env.state_dict()
    assert state["count"].tolist() == [5, 1, 5] and state["total_steps"] == 5
    fresh = CountingEnv(max_steps=None, batch_size=[3])
    fresh.load_state_dict(state)
    stepped = fresh.step(fresh.rand_action(TensorDict({}, batch_size=[3])))
    assert stepped["next", "observation"][:, 0].tolist() == [6.0, 2.0, 6.0]


@pytest.mark.parametrize("max_steps", [0, -3])
def test_counting_bad_max_steps(max_steps):
    with pytest.raises(ValueError, match="max_steps"):
        CountingEnv(max_steps=max_steps)


def test_counting_close_is_a_no_op():
    env = CountingEnv()
    env.close()
    env.close()
    assert env.state_dict()["total_steps"] == 0


# -- BusyEnv / SleepEnv --------------------------------------------------------------------------
def test_busy_env_burns_step_time_per_row():
    env = BusyEnv(step_time=0.01, batch_size=[3])
    assert env.obs_layout == {"observation": ArraySpec((4,), np.dtype(np.float32))}
    td = env.rand_action(env.reset())
    start = time.perf_counter()
    td = env.step(td)
    elapsed = time.perf_counter() - start
    assert elapsed >= 0.03
    assert td["next", "observation"].tolist() == [[1.0] * 4] * 3
    assert not td["next", "done"].any()  # max_steps=None by default


def test_busy_env_busy_waits_instead_of_sleeping(monkeypatch):
    # CPU time is no safe lower bound on a loaded machine, so check the mechanism instead.
    import rlcollect.envs.testing as testing

    def no_sleep(seconds):
        raise AssertionError("BusyEnv must burn CPU, not sleep")

    monkeypatch.setattr(testing.time, "sleep", no_sleep)
    env = BusyEnv(step_time=0.005)
    start = time.perf_counter()
    env.step(env.rand_action(env.reset()))
    assert time.perf_counter() - start >= 0.005


def test_sleep_env_sleeps_step_time_per_step():
    env = SleepEnv(step_time=0.02, batch_size=[3], max_steps=2)
    td = env.reset()
    start = time.perf_counter()
    for _ in range(2):
        stepped, td = advance(env, td)
    elapsed = time.perf_counter() - start
    assert elapsed >= 0.04
    assert stepped["next", "observation"].tolist() == [[2.0] * 4] * 3
    assert stepped["next", "done"].all()


def test_busy_and_sleep_env_options():
    assert BusyEnv(step_time=1e-4, obs_dim=2).obs_layout["observation"].shape == (2,)
    env = SleepEnv(step_time=1e-4, max_steps=1)
    stepped, _ = advance(env, env.reset())
    assert stepped["next", "terminated"].item()


# -- FaultyEnv in-process ------------------------------------------------------------------------
def test_faulty_raise_in_step_at_the_exact_step():
    env = FaultyEnv("raise", at_step=3)
    td = env.reset()
    for _ in range(2):
        _, td = advance(env, td)
    assert isinstance(InjectedFault("x"), RuntimeError)
    with pytest.raises(InjectedFault, match=r"injected fault at step 3 \(worker None\)"):
        env.step(env.rand_action(td))
    # It fires once per instance: the next step goes on counting.
    stepped, _ = advance(env, td)
    assert stepped["next", "observation"].tolist() == [3.0]


def test_faulty_step_count_spans_episodes():
    env = FaultyEnv("raise", at_step=4, max_steps=2)
    td = env.reset()
    _, td = advance(env, td)
    stepped, td = advance(env, td)
    assert stepped["next", "done"].item()
    td = env.reset()  # resets do not count as steps
    _, td = advance(env, td)
    with pytest.raises(InjectedFault):
        env.step(env.rand_action(td))


def test_faulty_raise_in_reset_at_the_exact_reset():
    env = FaultyEnv("raise", at_step=2, where="reset")
    td = env.reset()
    for _ in range(5):  # steps never fire when where="reset"
        _, td = advance(env, td)
    with pytest.raises(InjectedFault, match=r"injected fault at reset 2"):
        env.reset()
    assert env.reset()["observation"].tolist() == [0.0]


def test_faulty_reset_fault_fires_in_autoreset():
    env = FaultyEnv("raise", at_step=2, where="reset", max_steps=1)
    td = env.reset()
    with pytest.raises(InjectedFault):
        env.step_and_maybe_reset(env.rand_action(td))


def test_faulty_raise_through_the_array_interface():
    env = FaultyEnv("raise", at_step=1, batch_size=[2])
    obs = env.new_obs_buffers()
    env.reset_rows(None, obs)
    with pytest.raises(InjectedFault):
        env.step_rows(np.zeros(2, np.int64), obs, np.zeros(2, np.float32), np.zeros(2, bool), np.zeros(2, bool))


def test_faulty_worker_ids_use_the_worker_index_at_construction():
    assert current_worker_index() is None
    with worker_index(1):
        assert current_worker_index() == 1
        targeted = FaultyEnv("raise", at_step=1, worker_ids=[1, 3])
        with worker_index(0):
            spared = FaultyEnv("raise", at_step=1, worker_ids=[1, 3])
    assert current_worker_index() is None
    outside = FaultyEnv("raise", at_step=1, worker_ids=[1, 3])
    assert (targeted.worker_index, spared.worker_index, outside.worker_index) == (1, 0, None)

    with pytest.raises(InjectedFault, match=r"\(worker 1\)"):
        targeted.step(targeted.rand_action(targeted.reset()))
    advance(spared, spared.reset())
    advance(outside, outside.reset())

    everywhere = FaultyEnv("raise", at_step=1)
    with pytest.raises(InjectedFault, match=r"\(worker None\)"):
        everywhere.step(everywhere.rand_action(everywhere.reset()))


def test_worker_index_context_restores_on_error():
    with pytest.raises(KeyError):
        with worker_index(5):
            raise KeyError
    assert current_worker_index() is None


def test_faulty_times_makes_the_fault_transient(tmp_path):
    counter = tmp_path / "fired"
    outcomes = []
    for _ in range(4):
        env = FaultyEnv("raise", at_step=2, times=2, counter_file=str(counter))
        td = env.reset()
        _, td = advance(env, td)
        assert not counter.exists() or counter.stat().st_size == sum(outcomes)  # step 1: no count
        try:
            advance(env, td)
            outcomes.append(False)
        except InjectedFault:
            outcomes.append(True)
    assert outcomes == [True, True, False, False]
    assert counter.stat().st_size == 2


def test_faulty_times_ignores_spared_workers(tmp_path):
    counter = tmp_path / "fired"
    with worker_index(0):
        spared = FaultyEnv("raise", at_step=1, worker_ids=[1], times=1, counter_file=str(counter))
    advance(spared, spared.reset())
    assert not counter.exists()
    with worker_index(1):
        targeted = FaultyEnv("raise", at_step=1, worker_ids=[1], times=1, counter_file=str(counter))
    with pytest.raises(InjectedFault):
        advance(targeted, targeted.reset())
    assert counter.stat().st_size == 1


def test_faulty_modes_do_not_fire_before_at_step():
    # Dangerous modes are safe in-process as long as at_step is never reached.
    for fault in ("hang", "exit", "kill", "segfault"):
        env = FaultyEnv(fault, at_step=100, max_steps=None)
        td = env.reset()
        for _ in range(5):
            _, td = advance(env, td)
        env = FaultyEnv(fault, at_step=100, where="reset")
        for _ in range(5):
            env.reset()


def test_faulty_start_delay():
    start = time.perf_counter()
    FaultyEnv(start_delay=0.05)
    assert time.perf_counter() - start >= 0.05


def test_faulty_is_a_counting_env():
    env = FaultyEnv("raise", at_step=100, max_steps=2, batch_size=[3])
    assert isinstance(env, CountingEnv)
    assert env.batch_size == torch.Size([3])
    td = env.reset()
    _, td = advance(env, td)
    stepped, _ = advance(env, td)
    assert stepped["next", "terminated"].all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fault": "explode"}, "fault must be one of"),
        ({"fault": None}, "fault must be one of"),
        ({"where": "close"}, "where must be 'step' or 'reset'"),
        ({"times": 1}, "times needs counter_file"),
        ({"at_step": 0}, "at_step"),
        ({"at_step": -1}, "at_step"),
        ({"at_step": 1.5}, "at_step"),
        ({"max_steps": 0}, "max_steps"),
    ],
)
def test_faulty_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FaultyEnv(**kwargs)


# -- FaultyEnv faults that end or block the process: in spawned children -----------------------
def faulty_child(fault: str, at_step: int, where: str, exit_code: int, progress: str) -> None:
    """Child-process body: reset, step, step, reset, step x4, reset, ... logging each call."""
    env = FaultyEnv(fault, at_step=at_step, where=where, exit_code=exit_code, max_steps=None)
    with open(progress, "a", buffering=1) as log:

        def call(name: str, index: int, fn) -> None:
            log.write(f"before {name} {index}\n")
            fn()
            log.write(f"after {name} {index}\n")

        td = TensorDict({"action": torch.tensor(0)}, batch_size=[])
        resets = steps = 0
        for op in "RSSRSSSSRSS":
            if op == "R":
                resets += 1
                call("reset", resets, env.reset)
            else:
                steps += 1
                call("step", steps, lambda: env.step(td))
    # Reaching here means the fault never fired: exit 0 so the test sees it.


# name: (fault, at_step, where, exit_code, expected exitcode, last progress line)
CHILDREN = {
    "exit": ("exit", 3, "step", 7, 7, "before step 3"),
    "kill": ("kill", 2, "reset", 3, -signal.SIGKILL, "before reset 2"),
    "segfault": ("segfault", 2, "step", 3, -signal.SIGSEGV, "before step 2"),
    "hang": ("hang", 2, "step", 3, None, "before step 2"),
}


def progress_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def wait_for_line(path: Path, line: str, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = progress_lines(path)
        if line in lines:
            return lines
        time.sleep(0.05)
    return progress_lines(path)


@pytest.fixture(scope="module")
def fault_children(tmp_path_factory):
    """Start every fault child at once and reap them all at the end of the module.

    Each spawned child pays about 5 s of CPU importing torch and tensordict, so they start
    together (12-17 s on 2 cores, hence the 60 s bound on these tests rather than 30).
    """
    ctx = mp.get_context("spawn")
    root = tmp_path_factory.mktemp("faulty")
    children = {}
    try:
        for name, (fault, at_step, where, exit_code, _, _) in CHILDREN.items():
            progress = root / f"{name}.log"
            proc = ctx.Process(
                target=faulty_child, args=(fault, at_step, where, exit_code, str(progress)), daemon=True
            )
            proc.start()
            children[name] = (proc, progress)
        yield children
    finally:
        for proc, _ in children.values():
            if proc.is_alive():
                proc.terminate()
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join(20)
        leftover = [p.pid for p, _ in children.values() if p.is_alive()]
        assert not leftover, f"fault children still alive: {leftover}"
        assert not set(mp.active_children()) & {p for p, _ in children.values()}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["exit", "kill", "segfault"])
def test_faulty_process_ending_faults(fault_children, name):
    proc, progress = fault_children[name]
    *_, expected_code, last_line = CHILDREN[name]
    proc.join(timeout=scaled(50, cap=200))  # spawned: each child imports what it needs (loaded: minutes)
    assert not proc.is_alive(), f"{name} child still running; progress: {progress_lines(progress)}"
    assert proc.exitcode == expected_code
    lines = progress_lines(progress)
    # The fault fired in exactly the planned call, not before.
    assert lines[-1] == last_line, lines


@pytest.mark.timeout(60)
def test_faulty_hang_blocks_until_terminated(fault_children):
    proc, progress = fault_children["hang"]
    lines = wait_for_line(progress, "before step 2", timeout=50)
    assert lines[-1:] == ["before step 2"], lines
    proc.join(timeout=0.5)
    assert proc.is_alive() and proc.exitcode is None
    assert progress_lines(progress)[-1] == "before step 2"
    proc.terminate()
    proc.join(30)  # generous: on a loaded 2-core machine even a SIGTERM'd child can lag
    assert proc.exitcode == -signal.SIGTERM


def test_faulty_child_helper_runs_clean_without_a_fault(tmp_path):
    # The child body itself (no spawn): with at_step out of reach it finishes every call.
    progress = tmp_path / "log"
    faulty_child("raise", 100, "step", 3, str(progress))
    lines = progress_lines(progress)
    assert lines[-1] == "after step 8" and len(lines) == 22
