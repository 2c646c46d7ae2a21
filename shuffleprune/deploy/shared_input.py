"""Tensors computed once from an input and read by several layers: :class:`InputShared` and its
:class:`SharedGather`, the one gathered input ``x[..., perm]`` of the layers reading one tensor through one
index map."""
from __future__ import annotations

from collections.abc import Callable

import torch


class InputShared:
    """A tensor computed once from an input and shared by ``members`` readers while the input is the
    same object, unmodified; let go once every member has read it (0 members: kept until the next
    input), so no cache outlives its use (peak memory; a CUDA graph pool's tensors held by Python
    state are what ``torch.compile``'s CUDA graphs refuse)."""

    def __init__(self, members: int = 0) -> None:
        self.members = members
        self.release()

    def get(self, x: torch.Tensor, reader: int, compute: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``compute(x)``, computed at the first read of ``x`` (``reader``: who reads, by id)."""
        if x is not self._source or x._version != self._version:   # held, so its memory cannot be reused
            self._source, self._version, self._value, self._readers = x, x._version, compute(x), set()
        value = self._value
        self._readers.add(reader)
        if len(self._readers) == self.members:   # every member has read it
            self.release()
        return value

    def release(self) -> None:
        """Let go of the input and the computed tensor."""
        self._source: torch.Tensor | None = None
        self._version = -1
        self._value: torch.Tensor | None = None
        self._readers: set[int] = set()


class SharedGather(InputShared):
    """One gathered input ``x[..., perm]`` shared by the layers of a group that read the same input
    through the same index map (q/k/v, gate/up): the first layer gathers (:meth:`get` with its gather),
    the others reuse it while the input tensor is the same object, unmodified. Layers join with
    :meth:`join`."""

    def join(self) -> "SharedGather":
        """Count one more layer reading through this gather; returns it."""
        self.members += 1
        return self
