"""Gradual masks inside the masked least-squares update: the mask is chosen in rounds, each from the
weights the previous exact update produced, so a weight is judged after its neighbours have
already absorbed what pruning the others cost.

The pruned count per row grows in ``rounds`` equal steps (N:M: at most one weight per group per
step, only from groups that still hold more than ``N``; unstructured: compared per row).
Each round scores the kept weights by the OBS saliency ``ŵ² / [H⁻¹]_jj`` of the current solution
``ŵ`` (``H = XᵀX`` damped, as SparseGPT), drops the lowest, and re-solves
``min ‖W X − Ŵ X‖²`` over the smaller mask with :func:`masked_lstsq` (started from the previous
solution).
"""
from __future__ import annotations

import torch

from shuffleprune.masks import Pattern
from shuffleprune.prune.input_stats import InputStats
from shuffleprune.prune.methods.lsq import damped_gram, masked_lstsq
from shuffleprune.runtime.determinism import one_cpu_thread


def _inverse_diagonal(gram: torch.Tensor, damp: float) -> torch.Tensor:
    h, _ = damped_gram(gram, damp, gram.device)
    with one_cpu_thread(h.device):  # the same result whatever the thread count
        return torch.cholesky_inverse(torch.linalg.cholesky(h)).diagonal().float()


def _drop_nm(score: torch.Tensor, keep: torch.Tensor, n: int, m: int, goal: int) -> torch.Tensor:
    """``keep`` with more entries of every row removed until ``goal`` are pruned (or no candidate is
    left): each group's lowest-scoring kept entry while the group holds more than ``n``, at most one
    per group, lowest first."""
    rows, cols = score.shape
    k = keep.reshape(rows, cols // m, m)
    s = torch.where(k, score.reshape(rows, cols // m, m), torch.full_like(k, float("inf"), dtype=score.dtype))
    best, where = s.min(-1)                                          # each group's candidate
    best = torch.where(k.sum(-1) > n, best, torch.full_like(best, float("inf")))
    need = (goal - (~keep).sum(1)).clamp_min(0)                       # per row
    rank = best.argsort(dim=1).argsort(dim=1)                        # 0 = the row's lowest candidate
    drop = (rank < need.unsqueeze(1)) & best.isfinite()
    out = k.clone()
    r, g = drop.nonzero(as_tuple=True)
    out[r, g, where[r, g]] = False
    return out.reshape(rows, cols)


def _drop_per_row(score: torch.Tensor, keep: torch.Tensor, total: int) -> torch.Tensor:
    """``keep`` with the lowest-scoring kept entries of every row removed until ``total`` are pruned."""
    s = torch.where(keep, score, torch.full_like(score, -1.0))   # pruned ones sort first and stay pruned
    out = torch.ones_like(keep)
    if total:
        out.scatter_(1, s.argsort(dim=1)[:, :total], False)
    return out


@torch.no_grad()
def gradual_lstsq(weight: torch.Tensor, stats: InputStats, pattern: Pattern, rounds: int = 4,
                  damp: float = 0.01, iters: int = 100, tol: float = 1e-6) -> torch.Tensor:
    """Prune ``weight`` ``[rows, cols]`` to ``pattern`` in ``rounds`` equal steps of gradual OBS masks,
    with the exact masked least-squares update after every step (N:M: at least ``M − N`` steps, at
    most one weight per group per step)."""
    w = weight.detach().float()
    rows, cols = w.shape
    gram = stats.gram.to(w.device)
    hinv_diag = _inverse_diagonal(gram, damp).to(w.device).unsqueeze(0)
    keep = torch.ones_like(w, dtype=torch.bool)
    current = w.clone()
    if pattern.is_nm:
        total, steps = cols // pattern.m * (pattern.m - pattern.n), max(rounds, pattern.m - pattern.n)
    else:
        total, steps = int(cols * pattern.unstructured_sparsity), rounds
    step = 0
    while True:
        step += 1
        score = current.pow(2) / hinv_diag
        goal = total if step >= steps else -(-total * step // steps)          # pruned per row after this step
        if pattern.is_nm:
            keep = _drop_nm(score, keep, pattern.n, pattern.m, goal)
        else:
            keep = _drop_per_row(score, keep, goal)
        current = masked_lstsq(w, keep, gram, start=current * keep, damp=damp, iters=iters, tol=tol)
        if step >= steps and int((~keep).sum(1).min()) >= total:  # N:M: a lagging row takes more steps
            return current.to(weight.dtype)
