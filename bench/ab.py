"""Before/after benchmark of a change: the same rows measured in two checkouts, alternated.

    git worktree add /tmp/before <REV>          # the code before the change
    python -m bench.ab --before /tmp/before --after . [--rows ROW,ROW] [--rounds 5] [--seconds 6]

A refactor that must not slow anything (issue 37: "behaviour unchanged ... no row slower") is
judged on a machine whose speed swings by +-30% between minutes: so each row is measured in both
checkouts in turn, ``before after`` in odd rounds and ``after before`` in even ones, each
measurement in a fresh interpreter (``PYTHONPATH`` and working directory: that checkout, so its
``rlcollect`` and its ``bench`` measure), and the figures are compared pair by pair: the ratio
after/before of each round, then their median. Rows (``--rows``, default all):

- ``cartpole-sync``, ``cartpole-async``: ``MultiSyncCollector``/``MultiAsyncCollector``, 2
  workers x 1 CartPole-v1, random actions (the suite's rows of that name, ``bench/multi.py``);
- ``cartpole-mlp8-sync``, ``cartpole-mlp8-async``: the same with 8 envs per worker and the 2x64 MLP;
- ``pong-sync``, ``pong-async``: Pong, 2 workers x 4 envs, random actions (``bench/real.py``'s rows).

Each measurement prints frames (or env steps) per second, the CPU seconds of every process per
1,000 frames, and, for the CartPole rows, the main process's CPU milliseconds per batch. The
table gives each figure's median over the rounds for both checkouts, and the median and range of
the paired ratios. It measures; it does not judge.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Sequence

from bench.measure import run_json

#: The code one measurement runs, in the checkout measured (``{row}``, ``{seconds}`` filled in).
_MEASURE = """
import json, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
row, seconds = {row!r}, {seconds!r}
if row.startswith("cartpole"):
    from bench.multi import multi_cartpole_config
    mode = row.rsplit("-", 1)[1]
    envs, mlp = (8, True) if "mlp8" in row else (1, False)
    fpb = {{("sync", 1): 2000, ("async", 1): 1000, ("sync", 8): 2048, ("async", 8): 1024}}[(mode, envs)]
    rate = multi_cartpole_config(mode, 2, envs, mlp, fpb).collector(seconds)
    out = {{"fps": rate.frames_per_s, "cpu_per_kframe": rate.cpu_per_kframe,
            "main_ms_per_batch": rate.main_cpu_ms_per_batch}}
else:
    from bench.real import key, measure
    got = measure(key("multisync" if row.endswith("sync") and not row.endswith("async") else "multiasync",
                      "Pong", "random"), seconds)
    out = {{"fps": got["steps_per_s"], "cpu_per_kframe": got.get("cpu_per_kstep")}}
print(json.dumps(out), flush=True)
"""

ROWS = ("cartpole-sync", "cartpole-async", "cartpole-mlp8-sync", "cartpole-mlp8-async", "pong-sync", "pong-async")
FIGURES = ("fps", "cpu_per_kframe", "main_ms_per_batch")


def measure(tree: str, row: str, seconds: float, timeout: float = 600.0) -> dict:
    """One measurement of ``row`` in checkout ``tree``, in a fresh interpreter."""
    return run_json([sys.executable, "-c", _MEASURE.format(row=row, seconds=seconds)], timeout, cwd=tree,
                    env={**os.environ, "PYTHONPATH": tree}, label=f"{row} in {tree}")


def order(round_index: int) -> tuple[str, str]:
    """Which checkout goes first in round ``round_index`` (0-based): before first in even ones."""
    return ("before", "after") if round_index % 2 == 0 else ("after", "before")


def summarize(measurements: list[dict]) -> list[dict]:
    """Per row and figure: the median before and after, and the paired ratios after/before
    (one per round where both checkouts measured). ``measurements``: dicts with ``row``,
    ``round``, ``side`` (``"before"``/``"after"``) and the figures."""
    rows: list[dict] = []
    for row in dict.fromkeys(m["row"] for m in measurements):
        mine = [m for m in measurements if m["row"] == row]
        for figure in FIGURES:
            by_round: dict[int, dict[str, float]] = {}
            for m in mine:
                if m.get(figure) is not None:
                    by_round.setdefault(m["round"], {})[m["side"]] = m[figure]
            before = [r["before"] for r in by_round.values() if "before" in r]
            after = [r["after"] for r in by_round.values() if "after" in r]
            ratios = [r["after"] / r["before"] for r in by_round.values() if len(r) == 2 and r["before"]]
            if not before and not after:
                continue
            rows.append({
                "row": row, "figure": figure, "rounds": len(ratios),
                "before": statistics.median(before) if before else None,
                "after": statistics.median(after) if after else None,
                "ratio": statistics.median(ratios) if ratios else None,
                "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None,
            })
    return rows


def format_table(rows: list[dict]) -> str:
    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:,.3f}" if abs(v) < 10 else f"{v:,.0f}"

    head = f"{'row':<22} {'figure':<18} {'before':>10} {'after':>10} {'after/before':>13} {'range':>13} rounds"
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = "-" if r["ratio_min"] is None else f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
        lines.append(f"{r['row']:<22} {r['figure']:<18} {num(r['before']):>10} {num(r['after']):>10} "
                     f"{num(r['ratio']):>13} {spread:>13} {r['rounds']:>6}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, metavar="PATH", help="the checkout before the change")
    parser.add_argument("--after", required=True, metavar="PATH", help="the checkout after the change")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)} (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default: 5)")
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds each measurement counts (default: 6)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every measurement to this file")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        parser.error(f"--rows {args.rows!r}: unknown {unknown or 'empty'}; accepted: {', '.join(ROWS)}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.seconds <= 0:
        parser.error(f"--seconds must be positive, got {args.seconds}")
    trees = {}
    for side in ("before", "after"):
        path = os.path.abspath(getattr(args, side))
        if not os.path.isdir(os.path.join(path, "rlcollect")) or not os.path.isdir(os.path.join(path, "bench")):
            parser.error(f"--{side} {getattr(args, side)!r} is not a checkout of rlcollect "
                         "(no rlcollect/ and bench/ in it)")
        trees[side] = path
    measurements: list[dict] = []
    started = time.perf_counter()
    for i in range(args.rounds):
        for row in rows:
            for side in order(i):
                load = os.getloadavg()[0]
                try:
                    got = measure(trees[side], row, args.seconds)
                except RuntimeError as err:
                    print(f"round {i + 1} {row} {side}: failed: {err}", file=sys.stderr, flush=True)
                    continue
                measurements.append({"row": row, "round": i, "side": side, "load": load, **got})
                print(f"round {i + 1}/{args.rounds} {row} {side}: {got['fps']:,.0f} frames/s (load {load:.1f})",
                      file=sys.stderr, flush=True)
    loads = [m["load"] for m in measurements]
    print(f"bench.ab: before {trees['before']}, after {trees['after']}; {args.rounds} rounds alternated, "
          f"{args.seconds:g} s per measurement; load average {min(loads, default=0):.1f}-{max(loads, default=0):.1f}; "
          f"{(time.perf_counter() - started) / 60:.1f} min")
    print(format_table(summarize(measurements)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"before": trees["before"], "after": trees["after"], "measurements": measurements}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
