"""Input-channel permutations for one decoder block during one-shot N:M pruning (ShuffleSparse).

``block_permutations`` returns one index map per linear of a block:

- ``random``: a fixed random block-diagonal permutation (the paper's control);
- ``learned``: soft permutations (one per group of linears that read the same input, or one per
  linear) trained against ``1 − cos(dense block output, sparse block output)`` on the calibration
  windows (``perm_learning``), weights frozen, then hardened by Hungarian matching.

The caller then prunes every linear *in permuted coordinates* with its base method
(:func:`prune_in_permuted_coordinates`), so the recomputed mask — and SparseGPT's weight update —
see the same column grouping the N:M kernel will see.

Beyond the paper (documented deviation): the hardened permutation is kept only if it reconstructs
a fixed set of calibration windows at least as well as the best permutation met during training
and as the identity; otherwise the better one is used. A learned permutation therefore never makes
a block's calibration loss worse than the unpermuted base method's mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call

from .blocks import CapturedInputs, first_tensor, tensors_to
from .errors import UserError
from .masks import Pattern
from .perm_learning import cosine_loss, learn_permutations, masked_weight
from .permutation import PermSchedule, SoftPermutation, perm_to_blocks, random_block_perm, strength
from .stats import InputStats


@dataclass(frozen=True)
class PermOptions:
    """``--perm`` and its knobs (the paper's defaults)."""

    perm: str = "none"          # none | random | learned
    relax: str = "l1l2"         # l1l2 (ShuffleSparse) | sinkhorn (PermLLM)
    block: int = 64             # permutation block size B
    steps: int = 100            # optimisation steps per decoder block
    lr: float = 3e-2
    lambda_max: float = 1e-4
    share: str = "group"        # group: q/k/v and gate/up share one permutation; linear: one each
    batch: int = 4              # calibration windows per step
    seed: int = 0

    def check(self, pattern: Pattern) -> None:
        if self.perm not in ("none", "random", "learned"):
            raise UserError(f"unknown --perm '{self.perm}'; use none, random or learned")
        if self.perm == "none":
            return
        if not pattern.is_nm:
            raise UserError("--perm needs an N:M --pattern: unstructured masks do not depend on column order")
        if self.relax not in ("l1l2", "sinkhorn"):
            raise UserError(f"unknown --relax '{self.relax}'; use l1l2 or sinkhorn")
        if self.share not in ("group", "linear"):
            raise UserError(f"unknown --perm-share '{self.share}'; use group or linear")
        if self.block < pattern.m or self.block % pattern.m:
            raise UserError(f"--perm-block {self.block} must be a multiple of M={pattern.m}")
        if self.steps < 1 or self.batch < 1 or self.lr <= 0:
            raise UserError("--perm-steps, --perm-batch and --perm-lr must be positive")


def prune_in_permuted_coordinates(method: Callable, weight: torch.Tensor, stats: InputStats | None,
                                  pattern: Pattern, perm: torch.Tensor) -> torch.Tensor:
    """Prune ``W[:, perm]`` with ``method`` (mask and any weight update in permuted coordinates) and
    return the result in the original column order. ``result[:, perm]`` satisfies the pattern."""
    perm = perm.to(weight.device)
    pruned_p = method(weight[:, perm], None if stats is None else stats.permuted(perm), pattern)
    out = torch.empty_like(pruned_p)
    out[:, perm] = pruned_p
    return out


def _score(weight: torch.Tensor, stats: InputStats | None) -> torch.Tensor:
    """Wanda's score ``|W|·‖X_j‖`` (``|W|`` without statistics) — the score the permutation is learned with."""
    return weight.abs() if stats is None else weight.abs() * stats.col_norm.to(weight.device).unsqueeze(0)


def block_permutations(block: nn.Module, prefix: str, linears: dict[str, nn.Linear],
                       stats: dict[str, InputStats | None], groups: list[list[str]], hidden: torch.Tensor,
                       target: torch.Tensor | None, captured: CapturedInputs, index: int, pattern: Pattern,
                       opts: PermOptions, device: torch.device,
                       on_step: Callable[[int, float, float], None] | None = None) -> tuple[dict, dict]:
    """Index maps ``{linear name: perm}`` for one block, and report entries: ``{"perms": per
    permutation (its linears, strength, penalty curve…), "summary": block loss curve and recon
    before/after}``."""
    units = groups if opts.share == "group" else [[n] for g in groups for n in g]
    gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + index)
    if opts.perm == "random":
        perms, info = {}, {}
        for unit in units:
            p = random_block_perm(linears[unit[0]].in_features, opts.block, gen)
            for name in unit:
                perms[name] = p
            info[unit[0]] = {"linears": unit, "strength": round(strength(p), 4)}
        return perms, {"perms": info, "summary": {}}

    assert target is not None
    key = {name: unit[0] for unit in units for name in unit}
    soft = {unit[0]: SoftPermutation(linears[unit[0]].in_features, opts.block, opts.relax).to(device) for unit in units}
    weights = {name: lin.weight.detach().float() for name, lin in linears.items()}
    scores = {name: _score(weights[name], stats[name]) for name in linears}
    param_of = {name: name[len(prefix) + 1:] + ".weight" for name in linears}
    args = tensors_to(captured.args[index], device)
    kwargs = tensors_to(captured.kwargs[index], device)
    n_windows = hidden.shape[0]
    fixed = torch.arange(min(n_windows, max(opts.batch, 4)))  # windows for the final choice

    def block_loss(perm_blocks: dict[str, list[torch.Tensor]], rows: torch.Tensor) -> torch.Tensor:
        params = {param_of[n]: masked_weight(weights[n], scores[n], perm_blocks[key[n]], pattern.n, pattern.m)
                  .to(linears[n].weight.dtype) for n in linears}
        x = hidden[rows].to(device)
        out = first_tensor(functional_call(block, params, (x, *args), kwargs))
        return cosine_loss(target[rows].to(device), out)

    def loss_fn(m_bars: dict[str, list[torch.Tensor]], step: int) -> torch.Tensor:
        rows = torch.randperm(n_windows, generator=gen)[:opts.batch]
        return block_loss(m_bars, rows)

    requires = [p.requires_grad for p in block.parameters()]
    for p in block.parameters():
        p.requires_grad_(False)
    try:
        schedule = PermSchedule(steps=opts.steps, lambda_max=opts.lambda_max)
        result = learn_permutations(soft, loss_fn, schedule, lr=opts.lr, on_step=on_step)
        with torch.no_grad():
            def hard_loss(perms: dict[str, torch.Tensor]) -> float:
                blocks_ = {k: [b.to(device) for b in perm_to_blocks(p, soft[k].sizes)] for k, p in perms.items()}
                return float(block_loss(blocks_, fixed))
            candidates = {"identity": {k: torch.arange(sp.size) for k, sp in soft.items()},
                          "best_step": result.best_perms, "final": result.perms}
            losses = {name: hard_loss(c) for name, c in candidates.items()}
    finally:
        for p, r in zip(block.parameters(), requires):
            p.requires_grad_(r)
    chosen = min(("final", "best_step", "identity"), key=lambda c: losses[c])  # ties keep the paper's choice
    perms = {name: candidates[chosen][key[name]] for name in linears}
    info = {}
    for k, sp in soft.items():
        p = candidates[chosen][k]
        info[k] = {"linears": [n for n in linears if key[n] == k], "strength": round(strength(p), 4),
                   "penalty_curve": [round(v, 4) for v in result.penalty_per_perm[k]],
                   "hardening_step": opts.steps, "chosen": chosen}
    summary = {"loss_curve": [round(v, 6) for v in result.loss], "best_step": result.best_step,
               "recon_before": round(losses["identity"], 6), "recon_after": round(losses[chosen], 6),
               "recon_final": round(losses["final"], 6), "recon_best_step": round(losses["best_step"], 6),
               "chosen": chosen}
    return perms, {"perms": info, "summary": summary}
