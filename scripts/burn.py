"""Run a command with CPU-burning processes beside it: the loaded machine a contributor's CI runs on.

    python3 scripts/burn.py [--procs N] [--nice N] -- COMMAND [ARGS...]

starts N processes (default 6) that spin on the CPU, runs COMMAND, stops the burners and exits
with COMMAND's status. On a 2-core machine 6 burners hold the load average at 6 or more (each
burner is one runnable thread). `make test-loaded` is `make test` run this way (issue 25: the
suite must pass on a machine where other jobs run at load 6-25).

The burners run at nice 0 by default (as another user's jobs would); they exit when this script
ends, however it ends (they check their parent every 0.2 s), so none outlives it. Standard
library only: it runs before any venv exists.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time


def _burn(parent: int, niceness: int) -> None:
    os.nice(niceness)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the command; we end with it
    x = 0
    while True:
        next_check = time.monotonic() + 0.2
        while time.monotonic() < next_check:
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF
        if os.getppid() != parent:
            os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=6, help="burning processes (default 6)")
    parser.add_argument("--nice", type=int, default=0, help="their niceness (default 0)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run (after --)")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: python3 scripts/burn.py -- make test")
    if args.procs < 1:
        parser.error(f"--procs must be at least 1, got {args.procs}")
    ctx = mp.get_context("fork")
    burners = [ctx.Process(target=_burn, args=(os.getpid(), args.nice), daemon=True) for _ in range(args.procs)]
    for p in burners:
        p.start()
    print(f"burn.py: {args.procs} burners (nice {args.nice}) beside: {' '.join(command)}", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        rc = subprocess.call(command)
    except KeyboardInterrupt:
        rc = 130
    finally:
        for p in burners:
            p.kill()
        for p in burners:
            p.join()
    load = os.getloadavg()
    print(f"burn.py: {' '.join(command)} exited {rc} after {time.monotonic() - start:.0f} s; "
          f"load average now {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
