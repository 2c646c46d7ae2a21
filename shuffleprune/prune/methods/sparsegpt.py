"""SparseGPT (Frantar & Alistarh, 2023): OBS-style pruning with weight reconstruction.

Columns are processed in blocks of 128; within a block the mask is chosen adaptively (N:M: at the
start of every M-column group, from ``w²/[H⁻¹]_jj²``; unstructured: once per block over the block),
each pruned weight's error is spread over the not-yet-processed columns through the Cholesky factor
of the inverse Hessian ``H = XᵀX + λI`` with ``λ = 0.01·mean(diag H)``.
"""
from __future__ import annotations

import torch

from shuffleprune.masks import Pattern
from shuffleprune.runtime.determinism import one_cpu_thread
from shuffleprune.prune.input_stats import InputStats


def _upper_cholesky_of_inverse(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    with one_cpu_thread(hessian.device):  # the same factor whatever the thread count
        return _factor(hessian, damp)


def _factor(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    h = hessian.clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    for _ in range(5):  # add more damping if H is numerically not positive definite
        factor, info = torch.linalg.cholesky_ex(h)
        if int(info) == 0:
            break
        h.diagonal().add_(damp * h.diagonal().mean())
    h_inv = torch.cholesky_inverse(factor)
    return torch.linalg.cholesky(h_inv, upper=True)


@torch.no_grad()
def sparsegpt(weight: torch.Tensor, stats: InputStats, pattern: Pattern,
              blocksize: int = 128, damp: float = 0.01) -> torch.Tensor:
    w = weight.detach().clone().float()
    rows, cols = w.shape
    h = stats.gram.to(w.device).clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    hinv = _upper_cholesky_of_inverse(h, damp)
    n_prune_group = pattern.m - pattern.n if pattern.is_nm else 0

    for b0 in range(0, cols, blocksize):
        b1 = min(b0 + blocksize, cols)
        wb = w[:, b0:b1].clone()
        err = torch.zeros_like(wb)
        hb = hinv[b0:b1, b0:b1]
        dinv = hb.diagonal()
        if pattern.is_nm:
            prune = torch.zeros_like(wb, dtype=torch.bool)
        else:
            score = wb.pow(2) / dinv.pow(2).unsqueeze(0)
            k = int(score.numel() * pattern.unstructured_sparsity)
            prune = torch.zeros(score.numel(), dtype=torch.bool, device=w.device)
            if k:
                prune[score.flatten().argsort()[:k]] = True
            prune = prune.reshape(score.shape)
        for j in range(b1 - b0):
            if pattern.is_nm and j % pattern.m == 0:
                group = wb[:, j:j + pattern.m].pow(2) / dinv[j:j + pattern.m].pow(2).unsqueeze(0)
                idx = group.topk(n_prune_group, dim=1, largest=False).indices
                prune[:, j:j + pattern.m].scatter_(1, idx, True)
            col = wb[:, j]
            q = torch.where(prune[:, j], torch.zeros_like(col), col)
            e = (col - q) / hb[j, j]
            wb[:, j:] -= e.unsqueeze(1) * hb[j, j:].unsqueeze(0)
            wb[:, j] = q
            err[:, j] = e
        w[:, b0:b1] = wb
        if b1 < cols:
            w[:, b1:] -= err @ hinv[b0:b1, b1:]
    return w.to(weight.dtype)
