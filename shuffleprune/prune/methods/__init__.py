"""One-shot pruning methods. Each is one function ``(weight, stats, pattern) -> pruned weight``.

``weight`` is the layer's ``[out, in]`` weight in float32 (not modified in place), ``stats`` the
layer's ``InputStats`` from the calibration pass. The returned tensor satisfies ``pattern``.
"""
from __future__ import annotations

from typing import Callable

import torch

from shuffleprune.errors import UserError
from shuffleprune.masks import Pattern
from shuffleprune.prune.input_stats import InputStats
from shuffleprune.prune.methods.magnitude import magnitude
from shuffleprune.prune.methods.sparsegpt import sparsegpt
from shuffleprune.prune.methods.wanda import wanda, wanda_score

PruneFn = Callable[[torch.Tensor, InputStats, Pattern], torch.Tensor]

METHODS: dict[str, PruneFn] = {"magnitude": magnitude, "wanda": wanda, "sparsegpt": sparsegpt}


def get_method(name: str) -> PruneFn:
    if name not in METHODS:
        raise UserError(f"unknown --base '{name}'; use one of {', '.join(METHODS)}")
    return METHODS[name]


__all__ = ["METHODS", "PruneFn", "get_method", "magnitude", "wanda", "wanda_score", "sparsegpt"]
