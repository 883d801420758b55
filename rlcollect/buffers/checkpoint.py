"""Checkpoints of a ``ReplayBuffer``: ``state_dict()`` / ``load_state_dict()`` (a mixin, so that
replay.py keeps to the ring itself)."""

from __future__ import annotations

import os
from typing import Any

import torch

from rlcollect.buffers.storage import ALLOCATED, CURSOR, SIZE, WRITE_COUNT, Layout

_STATE_VERSION = 1


class Checkpointing:
    """Mixin of :class:`~rlcollect.buffers.replay.ReplayBuffer`."""

    def state_dict(self) -> dict[str, Any]:
        """The counters, plus the frames themselves (``"memory"``) or the path (``"memmap"``).

        Take it while no process writes (collectors paused): frames in flight are recorded as
        invalid and never sampled after loading.  For memmap storage, reopening the same path
        with a new ``ReplayBuffer(..., storage="memmap", path=...)`` and loading the state gives
        back the same frames.

        Example:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from rlcollect import ReplayBuffer
            >>> rb = ReplayBuffer(4)
            >>> _ = rb.extend(TensorDict({"x": torch.arange(3)}, [3]))
            >>> other = ReplayBuffer(4)
            >>> other.load_state_dict(rb.state_dict())
            >>> len(other), other[:]["x"].tolist()
            (3, [0, 1, 2])
            >>> rb.close(); other.close()
        """
        self._check_open()
        region = self._data_region()
        with region.lock():
            header = region.header
            state: dict[str, Any] = {
                "version": _STATE_VERSION,
                "storage": self._storage,
                "capacity": self._capacity,
                "cursor": int(header[CURSOR]),
                "size": int(header[SIZE]),
                "write_count": int(header[WRITE_COUNT]),
                "layout": None if region.layout is None else region.layout.to_json(),
            }
            size = state["size"]
            if self._storage == "memmap":
                region.flush()
                state["path"] = self._directory
            elif region.attached:
                state["valid"] = torch.from_numpy((region.seq[:size] & 1) == 0).clone()
                state["data"] = [region.tensors[f.key][:size].clone() for f in region.layout.fields]
            else:
                state["valid"], state["data"] = torch.zeros(0, dtype=torch.bool), []
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises ValueError (and changes nothing) if ``state`` is malformed or belongs to a buffer
        of another storage, capacity, layout or (memmap) path.

        Example:
            >>> import shutil, tempfile, torch
            >>> from tensordict import TensorDict
            >>> from rlcollect import ReplayBuffer
            >>> d = tempfile.mkdtemp()
            >>> rb = ReplayBuffer(4, storage="memmap", path=d)
            >>> _ = rb.extend(TensorDict({"x": torch.arange(3)}, [3]))
            >>> state = rb.state_dict(); rb.close()
            >>> again = ReplayBuffer(4, storage="memmap", path=d)
            >>> again.load_state_dict(state)
            >>> len(again), again.write_count
            (3, 3)
            >>> again.close(); shutil.rmtree(d)
        """
        self._check_open()
        layout = self._check_state(state)
        region = self._data_region()
        if region.attached and layout is not None and region.layout.signature() != layout.signature():
            raise ValueError(
                "load_state_dict: the state's layout does not match this buffer's: " + region.layout.difference(layout)
            )
        if self._storage == "memmap":
            if layout is not None and not region.attached:
                raise ValueError(f"load_state_dict: {self._directory} holds no frames, but the state has a layout")
        else:
            self._check_memory_data(state, layout)
        with self._local, region.lock():
            header = region.header
            if self._storage == "memory" and layout is not None:
                if not region.attached:
                    if header[ALLOCATED]:
                        region.attach()  # another process allocated it meanwhile
                        if region.layout.signature() != layout.signature():
                            raise ValueError(
                                "load_state_dict: the state's layout does not match this buffer's: "
                                + region.layout.difference(layout)
                            )
                    else:
                        region.allocate(Layout.build(layout.signature(), self._capacity))
                size = state["size"]
                for f, value in zip(layout.fields, state["data"]):
                    region.tensors[f.key][:size].copy_(value)
                valid = state["valid"].numpy()
                seq = region.seq[:size]
                seq += 1 + (seq & 1)  # odd: readers that raced with us redraw
                seq[valid] += 1  # even: complete
                region.owner[:size][~valid] = 0
            header[CURSOR] = state["cursor"]
            header[SIZE] = state["size"]
            header[WRITE_COUNT] = state["write_count"]

    def _check_state(self, state: Any) -> Layout | None:
        if not isinstance(state, dict):
            raise ValueError(f"load_state_dict expects a dict from state_dict(), got {type(state).__name__}")
        required = ("version", "storage", "capacity", "cursor", "size", "write_count", "layout")
        if missing := [k for k in required if k not in state]:
            raise ValueError(f"load_state_dict: the state lacks {missing}; is it from ReplayBuffer.state_dict()?")
        if state["version"] != _STATE_VERSION:
            raise ValueError(f"load_state_dict: state version {state['version']!r} is not supported ({_STATE_VERSION})")
        if state["storage"] != self._storage:
            raise ValueError(
                f"load_state_dict: the state is of storage={state['storage']!r}, this buffer's is {self._storage!r}"
            )
        if state["capacity"] != self._capacity:
            raise ValueError(
                f"load_state_dict: the state is of capacity={state['capacity']}, this buffer's is {self._capacity}"
            )
        for name in ("cursor", "size", "write_count"):
            if not isinstance(state[name], int) or state[name] < 0:
                raise ValueError(f"load_state_dict: {name} must be a non-negative int, got {state[name]!r}")
        if state["cursor"] >= self._capacity or state["size"] > min(self._capacity, state["write_count"]):
            raise ValueError(
                f"load_state_dict: inconsistent counters cursor={state['cursor']} size={state['size']} "
                f"write_count={state['write_count']} for capacity {self._capacity}"
            )
        if self._storage == "memmap":
            given = state.get("path")
            if not isinstance(given, str) or os.path.realpath(given) != os.path.realpath(self._directory):
                raise ValueError(
                    f"load_state_dict: the state is of the memmap buffer at {given!r}; this buffer is at "
                    f"{self._directory!r} (open ReplayBuffer(..., storage='memmap', path={given!r}) to reload it)"
                )
        try:
            return None if state["layout"] is None else Layout.from_json(state["layout"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"load_state_dict: malformed layout: {e}") from None

    def _check_memory_data(self, state: dict, layout: Layout | None) -> None:
        size = state["size"]
        data, valid = state.get("data"), state.get("valid")
        if layout is None:
            if size:
                raise ValueError("load_state_dict: the state has frames but no layout")
            return
        if not isinstance(data, list | tuple) or len(data) != len(layout.fields):
            raise ValueError(f"load_state_dict: 'data' must be a list of {len(layout.fields)} tensors")
        if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.shape != (size,):
            raise ValueError(f"load_state_dict: 'valid' must be a bool tensor of shape ({size},)")
        for f, value in zip(layout.fields, data):
            if not isinstance(value, torch.Tensor) or value.dtype != f.dtype or tuple(value.shape) != (size, *f.shape):
                got = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"load_state_dict: data for {f.key} must be {(size, *f.shape)} {f.dtype}, got {got}")
