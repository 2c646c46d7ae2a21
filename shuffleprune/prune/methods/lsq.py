"""The exact masked least-squares weight update: for a fixed mask, the kept weights that best
reproduce the dense layer's outputs on the calibration inputs,

    min_Ŵ ‖W X − Ŵ X‖²   with Ŵ zero off the mask,

for all rows at once. Row i's optimum solves ``H[S_i, S_i] ŵ = H[S_i, :] w_i`` with ``H = XᵀX``
(the Gram matrix SparseGPT already gathers) and ``S_i`` the row's kept columns. The rows have
different kept sets, so instead of one factorization per row the systems are solved together by
Jacobi-preconditioned conjugate gradients on ``A(V) = M ⊙ (V H)`` — one ``[rows, cols] × [cols,
cols]`` product per iteration — started from the pruned weights (Wanda's or SparseGPT's).
"""
from __future__ import annotations

import torch


def damped_gram(gram: torch.Tensor, damp: float, device: torch.device,
                dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H, dead)``: ``XᵀX`` in ``dtype`` on ``device`` with dead inputs (zero diagonal) given a unit
    diagonal and ``damp·mean(diag H)`` added to the diagonal (SparseGPT's ridge term)."""
    h = gram.to(device, dtype, copy=True)
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    if damp:
        h.diagonal().add_(damp * h.diagonal().mean())
    return h, dead


@torch.no_grad()
def masked_lstsq(dense: torch.Tensor, mask: torch.Tensor, gram: torch.Tensor, start: torch.Tensor | None = None,
                 damp: float = 0.01, iters: int = 200, tol: float = 1e-6,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Kept weights minimising ``‖(dense − Ŵ) Xᵀ‖²`` row by row, zero where ``mask`` is False.

    ``dense`` ``[rows, cols]`` is the unpruned weight, ``mask`` its boolean keep mask, ``gram`` ``XᵀX``
    ``[cols, cols]``; ``damp`` adds ``damp·mean(diag H)`` to the diagonal (as SparseGPT; 0 for the
    exact optimum); ``start`` is the first iterate (default: the masked dense weight). Iterates until
    every row's relative residual is below ``tol`` or ``iters`` steps; computed in ``dtype``."""
    w = dense.to(dtype)
    m = mask.to(w.device, torch.bool)
    h, dead = damped_gram(gram, damp, w.device, dtype)
    keep = m.to(dtype)
    x = (start.to(dtype) if start is not None else w) * keep
    b = (w @ h) * keep
    r = b - (x @ h) * keep
    pre = keep / h.diagonal().unsqueeze(0)            # Jacobi: 1 / H_jj on kept columns
    z = r * pre
    p = z.clone()
    rz = (r * z).sum(1)
    tiny = torch.finfo(dtype).tiny
    b_norm = b.norm(dim=1).clamp_min(tiny)
    for _ in range(iters):
        if bool((r.norm(dim=1) / b_norm <= tol).all()):
            break
        ap = (p @ h) * keep
        denom = (p * ap).sum(1)
        alpha = torch.where(denom > 0, rz / denom.clamp_min(tiny), torch.zeros_like(rz))
        x += alpha.unsqueeze(1) * p
        r -= alpha.unsqueeze(1) * ap
        z = r * pre
        rz_new = (r * z).sum(1)
        beta = torch.where(rz > 0, rz_new / rz.clamp_min(tiny), torch.zeros_like(rz))
        p = z + beta.unsqueeze(1) * p
        rz = rz_new
    x[:, dead] = 0.0
    return (x * keep).to(dense.dtype)
