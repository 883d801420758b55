"""Count the main-process hops of one multi-process batch (docs/architecture.md's figure).

A *hop* is a change of package file along the ``sys.setprofile`` call and return events of the
thread that yields the batch, from the iterator's resume to its yield (Python functions only;
files outside ``rlcollect/`` are skipped, so a call into torch and back is not a hop). The
batch counted is the fourth of ``MultiSyncCollector("CartPole-v1", num_workers=2,
frames_per_batch=200, mp_start_method="fork")`` (steady state: slots settled, nothing lent).

Run: ``python -m bench.hops`` (prints the count and the sequence; ``--collector async`` for
``MultiAsyncCollector``, ``--runs N`` to repeat).
"""

from __future__ import annotations

import argparse
import os
import sys

import rlcollect

PACKAGE = os.path.dirname(os.path.abspath(rlcollect.__file__)) + os.sep


def _relative(path: str) -> str | None:
    return path[len(PACKAGE):] if path.startswith(PACKAGE) else None


def count_hops(collector_cls: type, batch_index: int = 3, functions: bool = False) -> list[str]:
    """The sequence of package files the main thread passes through for batch ``batch_index``
    (0-based) of a fresh ``collector_cls`` (hops = ``len(sequence) - 1``); ``functions``: each
    file with the functions that ran in it on that visit."""
    collector = collector_cls("CartPole-v1", num_workers=2, frames_per_batch=200, total_frames=-1,
                              mp_start_method="fork")
    sequence: list[str] = []
    visits: list[list[str]] = []

    def profile(frame, event, arg):  # noqa: ARG001 - setprofile's signature
        if event not in ("call", "return"):
            return
        name = _relative(frame.f_code.co_filename)
        if name is None:
            return
        if not sequence or sequence[-1] != name:
            sequence.append(name)
            visits.append([])
        if event == "call" and frame.f_code.co_name not in visits[-1]:
            visits[-1].append(frame.f_code.co_name)

    try:
        iterator = iter(collector)
        for _ in range(batch_index):
            next(iterator)
        sys.setprofile(profile)
        try:
            next(iterator)
        finally:
            sys.setprofile(None)
    finally:
        collector.shutdown()
    if functions:
        return [f"{name}({','.join(names)})" for name, names in zip(sequence, visits)]
    return sequence


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collector", choices=("sync", "async"), default="sync")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--functions", action="store_true", help="name the functions called on each visit")
    args = parser.parse_args(argv)
    cls = rlcollect.MultiSyncCollector if args.collector == "sync" else rlcollect.MultiAsyncCollector
    for run in range(args.runs):
        sequence = count_hops(cls, functions=args.functions)
        print(f"{cls.__name__}, run {run + 1}: {len(sequence) - 1} main-process hops")
        print("  " + " > ".join(sequence))


if __name__ == "__main__":
    main()
