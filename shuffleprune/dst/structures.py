"""The shape every method gives a mask: the top entries of a score in unstructured, constant fan-in
(srigl), block (dsb), N:M, butterfly (pixelfly) or wrapped-diagonal (diag) structure."""
from __future__ import annotations

import torch
from torch import nn

from shuffleprune.dst.config import DSTConfig
from shuffleprune.masks import nm_keep_mask


def top_entries(score: torch.Tensor, k: int) -> torch.Tensor:
    """A mask of the ``k`` highest entries of ``score``, no structure."""
    mask = torch.zeros(score.numel(), dtype=torch.bool)
    if k > 0:
        mask[score.flatten().topk(k).indices] = True
    return mask.view_as(score)


def pool(t: torch.Tensor, b: int) -> torch.Tensor:
    """``[out, in]`` → per-block sums ``[out/b, in/b]`` of ``b``×``b`` blocks."""
    return t.reshape(t.shape[0] // b, b, t.shape[1] // b, b).sum((1, 3))


def expand(blocks: torch.Tensor, b: int) -> torch.Tensor:
    """Per-block values → ``[out, in]`` (every block's value on its ``b``×``b`` entries)."""
    return blocks.repeat_interleave(b, 0).repeat_interleave(b, 1)


def select_mask(config: DSTConfig, scores: torch.Tensor, budget: int, alive: torch.Tensor | None = None) -> torch.Tensor:
    """A mask with ``budget`` entries of highest ``scores``, in ``config.method``'s structure
    (srigl: only the ``alive`` neurons, each with the same fan-in)."""
    out_f, in_f = scores.shape
    if config.method == "dsb":
        n_blocks = max(1, round(budget / config.block ** 2))
        return expand(top_entries(pool(scores, config.block), n_blocks), config.block)
    if config.method == "nm":  # the top N of every M consecutive inputs of every row
        return nm_keep_mask(scores, *config.nm())
    if config.method != "srigl":
        return top_entries(scores, budget)
    alive = torch.ones(out_f, dtype=torch.bool) if alive is None else alive
    fan_in = min(in_f, budget // max(int(alive.sum()), 1))
    mask = torch.zeros(out_f, in_f, dtype=torch.bool)
    if fan_in > 0:
        mask.scatter_(1, scores.topk(fan_in, dim=1).indices, True)
    return mask & alive.unsqueeze(1)


def kept_first(kept: torch.Tensor, w: torch.Tensor, grow_score: torch.Tensor) -> torch.Tensor:
    """A refill ranking: the ``kept`` weights above every other entry (by magnitude among
    themselves), the rest by ``grow_score``."""
    return torch.where(kept, w.abs() + grow_score.abs().max() + 1.0, grow_score)


def srigl_mask(config: DSTConfig, salient: torch.Tensor, kept: torch.Tensor, grow_score: torch.Tensor,
               w: torch.Tensor, budget: int) -> torch.Tensor:
    """Constant fan-in with neuron ablation, from RigL's unstructured choice ``salient``: a neuron
    with fewer than ``gamma_sal``·fan-in salient weights is switched off."""
    out_f = salient.shape[0]
    fan_in = max(1, budget // out_f)
    alive = salient.sum(1) >= config.gamma_sal * fan_in
    if not alive.any():
        alive[salient.sum(1).argmax()] = True
    rank = kept_first(kept, w, grow_score)  # within each live neuron
    rank = torch.where(salient, rank + (rank.abs().max() + 1.0), rank)
    return select_mask(config, rank, budget, alive)


def butterfly_mask(out_f: int, in_f: int, b: int, budget: float) -> torch.Tensor:
    """pixelfly's flat block butterfly: block ``(i, j)`` of the grid (scaled to a square power of
    two) is active when ``i = j`` or ``i XOR j`` is a power of two, with as many levels as fit ``budget``."""
    rows, cols = out_f // b, in_f // b
    n = 1 << (max(rows, cols) - 1).bit_length()  # the next power of two
    x = (torch.arange(rows).unsqueeze(1) * n // rows) ^ (torch.arange(cols).unsqueeze(0) * n // cols)
    blocks, stride = x == 0, 1
    while stride < n:
        candidate = blocks | (x == stride)
        if int(candidate.sum()) * b * b > budget and blocks.any():
            break
        blocks, stride = candidate, stride * 2
    return expand(blocks, b)


def add_lowrank(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """pixelfly's forward hook: ``y += x' Vᵀ Uᵀ`` on the same (possibly permuted) input ``x'`` as the layer."""
    x, v = args[0], module.lowrank_v
    perm = getattr(module, "_input_perm", None)
    if perm is not None:
        v = perm.weight_view(v)  # the permutation is applied on the weight side (see input_perm)
    return output + (x @ v.t()) @ module.lowrank_u.t()


def diagonal_offsets(out_f: int, in_f: int) -> torch.Tensor:
    """``[out, in]``: the wrapped diagonal each entry lies on (entry ``(r, c)`` is on ``(c − r) mod in``)."""
    return (torch.arange(in_f).unsqueeze(0) - torch.arange(out_f).unsqueeze(1)) % in_f


class DiagonalSelect(nn.Module):
    """``weight`` parametrization of ``diag``: ``W ⊙ Σ_d s_d D_d`` with soft top-K ``s`` while
    selecting, ``W ⊙ mask`` (the frozen K diagonals) after."""

    def __init__(self, out_f: int, in_f: int, k: int, conv1d: bool, generator: torch.Generator):
        super().__init__()
        self.out_f, self.in_f, self.k, self.conv1d = out_f, in_f, k, conv1d
        self.alpha = nn.Parameter(torch.randn(in_f, generator=generator) * 1e-2)
        self.tau = 1.0
        self.register_buffer("frozen", torch.zeros(out_f, in_f, dtype=torch.bool))
        self.is_frozen = False
        self.register_buffer("offset", diagonal_offsets(out_f, in_f), persistent=False)

    def soft(self) -> torch.Tensor:
        top = self.alpha.topk(min(self.k + 1, self.in_f)).values
        t = (top[self.k - 1] + top[-1]) / 2 if self.k < self.in_f else top[-1] - 1.0
        return torch.sigmoid((self.alpha - t.detach()) / self.tau)

    def hard(self) -> torch.Tensor:
        """``[out, in]`` mask of the current top-K diagonals."""
        chosen = torch.zeros(self.in_f, dtype=torch.bool, device=self.alpha.device)
        chosen[self.alpha.detach().topk(self.k).indices] = True
        return chosen[self.offset]

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        mask = self.frozen.to(w.dtype) if self.is_frozen else self.soft().to(w.dtype)[self.offset]
        return w * (mask.t() if self.conv1d else mask)
