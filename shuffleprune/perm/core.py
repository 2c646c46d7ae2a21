"""The permutation core shared by ``prune --perm learned`` and ``dst``: learned input-channel
permutations, relaxed to doubly-stochastic matrices and hardened by Hungarian matching.

Conventions. A layer ``y = W x`` with ``W`` of shape ``[R, C]`` is rewritten as
``y = (W Π)(Πᵀ x)``. With a hard permutation given as an index map ``perm`` (``Π[perm[j], j] = 1``)
this is ``W[:, perm] @ x[perm]``: the permuted weight ``W[:, perm]`` is what gets an N:M mask in
memory order, and the kernel reads its input at the permuted addresses ``x[perm]``.

A permutation over ``C`` channels is block-diagonal with block size ``B`` (``C = full·B + tail``);
soft matrices are kept as a list of stacked blocks, ``[full, B, B]`` plus ``[1, tail, tail]`` when
``C`` is not a multiple of ``B``. Every function below works on such a list (a "block list").

Two relaxations:

- ``l1l2`` (ShuffleSparse / AutoShuffleNet, the default): ``M`` itself is the parameter. The loss
  adds ``λ_t·P(M)`` with ``P(M) = Σ_rows(‖·‖₁−‖·‖₂) + Σ_cols(‖·‖₁−‖·‖₂)``, zero exactly on
  permutation matrices, and after every optimizer step ``M`` is projected back onto the
  doubly-stochastic set by :func:`project_doubly_stochastic`.
- ``sinkhorn`` (PermLLM): the parameter is a logit matrix ``L`` and ``M = Sinkhorn(exp(L/τ))`` with
  a fixed number of row/column normalisations; ``τ`` is annealed; no penalty, no projection.

Both decode ``Π = Hungarian(M)`` (``argmax_Π ⟨Π, M⟩``, :func:`hungarian`) and use the
straight-through matrix ``M̄ = sg(Π − M) + M``: the forward pass sees the hard permutation, the
backward pass differentiates through ``M``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment
from torch import nn

BlockList = list[torch.Tensor]


def block_sizes(size: int, block: int) -> list[tuple[int, int]]:
    """``[(count, width), …]`` for a block-diagonal split of ``size`` channels (last block smaller)."""
    if size < 1 or block < 1:
        raise ValueError("size and block must be >= 1")
    block = min(block, size)
    full, tail = divmod(size, block)
    return [(full, block)] + ([(1, tail)] if tail else [])


def random_block_perm(size: int, block: int, gen: torch.Generator) -> torch.Tensor:
    """A uniformly random block-diagonal index map (each block shuffled on its own)."""
    parts, offset = [], 0
    for count, width in block_sizes(size, block):
        for _ in range(count):
            parts.append(torch.randperm(width, generator=gen) + offset)
            offset += width
    return torch.cat(parts)


@torch.no_grad()
def penalty_grad(blocks: BlockList) -> list[torch.Tensor]:
    """``∂P/∂M`` in closed form for ``M > 0`` (as after the projection):
    ``2 − M_ij/‖M_i:‖₂ − M_ij/‖M_:j‖₂`` — no autograd graph needed."""
    out = []
    for m in blocks:
        inv = m.norm(dim=-1, keepdim=True).reciprocal_() + m.norm(dim=-2, keepdim=True).reciprocal_()
        out.append(inv.mul_(m).neg_().add_(2.0))
    return out


def penalty(blocks: BlockList) -> torch.Tensor:
    """``P(M)`` summed over all blocks: row and column ``‖·‖₁ − ‖·‖₂`` (``M`` assumed ≥ 0)."""
    total = blocks[0].new_zeros(())
    for m in blocks:
        a = m.abs()
        total = total + (a.sum(-1) - m.norm(dim=-1)).sum() + (a.sum(-2) - m.norm(dim=-2)).sum()
    return total


@torch.no_grad()
def project_doubly_stochastic(blocks: BlockList, iters: int = 30, eps: float = 1e-12,
                              tol: float | None = None) -> None:
    """In place: clamp to ``≥ 0`` then alternate row and column normalisation (Sinkhorn–Knopp
    balancing) ``iters`` times, ending with columns.

    This is the projection used by AutoShuffleNet-style training: not the Euclidean projection onto
    the Birkhoff polytope (a QP per step), but a map onto the doubly-stochastic set that keeps
    zeros at zero and leaves permutation matrices unchanged. After it, columns sum to 1 exactly
    and rows to 1 up to the balancing residual (round-off for matrices with total support, which
    the iterates of training have; a clamped matrix without total support has no doubly-stochastic
    scaling, and the residual then shrinks only slowly). With ``tol``, the balancing stops early
    once every row sum is within ``tol`` of 1 (a small step from a doubly-stochastic matrix needs
    only a few rounds).
    """
    for m in blocks:
        m.clamp_(min=0.0)
        m.add_(eps)
        for _ in range(iters):
            m.div_(m.sum(-1, keepdim=True))
            m.div_(m.sum(-2, keepdim=True))
            if tol is not None and float((m.sum(-1) - 1.0).abs().max()) < tol:
                break


def hungarian(blocks: BlockList) -> torch.Tensor:
    """The hard permutation closest to ``M``: per block ``argmax_Π ⟨Π, M_k⟩`` via scipy's
    ``linear_sum_assignment``. Returns the global index map ``perm`` (``[C]``, int64) with
    ``Π[perm[j], j] = 1``, i.e. permuted column ``j`` reads original channel ``perm[j]``."""
    out, offset = [], 0
    for m in blocks:
        arr = m.detach().to(torch.float64).cpu().numpy()
        for k in range(arr.shape[0]):
            rows, cols = linear_sum_assignment(arr[k], maximize=True)
            local = np.empty(arr.shape[-1], dtype=np.int64)
            local[cols] = rows
            out.append(torch.from_numpy(local) + offset)
            offset += arr.shape[-1]
    return torch.cat(out)


def perm_to_blocks(perm: torch.Tensor, sizes: list[tuple[int, int]], dtype=torch.float32) -> BlockList:
    """One-hot block list of a block-diagonal index map (``Π[perm[j], j] = 1``)."""
    blocks, offset = [], 0
    for count, width in sizes:
        local = perm[offset:offset + count * width].view(count, width) - \
            (offset + torch.arange(count).unsqueeze(1) * width)
        if local.min() < 0 or local.max() >= width:
            raise ValueError("index map is not block-diagonal for this block size")
        m = torch.zeros(count, width, width, dtype=dtype)
        m.scatter_(1, local.unsqueeze(1), 1.0)
        blocks.append(m)
        offset += count * width
    return blocks


def straight_through(soft: BlockList, hard: BlockList) -> BlockList:
    """``M̄ = sg(Π − M) + M``: value of ``Π``, gradient of ``M``."""
    return [(h.to(s) - s).detach() + s for s, h in zip(soft, hard)]


def permute_columns(weight: torch.Tensor, blocks: BlockList) -> torch.Tensor:
    """``W M`` for a block-diagonal ``M``: ``[R, C] → [R, C]`` (column ``j`` mixes ``W``'s columns by ``M[:, j]``)."""
    parts, offset = [], 0
    for m in blocks:
        count, width = m.shape[0], m.shape[-1]
        w = weight[:, offset:offset + count * width].reshape(weight.shape[0], count, width)
        parts.append(torch.einsum("rki,kij->rkj", w, m).reshape(weight.shape[0], count * width))
        offset += count * width
    return torch.cat(parts, dim=1)


def unpermute_columns(weight: torch.Tensor, blocks: BlockList) -> torch.Tensor:
    """``W Mᵀ``: back from permuted to original column order (exact inverse when ``M`` is a permutation)."""
    return permute_columns(weight, [m.transpose(-1, -2) for m in blocks])


def in_permuted_columns(fn: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor,
                        perm: torch.Tensor) -> torch.Tensor:
    """Apply ``fn`` to ``W[:, perm]`` and put its result back in the original column order
    (``out[:, perm] = fn(W[:, perm])``): how a hard index map is used to prune in permuted coordinates."""
    perm = perm.to(weight.device)
    permuted = fn(weight[:, perm])
    out = torch.empty_like(permuted)
    out[:, perm] = permuted
    return out


def strength(perm: torch.Tensor) -> float:
    """Permutation strength ``1 − ‖P − I‖_F / √(2N)`` (paper Sec. 5.3): 1 for the identity, 0 when
    every channel moves (``‖P − I‖_F² = 2·#moved``)."""
    moved = int((perm != torch.arange(perm.numel())).sum())
    return 1.0 - math.sqrt(2 * moved) / math.sqrt(2 * perm.numel())


def sinkhorn(logits: BlockList, tau: float, iters: int = 5) -> BlockList:
    """PermLLM's relaxation: ``exp(L/τ)`` normalised rows-then-columns ``iters`` times (log domain)."""
    out = []
    for l in logits:
        z = l / tau
        for _ in range(iters):
            z = z - torch.logsumexp(z, dim=-1, keepdim=True)
            z = z - torch.logsumexp(z, dim=-2, keepdim=True)
        out.append(z.exp())
    return out


LR_DECAYS = ("constant", "cosine")


@dataclass
class PermSchedule:
    """Schedules of the soft phase: λ ramp (l1l2), τ anneal (sinkhorn), learning-rate decay."""

    steps: int
    lambda_max: float = 1e-4
    ramp_steps: int | None = None  # T_perm; default: all steps
    tau_start: float = 1.0
    tau_end: float = 0.1
    lr_decay: str = "constant"     # one of LR_DECAYS

    def __post_init__(self) -> None:
        if self.lr_decay not in LR_DECAYS:
            raise ValueError(f"unknown learning-rate decay '{self.lr_decay}'; use {' or '.join(LR_DECAYS)}")

    def lr_factor(self, step: int) -> float:
        """Multiplier of the base learning rate at ``step``: 1 (constant), or ``½(1 + cos(π t/T))``
        (cosine: 1 at the first step, → 0 at the last)."""
        if self.lr_decay == "constant":
            return 1.0
        return 0.5 * (1.0 + math.cos(math.pi * min(step, self.steps) / max(self.steps, 1)))

    def lam(self, step: int) -> float:
        """``λ_t = λ_max · min(1, t / T_perm)`` (0 at step 0)."""
        ramp = self.ramp_steps or self.steps
        return self.lambda_max * min(1.0, step / max(ramp, 1))

    def tau(self, step: int) -> float:
        """Linear anneal ``τ_start → τ_end`` over the steps."""
        frac = min(1.0, step / max(self.steps - 1, 1))
        return self.tau_start + (self.tau_end - self.tau_start) * frac


class SoftPermutation(nn.Module):
    """A learnable block-diagonal soft permutation over ``size`` channels.

    ``relax="l1l2"``: parameters are the doubly-stochastic blocks themselves, initialised at
    ``α·I + (1−α)/B·11ᵀ`` (doubly stochastic, decodes to the identity, so learning starts from the
    unpermuted baseline). ``relax="sinkhorn"``: parameters are logits initialised at ``α·I`` scaled so
    that the τ=1 Sinkhorn matrix also decodes to the identity. ``init_perm`` (a block-diagonal index
    map) replaces ``I`` by that permutation's matrix: learning then starts from it.
    """

    def __init__(self, size: int, block: int = 64, relax: str = "l1l2", init_identity: float = 0.1,
                 init_perm: torch.Tensor | None = None):
        super().__init__()
        if relax not in ("l1l2", "sinkhorn"):
            raise ValueError(f"unknown relaxation '{relax}'; use l1l2 or sinkhorn")
        self.size, self.relax = size, relax
        self.sizes = block_sizes(size, block)
        params = []
        starts = perm_to_blocks(init_perm, self.sizes) if init_perm is not None else \
            [torch.eye(width).expand(count, width, width) for count, width in self.sizes]
        for (count, width), eye in zip(self.sizes, starts):
            if relax == "l1l2":
                params.append(init_identity * eye + (1 - init_identity) / width)
            else:
                params.append(eye * init_identity * 4.0)
        self.blocks = nn.ParameterList([nn.Parameter(p.clone()) for p in params])
        self.tau = 1.0

    def soft(self) -> BlockList:
        """The current doubly-stochastic matrix ``M`` as a block list."""
        if self.relax == "l1l2":
            return list(self.blocks)
        return sinkhorn(list(self.blocks), self.tau)

    def penalty(self) -> torch.Tensor:
        """``P(M)`` (0 for the Sinkhorn relaxation, which has no penalty term)."""
        if self.relax != "l1l2":
            return self.blocks[0].new_zeros(())
        return penalty(list(self.blocks))

    def project_(self) -> None:
        if self.relax == "l1l2":
            project_doubly_stochastic(list(self.blocks))

    def harden(self) -> torch.Tensor:
        """Hungarian decoding of the current ``M``: the global index map ``perm``."""
        return hungarian(self.soft())

    def straight_through(self) -> tuple[BlockList, torch.Tensor]:
        """``(M̄, perm)``: forward value the hard permutation, gradient through ``M``."""
        soft = self.soft()
        perm = hungarian(soft)
        return straight_through(soft, perm_to_blocks(perm, self.sizes)), perm
