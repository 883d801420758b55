"""rlcollect's benchmark suite (SPEC section 12).

Run it with ``python -m bench`` (or ``make bench``, or ``rlcollect bench``). For every
configuration it measures, in the same run, the ideal rate (a bare loop doing only the
unavoidable work: stepping the simulator and calling the policy) and the collector's rate, and
prints both with their ratio and the collector's overhead per frame. Multi-process
configurations also run one bare loop per worker at once (what the machine gives now), and the
start-up of a multi-process collector is timed in fresh interpreters. With
``--torchrl-python PATH`` torchrl's collectors are measured on the same configurations, in the
same rounds, by ``bench/torchrl_side.py`` running under that interpreter. The real workloads
(``--only Pong``, ``--only HalfCheetah``: ``bench/real.py``) compare rlcollect's collectors with
bare loops at once, gymnasium's ``AsyncVectorEnv``, SB3's ``SubprocVecEnv``, EnvPool and
torchrl, with the main process's memory and /dev/shm.
"""

__all__ = ["main"]


def main(argv=None) -> int:
    """``python -m bench``'s entry point (imported when called: ``bench/torchrl_side.py``
    imports ``bench.workloads`` under torchrl's interpreter, where rlcollect is not needed)."""
    from bench.suite import main as run

    return run(argv)
