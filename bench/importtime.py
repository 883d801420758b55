"""What rlcollect adds to a program's start-up, over its dependencies: ``python -m bench.importtime``.

Each round runs fresh interpreters (the OS file cache is warm after the first):

- ``deps``: ``import torch, tensordict, gymnasium`` (what any rlcollect program pays first);
- ``rlcollect``: the same, then ``from rlcollect import Collector``; ``python -X importtime``
  attributes every module imported after the dependencies to rlcollect's import (its own
  modules and whatever they pull in), summed over the top-level imports;
- ``first batch``: after those imports, ``Collector("CartPole-v1", frames_per_batch=1000)`` and
  its first batch (the env, the policy runner, the rollout's buffers, the first TensorDict).

The table gives the best (smallest) of the rounds in ms, the number of modules rlcollect's import
adds (a figure the machine's load does not move), and the five modules of rlcollect's
import that cost most (cumulative, in the best round). Nothing here is timed in a test: the
figures go in docs/benchmarks.md with the date, machine and load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

DEPS = "import torch, tensordict, gymnasium"
LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)$")

_FIRST_BATCH = """
import json, time
{deps}
from rlcollect import Collector
start = time.perf_counter()
collector = Collector("CartPole-v1", frames_per_batch=1000, total_frames=1000)
next(iter(collector))
elapsed = time.perf_counter() - start
collector.shutdown()
print(json.dumps({{"first_batch_s": elapsed}}))
"""


def parse(stderr: str) -> list[tuple[int, int, int, str]]:
    """``(self_us, cumulative_us, depth, module)`` for every line of ``-X importtime`` output."""
    out = []
    for line in stderr.splitlines():
        match = LINE.match(line)
        if match:
            self_us, cumulative, indent, name = match.groups()
            out.append((int(self_us), int(cumulative), len(indent) // 2, name))
    return out


def added_after(entries: list[tuple[int, int, int, str]], last_dependency: str) -> tuple[int, list[tuple[int, str]]]:
    """What was imported after the top-level import of ``last_dependency``: the sum of the
    cumulative times of the top-level imports that follow it (µs), and every module imported
    then with its cumulative time, costliest first. ``-X importtime`` prints a module after the
    modules it imported, so "after" is "below its line"."""
    tops = [i for i, (_, _, depth, name) in enumerate(entries) if depth == 0 and name == last_dependency]
    if not tops:
        raise ValueError(f"{last_dependency!r} is not imported at the top level in this output")
    rest = entries[tops[0] + 1:]
    total = sum(cumulative for _, cumulative, depth, _ in rest if depth == 0)
    modules = sorted(((cumulative, name) for _, cumulative, _, name in rest), reverse=True)
    return total, modules


def _importtime(code: str) -> list[tuple[int, int, int, str]]:
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True,
                          timeout=600, check=True)
    return parse(proc.stderr)


def measure_round() -> dict:
    deps = _importtime(DEPS)
    deps_us = sum(cumulative for _, cumulative, depth, _ in deps if depth == 0)
    both = _importtime(f"{DEPS}\nfrom rlcollect import Collector")
    added_us, modules = added_after(both, "gymnasium")
    first = subprocess.run([sys.executable, "-c", _FIRST_BATCH.format(deps=DEPS)], capture_output=True, text=True,
                           timeout=600, check=True)
    return {"deps_ms": deps_us / 1e3, "rlcollect_ms": added_us / 1e3, "modules": len(modules),
            "top": [(c / 1e3, n) for c, n in modules[:5]],
            "first_batch_ms": json.loads(first.stdout.splitlines()[-1])["first_batch_s"] * 1e3,
            "load": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="fresh interpreters per row (default 3)")
    args = parser.parse_args(argv)
    rounds = [measure_round() for _ in range(args.rounds)]
    best = {key: min(r[key] for r in rounds) for key in ("deps_ms", "rlcollect_ms", "first_batch_ms")}
    top = min(rounds, key=lambda r: r["rlcollect_ms"])["top"]
    loads = ", ".join(f"{r['load']:.1f}" for r in rounds)
    print(f"best of {args.rounds} rounds; 1-minute load average {loads}")
    print("| what | ms |\n|---|---:|")
    print(f"| `{DEPS}` | {best['deps_ms']:,.0f} |")
    print(f"| then `from rlcollect import Collector` (what rlcollect adds: {rounds[0]['modules']} modules) | "
          f"{best['rlcollect_ms']:,.0f} |")
    print(f"| then `Collector(\"CartPole-v1\", frames_per_batch=1000)` to its first batch | "
          f"{best['first_batch_ms']:,.0f} |")
    print("costliest modules of rlcollect's import (cumulative ms): "
          + ", ".join(f"{name} {ms:.1f}" for ms, name in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
