"""``CentralInference``: what a multi-process collector with ``inference="central"`` holds.

It owns the inference loop (server.py) and the acting policy, and is what the collector asks
to start each worker's pipes, to lay out the shared block once the workers have reported their
slots, to take new weights (applied under the loop's lock, so the next forward uses them, with
the new version), and for the loop's statistics and the error the policy raised.

Example:
    >>> import torch
    >>> from rlcollect.multiprocess.shm import allocate_slot
    >>> central = CentralInference(torch.nn.Linear(4, 2), splits=2, device=None, exploration_type="random",
    ...                            allocate=allocate_slot)
    >>> central.set_weights({"weight": torch.ones(2, 4), "bias": torch.zeros(2)}, version=3)
    >>> central.version, central.policy.weight.sum().item()
    (3, 8.0)
    >>> central.close()
"""

from __future__ import annotations

from typing import Any

from rlcollect.inference.server import InferenceServer
from rlcollect.policy import has_weights, load_weights
from rlcollect.weights.local import acting_policy


class CentralInference:
    """The main process's side of central inference for one collector.

    Args:
        policy: the trainer's policy; it acts itself, or, when ``device`` is not where its
            weights are, a copy on ``device`` does (updated from it by ``update()``).
        splits: env splits per worker (``env_splits``).
        device: ``policy_device`` (None: the CPU, where the policy is).
        exploration_type, allocate, max_wait_us, compile_policy, trust_policy: see ``InferenceServer``.
    """

    def __init__(self, policy: Any, *, splits: int, device: Any, exploration_type: str, allocate: Any,
                 max_wait_us: float = 0.0, compile_policy: Any = None, trust_policy: bool | None = None):
        self.splits = splits
        self.policy, copied_from = acting_policy(policy, None, device)
        self.source = policy if copied_from is not None else None
        self.server = InferenceServer(self.policy, device=device, exploration_type=exploration_type,
                                      allocate=allocate, max_wait_us=max_wait_us, compile_policy=compile_policy,
                                      trust_policy=trust_policy)
        self.attachments: list[tuple] = []

    @property
    def version(self) -> int:
        return self.server.version

    @property
    def error(self) -> BaseException | None:
        return self.server.error

    @property
    def lock(self) -> Any:
        return self.server.lock

    def channels(self, context: Any):
        """``channels(index)`` for the ``WorkerPool``: the pipes of one start of a worker."""
        return lambda index: self.server.connect(index, self.splits, context)

    def attach(self, infos: list[dict]) -> None:
        """Lay out the shared block from the workers' reports (``info["inference"]``)."""
        self.attachments = self.server.allocate([info["inference"] for info in infos])

    @property
    def weight_spec(self) -> dict | None:
        if not has_weights(self.policy):
            return None
        return {k: (tuple(v.shape), v.dtype) for k, v in self.policy.state_dict().items()}

    def update(self, weights: Any, version: int) -> None:
        """New weights (None: the trainer's policy as it is now; a copy acting on another device
        takes them from it) and ``version``, from the next forward on."""
        with self.server.lock:
            if weights is None and self.source is not None:
                weights = self.source
            if weights is not None and has_weights(self.policy):
                load_weights(self.policy, weights)
            self.server.version = version

    def set_weights(self, state: Any, version: int) -> None:
        """An outer worker's or node's call (rlcollect/source.py): ``state`` (None: the acting
        module was written in place) with its owner's ``version``."""
        with self.server.lock:
            if state is not None and has_weights(self.policy):
                load_weights(self.policy, state)
            self.server.version = version

    def stats(self) -> dict:
        return self.server.stats()

    def close(self) -> None:
        self.server.stop()
        self.attachments = []
