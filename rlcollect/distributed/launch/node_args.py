"""The options of ``rlcollect node`` (and ``python -m rlcollect.distributed.node``) and their
defaults; torchrun's environment variables fill the ones not given.

Only the standard library and ``auth.py`` are imported here: the ``rlcollect`` command builds
its parser from this module, and ``rlcollect --help`` or a bad option must answer without
importing torch (seconds).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from rlcollect.distributed.control.auth import SECRET_ENV, read_secret_file

#: torchrun's names, read when the options are not given.
ENV_VARS = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT", "rank": "RANK", "world_size": "WORLD_SIZE"}
#: The nodes' logging level (default INFO; the "mp" launcher sets WARNING for its nodes).
LOG_LEVEL_ENV = "RLCOLLECT_LOG_LEVEL"
#: Default of ``rank0_timeout``: a node whose rank 0 has not beaten this long gives it up.
RANK0_TIMEOUT_S = 60.0


def _env_default(name: str, convert=str):
    value = os.environ.get(ENV_VARS[name])
    return None if value is None else convert(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``rlcollect node`` (torchrun's environment variables fill the gaps).

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser)
        >>> args = parser.parse_args(["--rank", "1", "--world-size", "2"])
        >>> args.rank, args.world_size, args.timeout, args.rank0_timeout
        (1, 2, 300.0, 60.0)
    """
    parser.add_argument("--master-addr", default=None, help="rank 0's address (default: $MASTER_ADDR)")
    parser.add_argument("--master-port", type=int, default=None, help="rank 0's tcp_port (default: $MASTER_PORT)")
    parser.add_argument("--rank", type=int, default=None, help="this node's rank, 1..world size-1 (default: $RANK)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="rank 0 plus the nodes: num_nodes + 1 (default: $WORLD_SIZE)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for rank 0 and its configuration (default: %(default)s)")
    parser.add_argument("--secret-file", default=None,
                        help=f"a file (mode 600) holding the run's secret, the one rank 0 was given with "
                             f"secret_file=PATH; without it, the secret itself is read from ${SECRET_ENV} (the "
                             f"variable holds the secret, not a path)")
    parser.add_argument("--rank0-timeout", type=float, default=RANK0_TIMEOUT_S,
                        help="exit when rank 0 has not beaten for this many seconds (frozen or unreachable; "
                             "default: %(default)s)")


def node_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """``run_node``'s arguments from parsed options and the environment; ValueError names
    what is missing.

    Example:
        >>> parser = argparse.ArgumentParser()
        >>> add_arguments(parser)
        >>> node_arguments(parser.parse_args(["--rank", "0", "--master-addr", "h", "--master-port", "1",
        ...                                   "--world-size", "2"]))
        Traceback (most recent call last):
        ValueError: rank 0 is the DistributedCollector itself; nodes are ranks 1..world size-1
    """
    out = {
        "master_addr": args.master_addr or _env_default("master_addr"),
        "master_port": args.master_port if args.master_port is not None else _env_default("master_port", int),
        "rank": args.rank if args.rank is not None else _env_default("rank", int),
        "world_size": args.world_size if args.world_size is not None else _env_default("world_size", int),
        "timeout": args.timeout,
        "secret_file": args.secret_file,
        "rank0_timeout": args.rank0_timeout,
    }
    missing = [f"--{k.replace('_', '-')} (or ${ENV_VARS[k]})" for k in ENV_VARS if out[k] is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    if out["rank"] == 0:
        raise ValueError("rank 0 is the DistributedCollector itself; nodes are ranks 1..world size-1")
    if not out["rank0_timeout"] > 0:
        raise ValueError(f"--rank0-timeout must be a positive number of seconds, got {out['rank0_timeout']!r}")
    if out["secret_file"] is None and SECRET_ENV not in os.environ:
        raise ValueError(f"missing --secret-file PATH (or ${SECRET_ENV}): the run's secret, see docs/distributed.md")
    if out["secret_file"] is not None:
        read_secret_file(out["secret_file"])  # SecretError (a ValueError) names what is wrong
    return out
