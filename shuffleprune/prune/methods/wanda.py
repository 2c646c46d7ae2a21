"""Wanda (Sun et al., 2023): score |W_ij|·‖X_j‖₂, compared within each output row (or N:M group)."""
from __future__ import annotations

import torch

from shuffleprune.masks import Pattern, keep_mask
from shuffleprune.prune.input_stats import InputStats


def wanda_score(weight: torch.Tensor, stats: InputStats) -> torch.Tensor:
    """``|W| · ‖X_j‖₂`` broadcast over rows."""
    return weight.abs() * stats.col_norm.to(weight.device).unsqueeze(0)


def wanda(weight: torch.Tensor, stats: InputStats, pattern: Pattern) -> torch.Tensor:
    return weight * keep_mask(wanda_score(weight, stats), pattern, per_row=True)
