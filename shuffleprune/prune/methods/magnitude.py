"""Magnitude pruning: keep the largest |W| (per N:M group, or per layer for unstructured, as in Wanda's baseline)."""
from __future__ import annotations

import torch

from shuffleprune.masks import Pattern, keep_mask
from shuffleprune.prune.input_stats import InputStats


def magnitude(weight: torch.Tensor, stats: InputStats | None, pattern: Pattern) -> torch.Tensor:
    return weight * keep_mask(weight.abs(), pattern, per_row=False)
