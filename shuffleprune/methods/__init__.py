"""One-shot pruning methods. Each is one function ``(weight, stats, pattern) -> pruned weight``.

``weight`` is the layer's ``[out, in]`` weight in float32 (not modified in place), ``stats`` the
layer's ``InputStats`` from the calibration pass. The returned tensor satisfies ``pattern``.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..errors import UserError
from ..masks import Pattern
from ..stats import InputStats
from .magnitude import magnitude
from .sparsegpt import sparsegpt
from .wanda import wanda, wanda_score

PruneFn = Callable[[torch.Tensor, InputStats, Pattern], torch.Tensor]

METHODS: dict[str, PruneFn] = {"magnitude": magnitude, "wanda": wanda, "sparsegpt": sparsegpt}
NEEDS_STATS = {"wanda", "sparsegpt"}
NEEDS_GRAM = {"sparsegpt"}


def get_method(name: str) -> PruneFn:
    if name not in METHODS:
        raise UserError(f"unknown --base '{name}'; use one of {', '.join(METHODS)}")
    return METHODS[name]


__all__ = ["METHODS", "NEEDS_STATS", "NEEDS_GRAM", "get_method", "magnitude", "wanda", "wanda_score", "sparsegpt"]
