"""Sparsity patterns and masks: N:M (at most N non-zeros in every group of M consecutive input
columns, NVIDIA's convention: 2:4 keeps 2 of 4) and unstructured ratios; hard selection and checks."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from shuffleprune.errors import UserError


@dataclass(frozen=True)
class Pattern:
    """``n``:``m`` keeps ``n`` of every ``m`` input columns per row; ``n == m == 0`` means unstructured."""

    n: int = 0
    m: int = 0
    unstructured_sparsity: float = 0.0

    @property
    def is_nm(self) -> bool:
        return self.m > 0

    @property
    def sparsity(self) -> float:
        return 1.0 - self.n / self.m if self.is_nm else self.unstructured_sparsity

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.is_nm else f"unstructured-{self.unstructured_sparsity:g}"

    def check_width(self, name: str, in_features: int) -> None:
        """One weight's input width divides M, or a one-line error that names it and the ``--skip`` for it."""
        self.check_widths([(name, name, in_features)])

    def check_widths(self, weights: list[tuple[str, str, int]]) -> None:
        """Every weight's input width divides M, or one error naming them all at once, with one ``--skip``
        glob per name inside a block (``weights``: full name, name inside its block, input width), so a
        model whose every MLP has an odd width is fixed in one rerun."""
        bad = [(name, local, width) for name, local, width in weights if self.is_nm and width % self.m]
        if not bad:
            return
        name, _, width = bad[0]
        if len(bad) == 1:
            raise UserError(f"layer {name} has {width} input columns, not divisible by M={self.m}; "
                            f"skip it with --skip '{skip_glob(name)}' or choose another M")
        globs = dict.fromkeys(skip_glob(name) if local == name else f"*.{skip_glob(local)}" for name, local, _ in bad)
        skips = " ".join(f"--skip '{g}'" for g in globs)
        raise UserError(f"{len(bad)} layers have input widths not divisible by M={self.m} (e.g. {name}: {width} "
                        f"columns); skip them with {skips} or choose another M")


def skip_glob(name: str) -> str:
    """A ``--skip`` glob that matches ``name``: an MoE expert's ``param[i]`` (brackets open a character class
    in a glob, so the name itself would not match) becomes ``param*``, all the experts of that parameter,
    which share its width."""
    base, bracket, index = name.rpartition("[")
    return f"{base}*" if bracket and index.endswith("]") else name


def parse_pattern(pattern: str | None, sparsity: float | None) -> Pattern:
    """``--pattern N:M`` or ``--sparsity S`` (unstructured); exactly one of them."""
    if sparsity is not None and pattern not in (None, ""):
        raise UserError("give either --pattern N:M or --sparsity S, not both")
    if sparsity is not None:
        if not 0.0 < sparsity < 1.0:
            raise UserError(f"--sparsity must be in (0, 1), got {sparsity}")
        return Pattern(unstructured_sparsity=float(sparsity))
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", pattern or "")
    if not match:
        raise UserError(f"--pattern must look like N:M (e.g. 2:4), got '{pattern}'")
    n, m = int(match.group(1)), int(match.group(2))
    if not 0 < n < m:
        raise UserError(f"impossible pattern {n}:{m}: need 0 < N < M (N kept of every M)")
    return Pattern(n=n, m=m)


def nm_keep_mask(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Boolean mask keeping the ``n`` highest-scoring entries of every ``m`` consecutive columns of each row."""
    rows, cols = score.shape
    groups = score.reshape(rows, cols // m, m)
    keep = torch.zeros_like(groups, dtype=torch.bool)
    keep.scatter_(-1, groups.topk(n, dim=-1).indices, True)
    return keep.reshape(rows, cols)


def row_keep_mask(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Unstructured mask pruning the ``sparsity`` fraction of lowest scores within each row (Wanda)."""
    rows, cols = score.shape
    n_prune = int(cols * sparsity)
    keep = torch.ones_like(score, dtype=torch.bool)
    if n_prune:
        keep.scatter_(1, score.argsort(dim=1)[:, :n_prune], False)
    return keep


def layer_keep_mask(score: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Unstructured mask pruning the ``sparsity`` fraction of lowest scores over the whole matrix."""
    n_prune = int(score.numel() * sparsity)
    keep = torch.ones(score.numel(), dtype=torch.bool, device=score.device)
    if n_prune:
        keep[score.flatten().argsort()[:n_prune]] = False
    return keep.reshape(score.shape)


def keep_mask(score: torch.Tensor, pattern: Pattern, per_row: bool = True) -> torch.Tensor:
    """Hard mask for ``pattern`` from ``score`` (higher = more important)."""
    if pattern.is_nm:
        return nm_keep_mask(score, pattern.n, pattern.m)
    return (row_keep_mask if per_row else layer_keep_mask)(score, pattern.unstructured_sparsity)


def satisfies_nm(weight: torch.Tensor, n: int, m: int) -> bool:
    """True iff every group of ``m`` consecutive columns in every row holds at most ``n`` non-zeros."""
    rows, cols = weight.shape
    if cols % m:
        return False
    return bool(((weight.reshape(rows, cols // m, m) != 0).sum(-1) <= n).all())


def sparsity_of(weight: torch.Tensor) -> float:
    return float((weight == 0).sum()) / weight.numel()
