"""The ``rlcollect`` command.

    rlcollect collect --env CartPole-v1 --frames 100000 --frames-per-batch 1000
    rlcollect node --master-addr HOST --master-port PORT --rank R --world-size W --secret-file PATH
    rlcollect --version

``collect`` runs a collection with a progress bar (frames, frames/s) on stderr and prints a
summary on stdout. ``node`` runs a node of a ``DistributedCollector(launcher="external")``
(rlcollect/distributed/node.py). Bad arguments give a one-line error and exit code 2.

The benchmark suite is not part of the installed package: it lives in ``bench/`` of a source
checkout and runs with ``python -m bench`` (or ``make bench``) there; ``rlcollect bench`` says so.

The parser is built and run before anything heavy is imported (torch, tensordict, gymnasium:
seconds), so ``--help``, ``--version`` and bad options answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlcollect import __version__
from rlcollect._pids import remove_multiprocessing_temp_dir

PROG = "rlcollect"
log = logging.getLogger("rlcollect.cli")
BENCH_MOVED = (
    "bench: the benchmark suite is not part of the installed package; it lives in the bench/ folder of "
    "rlcollect's source checkout: run `python -m bench` (or `make bench`) from the repository root there"
)


# -- argument parsing --------------------------------------------------------------------------
def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (no usage dump) and exit with code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Collect reinforcement-learning experience: `collect` runs a collection "
                     "from the command line, `node` joins a DistributedCollector as one of its nodes.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    collect = commands.add_parser(
        "collect",
        help="collect from a gymnasium env: check it runs, measure frames/s, log stats, save the frames",
        description="Collect experience from a gymnasium env with a random (or an untrained MLP) policy, in this "
        "process or in --workers processes: to check that an env runs under rlcollect and how fast it is collected "
        "(frames/s with N workers), to watch the collector's stats() in TensorBoard, Weights & Biases or MLflow, or to "
        "save the frames (--out) as a replay buffer to read back later. Start-up phases are logged on stderr "
        "(--log-level), then a progress bar; a summary is printed on stdout.",
    )
    collect.add_argument("--env", default="CartPole-v1", help="gymnasium env id (default: %(default)s)")
    collect.add_argument("--workers", type=positive_int, default=1, help="worker processes (default: %(default)s)")
    collect.add_argument(
        "--envs-per-worker", type=positive_int, default=1, help="env copies stepped together (default: %(default)s)"
    )
    collect.add_argument(
        "--mode",
        choices=("sync", "async"),
        default="sync",
        help="how multi-process batches are gathered (default: %(default)s)",
    )
    collect.add_argument("--frames", type=positive_int, default=100_000, help="total frames (default: %(default)s)")
    collect.add_argument(
        "--frames-per-batch", type=positive_int, default=1000, help="frames per batch (default: %(default)s)"
    )
    collect.add_argument(
        "--policy",
        choices=("random", "mlp"),
        default="random",
        help="random actions, or an untrained 2x64 MLP taking the argmax (default: %(default)s)",
    )
    collect.add_argument("--seed", type=int, default=None, help="seed the envs and the policy")
    collect.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    collect.add_argument(
        "--out",
        metavar="DIR",
        default=None,
        help="save every frame collected in DIR (new or empty): a memory-mapped rlcollect ReplayBuffer, read back "
        "with ReplayBuffer(CAPACITY, storage='memmap', path=DIR) (the summary prints CAPACITY)",
    )
    collect.add_argument(
        "--log-level",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default="INFO",
        help="what rlcollect logs on stderr: INFO shows each start-up phase (default: %(default)s)",
    )
    collect.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="after every batch, write the collector's stats() to TensorBoard event files in DIR "
        "(needs pip install 'rlcollect[tensorboard]')",
    )
    collect.add_argument(
        "--wandb",
        metavar="PROJECT",
        default=None,
        help="after every batch, write the collector's stats() to a Weights & Biases run of PROJECT "
        "($WANDB_MODE=offline keeps it on disk; needs pip install 'rlcollect[wandb]')",
    )
    collect.add_argument(
        "--mlflow",
        metavar="EXPERIMENT",
        default=None,
        help="after every batch, write the collector's stats() to an MLflow run of EXPERIMENT, at $MLFLOW_TRACKING_URI "
        "(needs pip install 'rlcollect[mlflow]')",
    )

    node = commands.add_parser(
        "node",
        help="run a distributed node for a DistributedCollector(launcher='external')",
        description="Join the DistributedCollector at --master-addr:--master-port as node --rank and collect what it "
        "asks for. The node runs the code that collector sends it, once authenticated with the run's secret "
        "(--secret-file, the file rank 0 was given as secret_file, or $RLCOLLECT_SECRET): only join a collector you "
        "trust. torchrun's MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE stand in for missing options. The node "
        "exits when rank 0 dies, or has not beaten for --rank0-timeout seconds.",
    )
    from rlcollect.distributed.launch.node_args import add_arguments

    add_arguments(node)
    return parser


# -- collect -----------------------------------------------------------------------------------
@dataclass
class EpisodeTracker:
    """Returns of finished episodes, from batches with ``("next", "reward")``, ``("next", "done")``
    and ``("collector", "traj_ids")``. A trajectory keeps its id across batch boundaries, so a
    running sum per id is carried over until that id's done arrives."""

    running: dict[int, float] = field(default_factory=dict)
    returns: list[float] = field(default_factory=list)

    def update(self, batch) -> None:
        import torch

        ids = batch.get(("collector", "traj_ids")).reshape(-1)
        reward = batch.get(("next", "reward")).reshape(ids.shape[0], -1).sum(-1).double()
        done = batch.get(("next", "done")).reshape(ids.shape[0], -1).any(-1)
        unique, inverse = torch.unique(ids, return_inverse=True)
        sums = torch.zeros(unique.shape[0], dtype=torch.float64).index_add_(0, inverse, reward)
        for traj, total in zip(unique.tolist(), sums.tolist()):
            self.running[traj] = self.running.get(traj, 0.0) + total
        for traj in ids[done].tolist():
            self.returns.append(self.running.pop(traj))

    @property
    def mean_return(self) -> float | None:
        return sum(self.returns) / len(self.returns) if self.returns else None


class CliError(Exception):
    """A bad argument found after parsing (exit code 2)."""


def _probe_env(env_id: str):
    """Build the env once here, to fail early on a bad id and to read its spaces."""
    from rlcollect.envs.gym_ids import make

    try:
        env = make(env_id)
    except Exception as exc:  # gymnasium raises several types for a bad id
        raise CliError(f"argument --env: cannot make {env_id!r}: {exc}") from None
    try:
        return env.observation_space, env.action_space
    finally:
        env.close()


def _check_policy(name: str, env_id: str, spaces) -> None:
    if name == "random":
        return
    import gymnasium as gym

    obs_space, action_space = spaces
    if not (isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) == 1) or not isinstance(
        action_space, gym.spaces.Discrete
    ):
        raise CliError(
            f"argument --policy: mlp needs a flat Box observation and a Discrete action space; "
            f"{env_id} has {obs_space} and {action_space}"
        )


def _make_policy(name: str, spaces, seed: int | None):
    if name == "random":
        return None
    import torch

    from rlcollect.nets import ArgmaxMLP

    obs_space, action_space = spaces
    if seed is not None:
        torch.manual_seed(seed)
    return ArgmaxMLP(obs_space.shape[0], int(action_space.n))


def _make_collector(args, policy):
    import rlcollect
    from rlcollect import GymEnv

    if args.envs_per_worker > 1:
        create_env = functools.partial(GymEnv, args.env, num_envs=args.envs_per_worker)
    else:
        create_env = args.env  # the collector wraps a gymnasium id in GymEnv itself
    kwargs = {"frames_per_batch": args.frames_per_batch, "total_frames": args.frames}
    if args.workers == 1 and args.mode == "sync":
        return rlcollect.Collector(create_env, policy, **kwargs)

    class_name = "MultiSyncCollector" if args.mode == "sync" else "MultiAsyncCollector"
    try:
        collector_class = getattr(rlcollect, class_name)
    except (AttributeError, ImportError):  # rlcollect imports its exports lazily
        collector_class = None
    if collector_class is None:
        what = "--workers > 1" if args.workers > 1 else "--mode async"
        raise CliError(f"{what} needs the multi-process collectors (not available in this version)")
    return collector_class([create_env] * args.workers, policy, **kwargs)


def _describe(args) -> str:
    return (
        f"{args.env}, {args.workers} worker(s) x {args.envs_per_worker} env(s), {args.mode}, "
        f"{args.policy} policy, {args.frames} frames in batches of {args.frames_per_batch}"
    )


def _loggers(args) -> list:
    """The loggers asked for (``--tensorboard``, ``--wandb``, ``--mlflow``), in that order."""
    from rlcollect import loggers

    made = []
    wanted = [("--tensorboard", args.tensorboard, loggers.TensorBoardLogger),
              ("--wandb", args.wandb, loggers.WandbLogger), ("--mlflow", args.mlflow, loggers.MLflowLogger)]
    try:
        for option, value, logger_class in wanted:
            if value is not None:
                try:
                    made.append(logger_class(value))
                except (ImportError, OSError, ValueError) as exc:
                    raise CliError(f"argument {option}: {exc}") from None
    except BaseException:
        _close(made)
        raise
    return made


def _close(loggers: list) -> None:
    for logger in loggers:
        logger.close()


def _check_out(path: str | None) -> None:
    """``--out DIR`` must be a new or empty folder: a buffer already there would be reopened
    (and, of another size, refused only after the first batch)."""
    if path is None:
        return
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise CliError(f"argument --out: {path!r} is not a new or empty folder (it would hold the collected frames)")


def _replay_buffer(path: str, capacity: int):
    from rlcollect import ReplayBuffer

    return ReplayBuffer(capacity, storage="memmap", path=path)


class StartupLog:
    """The start-up phases of ``collect``, each logged at INFO as it begins, with the seconds so
    far: the seconds before the first batch (imports, workers that import torch in turn, the
    envs) are not silent.

    Args:
        phases: how many phases there are (shown as ``i/phases``).
    """

    def __init__(self, phases: int):
        self.phases = phases
        self.begun = 0
        self.started = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def begin(self, what: str) -> None:
        self.begun += 1
        log.info("start-up %d/%d: %s (%.1f s so far)", self.begun, self.phases, what, self.elapsed)


def _logged_beside(progress, batches):
    """``batches``, while log records are written above the progress bar, not into it."""
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[logging.getLogger("rlcollect")], tqdm_class=type(progress)):
        yield from batches


@contextlib.contextmanager
def _log_to_stderr(level: str):
    """rlcollect's log records (the library's and this command's) on stderr while the command
    runs; the handler is removed afterwards, as ``main()`` may be called within a program."""
    package = logging.getLogger("rlcollect")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    previous = package.level
    package.setLevel(level)
    package.addHandler(handler)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(previous)


def run_collect(args) -> int:
    from tqdm import tqdm

    started = time.perf_counter()
    _check_out(args.out)
    # The env id is checked before torch and tensordict are imported (seconds, more on a
    # loaded machine): a mistyped --env answers in a fraction of a second, in one line.
    spaces = _probe_env(args.env)
    _check_policy(args.policy, args.env, spaces)
    log.info("collecting %s", _describe(args))
    with_loggers = any(option is not None for option in (args.tensorboard, args.wandb, args.mlflow))
    startup = StartupLog(phases=4 if with_loggers else 3)
    # Batches are TensorDicts, which rlcollect imports only when the first one is built:
    # import it now so that its seconds count as start-up, not as collection time.
    startup.begin("importing torch and tensordict")
    import tensordict  # noqa: F401

    policy = _make_policy(args.policy, spaces, args.seed)
    if with_loggers:
        startup.begin("opening the loggers")
    loggers = _loggers(args)  # before the collector: a missing package fails before any worker starts
    try:
        many = args.workers > 1 or args.mode == "async"
        startup.begin(f"starting {args.workers} worker process(es)" if many else "making the env")
        collector = _make_collector(args, policy)
    except BaseException:
        _close(loggers)
        raise
    startup_s = time.perf_counter() - started
    startup.begin("waiting for the first batch")
    tracker = EpisodeTracker()
    frames = batches = saved = 0
    buffer = None
    progress = tqdm(
        total=args.frames,
        unit="frames",
        unit_scale=True,
        file=sys.stderr,
        disable=args.no_progress,
        dynamic_ncols=True,
    )
    try:
        if args.seed is not None:
            collector.set_seed(args.seed)
        start = time.perf_counter()
        for batch in _logged_beside(progress, collector):
            if batches == 0:
                log.info("first batch after %.1f s; collecting", startup.elapsed)
                # The batch may hold a few frames more than asked (whole time steps of every env).
                progress.total = math.ceil(args.frames / args.frames_per_batch) * batch.numel()
                if args.out is not None:
                    buffer = _replay_buffer(args.out, progress.total)
            frames += batch.numel()
            batches += 1
            tracker.update(batch)
            if buffer is not None:
                buffer.extend(batch.reshape(-1))
                saved += batch.numel()
            progress.update(batch.numel())
            for logger in loggers:
                logger.log(collector)
        seconds = time.perf_counter() - start
    finally:
        progress.close()
        collector.shutdown()
        _close(loggers)
        if buffer is not None:
            buffer.close()

    mean = tracker.mean_return
    rows = [
        ("run", _describe(args)),
        ("frames", f"{frames}"),
        ("batches", f"{batches}"),
        ("start-up seconds", f"{startup_s:.2f}"),
        ("seconds", f"{seconds:.2f}"),
        ("frames/s", f"{frames / seconds:,.0f}" if seconds > 0 else "-"),
        ("episodes finished", f"{len(tracker.returns)}"),
        ("mean episode return", f"{mean:.2f}" if mean is not None else "- (no episode finished)"),
    ]
    for option in ("tensorboard", "wandb", "mlflow"):
        if getattr(args, option) is not None:
            rows.append((option, getattr(args, option)))
    if buffer is not None:
        rows.append(("out", f"{args.out}: {saved} frames, read back with "
                            f"ReplayBuffer({buffer.capacity}, storage='memmap', path={args.out!r})"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0


# -- node --------------------------------------------------------------------------------------
def run_node_command(args) -> int:
    from rlcollect.distributed.launch.node_args import node_arguments

    try:
        kwargs = node_arguments(args)  # before the node's imports: a bad option answers at once
    except ValueError as exc:
        raise CliError(f"node: {exc}") from None
    from rlcollect.distributed.node import configure_logging, run_node

    configure_logging(kwargs["rank"])
    return run_node(**kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``rlcollect`` command; returns its exit code (130 after Ctrl-C). Called without
    ``argv`` (as the installed command is), an interrupted run exits at once with 130."""
    run_as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        if argv[:1] == ["bench"]:  # not a command of the installed package: say where it went
            raise CliError(BENCH_MOVED)
        args = parser.parse_args(argv)
        if args.command == "node":
            return run_node_command(args)
        with _log_to_stderr(args.log_level):
            return run_collect(args)
    except CliError as exc:
        parser.exit(2, f"{PROG}: error: {exc}\n")
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        if run_as_program:
            # Everything the run started has been shut down by now; the interpreter's teardown
            # (seconds with torch loaded, on a busy machine) is all that is left: skip it, all
            # but the removal of multiprocessing's temp dir, which that teardown would do.
            remove_multiprocessing_temp_dir()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130


if __name__ == "__main__":
    sys.exit(main())
