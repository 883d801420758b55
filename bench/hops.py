"""Count the main-process hops of one multi-process or distributed batch (docs/architecture.md's figure).

A *hop* is a change of package file along the ``sys.setprofile`` call and return events of the
thread that yields the batch, from the iterator's resume to its yield (Python functions only;
files outside ``rlcollect/`` are skipped, so a call into torch and back is not a hop). The
batch counted is the fourth of ``MultiSyncCollector("CartPole-v1", num_workers=2,
frames_per_batch=200, mp_start_method="fork")`` (steady state: slots settled, nothing lent).

``--collector distributed`` counts the same for ``DistributedCollector(["CartPole-v1"] * 2,
frames_per_batch=200, sync=True)`` (its "mp" launcher: two local node processes).

Run: ``python -m bench.hops`` (prints the count, the distinct files, how many hops are returns,
and the sequence; ``--collector async`` for ``MultiAsyncCollector``, ``--runs N`` to repeat).
"""

from __future__ import annotations

import argparse
import os
import sys

import rlcollect

PACKAGE = os.path.dirname(os.path.abspath(rlcollect.__file__)) + os.sep


def _relative(path: str) -> str | None:
    return path[len(PACKAGE):] if path.startswith(PACKAGE) else None


def _build(collector_cls: type):
    if issubclass(collector_cls, rlcollect.DistributedCollector):
        return collector_cls(["CartPole-v1"] * 2, frames_per_batch=200, total_frames=-1, sync=True)
    return collector_cls("CartPole-v1", num_workers=2, frames_per_batch=200, total_frames=-1, mp_start_method="fork")


def count_hops(collector_cls: type, batch_index: int = 3, functions: bool = False,
               returns: list[tuple[str, bool]] | None = None) -> list[str]:
    """The sequence of package files the main thread passes through for batch ``batch_index``
    (0-based) of a fresh ``collector_cls`` (hops = ``len(sequence) - 1``); ``functions``: each
    file with the functions that ran in it on that visit. ``returns``: a list that gets the same
    walk with every return counted, each a ``(file, entered by a return)`` pair: a file returned
    to that runs no Python call before the next hop is invisible to the sequence (a hop counted
    from events), not to this one."""
    collector = _build(collector_cls)
    sequence: list[str] = []
    visits: list[list[str]] = []
    walk: list[tuple[str, bool]] = []

    def enter(name: str, by_return: bool) -> None:
        if not walk or walk[-1][0] != name:
            walk.append((name, by_return))

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
        if event == "call":
            enter(name, False)
        elif frame.f_back is not None and (caller := _relative(frame.f_back.f_code.co_filename)) is not None:
            enter(caller, True)

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
    if returns is not None:
        returns[:] = walk
    if functions:
        return [f"{name}({','.join(names)})" for name, names in zip(sequence, visits)]
    return sequence


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collector", choices=("sync", "async", "distributed"), default="sync")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--functions", action="store_true", help="name the functions called on each visit")
    args = parser.parse_args(argv)
    cls = {"sync": rlcollect.MultiSyncCollector, "async": rlcollect.MultiAsyncCollector,
           "distributed": rlcollect.DistributedCollector}[args.collector]
    for run in range(args.runs):
        walk: list[tuple[str, bool]] = []
        sequence = count_hops(cls, functions=args.functions, returns=walk)
        files = len({name.split("(")[0] for name in sequence})
        print(f"{cls.__name__}, run {run + 1}: {len(sequence) - 1} main-process hops, {files} distinct files; "
              f"with every return counted {len(walk) - 1} hops, {sum(r for _, r in walk[1:])} of them returns")
        print("  " + " > ".join(sequence))


if __name__ == "__main__":
    main()
