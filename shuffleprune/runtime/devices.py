"""The compute device a run uses: ``--device`` checked and resolved, and TF32 for its float32 matmuls."""
from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Iterator

import torch

from shuffleprune.errors import UserError


def pick_device(name: str) -> torch.device:
    """``auto`` → the first CUDA GPU if there is one, else CPU; ``cpu``/``cuda``/``cuda:N`` checked
    (a GPU index this machine does not have is refused here, not by a CUDA error mid-run)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    found = re.fullmatch(r"cpu|cuda(?::(\d+))?", name)
    if found is None:
        raise UserError(f"unknown --device '{name}'; use auto, cpu, cuda or cuda:N")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"--device {name} was asked for but no CUDA GPU is available; use --device cpu")
        count = torch.cuda.device_count()
        if found.group(1) is not None and int(found.group(1)) >= count:
            raise UserError(f"--device {name}: this machine has {count} CUDA GPU{'s' * (count != 1)} "
                            f"(cuda:0{f' … cuda:{count - 1}' if count > 1 else ''})")
    return torch.device(name)


def indexed_cuda(device: torch.device) -> torch.device:
    """A CUDA ``device`` with its index: a bare ``cuda`` is the current GPU."""
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


@contextmanager
def tf32_matmuls(device: torch.device, enabled: bool) -> Iterator[bool]:
    """Allow TF32 for float32 matmuls and convolutions while inside, on a CUDA ``device`` only (yields
    whether it is on); the previous settings come back on exit. On an H100 it cut a 7B block's
    permutation step from 0.269 to 0.194 s (``scripts/results/bench_perm_cost.json``)."""
    on = enabled and device.type == "cuda"
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    if on:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        yield on
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
