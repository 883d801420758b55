"""Draw several learning curves (the CSVs the examples write next to their PNG) in one figure.

    .venv/bin/python examples/plot_curves.py docs/ppo_cartpole_seed*.csv --out docs/ppo_cartpole.png \
        --title "PPO on CartPole-v1" --target 475
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", nargs="+", help="curves written by an example (frames, mean_return, ...)")
    parser.add_argument("--out", required=True, help="PNG to write")
    parser.add_argument("--title", default="")
    parser.add_argument("--target", type=float, default=None, help="draw a horizontal line at this return")
    args = parser.parse_args()

    fig, ax = plt.subplots(figsize=(7, 4))
    for path in args.csv:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
        # markers: a batch between two without a finished episode (NaN) has no line to draw
        ax.plot([int(r["frames"]) for r in rows], [float(r["mean_return"]) for r in rows], marker=".",
                label=Path(path).stem)
    if args.target is not None:
        ax.axhline(args.target, color="grey", linestyle="--", linewidth=1, label=f"{args.target:g}")
    ax.set(xlabel="frames", ylabel="mean episode return", title=args.title)
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
