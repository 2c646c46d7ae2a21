"""Block-wise reconstruction: fit a pruned block's kept weights to the dense block's outputs.

With masks and permutations fixed, the kept weights of every linear are trained with Adam on the
calibration windows (inputs from the already-pruned earlier blocks) against the dense block's
outputs. A held-out share of the windows is never trained on; its loss is checked every few
steps, training stops once it has risen ``patience`` checks in a row, and the weights of the best
check are kept (so a block never ends worse on held-out windows than it started). Pruned
positions stay exactly zero: the update is multiplied by the mask.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass
class FitResult:
    weights: dict[str, torch.Tensor]      # the best check's weights (masked)
    steps_run: int
    best_step: int                        # 0: the starting weights were best
    stopped_early: bool
    held_out: list[float] = field(default_factory=list)   # held-out loss at each check (step 0 first)
    train: list[float] = field(default_factory=list)      # training loss per step


def fit_kept_weights(start: dict[str, torch.Tensor], masks: dict[str, torch.Tensor],
                     loss_of: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
                     learn_rows: torch.Tensor, judge_rows: torch.Tensor, steps: int, lr: float, batch: int,
                     check_every: int, patience: int, gen: torch.Generator) -> FitResult:
    """Adam on the kept entries of ``start`` (``masks`` True = kept) minimising ``loss_of(weights,
    window rows)``; returns the weights with the lowest held-out loss (``judge_rows``) seen at a check."""
    params = {n: w.detach().float().clone().requires_grad_(True) for n, w in start.items()}
    keep = {n: masks[n].to(w.device, torch.float32) for n, w in params.items()}
    opt = torch.optim.Adam(list(params.values()), lr=lr)

    def masked() -> dict[str, torch.Tensor]:
        return {n: p * keep[n] for n, p in params.items()}

    def held_out_loss() -> float:
        with torch.no_grad():
            w = masked()
            chunks = judge_rows.split(batch)
            return sum(float(loss_of(w, rows)) * len(rows) for rows in chunks) / len(judge_rows)

    best = held_out_loss()
    result = FitResult(weights={n: w.detach().clone() for n, w in masked().items()}, steps_run=0, best_step=0,
                       stopped_early=False, held_out=[best])
    rises = 0
    for step in range(1, steps + 1):
        rows = learn_rows[torch.randperm(len(learn_rows), generator=gen)[:batch]]
        loss = loss_of(masked(), rows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        result.train.append(float(loss.detach()))
        result.steps_run = step
        if step % check_every and step != steps:
            continue
        current = held_out_loss()
        result.held_out.append(current)
        if current < best:
            best, rises, result.best_step = current, 0, step
            result.weights = {n: w.detach().clone() for n, w in masked().items()}
        else:
            rises += 1
            if rises >= patience:
                result.stopped_early = step < steps
                break
    return result
