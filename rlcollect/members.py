"""What both wings' member control shares: a member is a worker process (``multiprocess/``) or a
node (``distributed/``), and each wing's ``recovery.py`` replaces a failed one.

- ``replacement_seed``: the seed of a member's replacement, derived once for both wings.
"""

from __future__ import annotations

#: Seeds of replaced members: generation ``g`` of a member seeded with ``s`` starts from
#: ``s + g * SEED_STRIDE`` (a prime: the generations' seeds stay apart from the members' own,
#: which the collectors space by 1).
SEED_STRIDE = 7919


def replacement_seed(seed: int, generation: int) -> int:
    """The seed of generation ``generation`` (1 for the first replacement) of a member seeded
    with ``seed``.

    Example:
        >>> replacement_seed(100, 1), replacement_seed(100, 2)
        (8019, 15938)
    """
    return seed + SEED_STRIDE * generation
