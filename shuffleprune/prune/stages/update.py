"""``update`` stages: weight updates after the mask, which never loosen it (only kept weights change).

- ``lsq``: the exact masked least-squares update of :mod:`shuffleprune.prune.methods.lsq` — for
  each linear, the kept weights that best reproduce the dense layer's outputs on the block's
  calibration inputs (``XᵀX`` from the statistics stage), after any mask, with or without a
  permutation (the problem is per row and column order does not change it); the experts of fused
  MoE layers too, each on its routed tokens;
- ``blockrecon``: Adam on each block's kept weights against dense outputs, stopped by a held-out
  share of the windows (:mod:`shuffleprune.prune.reconstruct`); a fused MoE experts tensor whose
  every expert was pruned is fitted as one tensor (its zeros stay zero). The inputs are the pruned earlier
  blocks' outputs; the target is the unpruned model's activations after this block (``target:
  model``: the block also corrects the error the blocks before it left) or the dense block applied
  to the same pruned inputs (``target: block``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call

from shuffleprune.blocks import experts_by_tensor, weight_params
from shuffleprune.errors import UserError, check_values
from shuffleprune.perm.pruning import FrozenParams, split_windows
from shuffleprune.prune.methods.lsq import masked_lstsq
from shuffleprune.prune.reconstruct import fit_kept_weights
from shuffleprune.prune.stage import BlockWork, Run, RunSpec, Stage, register

PRECISIONS = {"float32": torch.float32, "float64": torch.float64}


@register
@dataclass
class LeastSquares(Stage):
    kind = "update"
    name = "lsq"
    damp: float = 0.01     # ridge term, as a fraction of mean(diag XᵀX)
    iters: int = 200       # conjugate-gradient steps at most
    tol: float = 1e-6      # relative residual per row
    # float64 by default (the exact solve). float32 with iters 40 and tol 1e-4 is about 3× faster and
    # leaves each SmolLM2 layer's error within 0.24 % of the optimum (README, *Recipes*).
    precision: str = "float64"

    def needs(self) -> set[str]:
        return {"gram", "dense_weights"}

    def check(self, spec: RunSpec) -> None:
        if self.iters < 1 or self.damp < 0 or self.tol <= 0:
            raise UserError("update 'lsq': iters must be ≥ 1, damp ≥ 0 and tol > 0")
        if self.precision not in PRECISIONS:
            raise UserError(f"update 'lsq': precision '{self.precision}' must be one of {', '.join(PRECISIONS)}")

    def apply(self, run: Run, work: BlockWork) -> None:
        for name, lin in work.weights().items():
            if work.stats[name].tokens == 0:  # an expert no calibration token reached: nothing to fit
                continue
            pruned = lin.weight.data
            new_w = masked_lstsq(work.dense[name], pruned != 0, work.stats[name].gram, start=pruned.float(),
                                 damp=self.damp, iters=self.iters, tol=self.tol, dtype=PRECISIONS[self.precision])
            lin.weight.data.copy_(new_w.to(pruned.dtype))


@register
@dataclass
class BlockReconstruction(Stage):
    """Fit each block's kept weights with Adam to the dense block's outputs (see :mod:`shuffleprune.prune.reconstruct`)."""

    kind = "update"
    name = "blockrecon"
    steps: int = 100
    lr: float = 1e-4
    batch: int = 4           # calibration windows per step
    holdout: float = 0.25    # share of windows never trained on; their loss stops training
    check_every: int = 10    # steps between held-out checks
    patience: int = 2        # stop after this many checks in a row without a new best
    target: str = "model"    # model: the unpruned model's activations; block: the dense block on pruned inputs
    loss: str = "global"     # global: squared error relative to the batch's mean square; token: to each token's

    def needs(self) -> set[str]:
        return {"dense_stream"} if self.target == "model" else {"dense_weights"}

    def check(self, spec: RunSpec) -> None:
        check_values(("update 'blockrecon': steps", self.steps, self.steps >= 1, ">= 1"),
                     ("update 'blockrecon': batch", self.batch, self.batch >= 1, ">= 1"),
                     ("update 'blockrecon': check_every", self.check_every, self.check_every >= 1, ">= 1"),
                     ("update 'blockrecon': patience", self.patience, self.patience >= 1, ">= 1"),
                     ("update 'blockrecon': lr", self.lr, self.lr > 0, "> 0"))
        if self.target not in ("model", "block"):
            raise UserError(f"update 'blockrecon': target '{self.target}' must be model or block")
        if self.loss not in ("token", "global"):
            raise UserError(f"update 'blockrecon': loss '{self.loss}' must be token or global")
        if not 0.0 <= self.holdout < 1.0:
            raise UserError(f"update 'blockrecon': holdout {self.holdout} must be in [0, 1)")
        if self.holdout and spec.nsamples < 2:
            raise UserError("update 'blockrecon' holds windows out: raise --nsamples to at least 2 (or holdout: 0)")

    def apply(self, run: Run, work: BlockWork) -> None:
        # what is fitted: the linears' weights, and each fused experts tensor whose every expert was pruned
        tensors = {n: lin.weight for n, lin in work.linears.items()}
        for name, experts in experts_by_tensor(work.experts).items():
            first = next(iter(experts.values()))
            if len(experts) == first.fused().shape[0]:
                tensors[name] = getattr(first.owner, first.param)
        param_of = {n: n[len(work.prefix) + 1:] + (".weight" if n in work.linears else "") for n in tensors}
        dtype = {n: t.dtype for n, t in tensors.items()}

        def block_with(params: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
            args, kwargs = run.captured.call_args(work.index, rows, run.device)
            hidden = run.captured.to_block(work.hidden[rows].to(run.device))
            return run.captured.from_block(functional_call(work.block, params, (hidden, *args), kwargs))

        def forward(weights: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
            return block_with({param_of[n]: w.to(dtype[n]) for n, w in weights.items()}, rows)

        if self.target == "model":
            target = work.dense_outputs
        else:   # the block with every selected linear and expert unpruned
            layers = work.weights()
            dense = weight_params(work.block, layers)({n: w.to(layers[n].weight.dtype) for n, w in work.dense.items()})
            with torch.no_grad():
                target = torch.cat([block_with(dense, rows).to(work.hidden.device)
                                    for rows in torch.arange(work.hidden.shape[0]).split(self.batch)])

        def loss_of(weights: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
            out, want = forward(weights, rows).float(), target[rows].to(run.device).float()
            if self.loss == "global":
                return (out - want).pow(2).mean() / want.pow(2).mean().clamp_min(1e-12)
            # per token: a few tokens with massive activations (BOS, attention sinks) do not drown the rest
            return ((out - want).pow(2).sum(-1) / want.pow(2).sum(-1).clamp_min(1e-12)).mean()

        gen = torch.Generator().manual_seed(run.seed * 1_000_003 + work.index + 17)
        learn, judge = split_windows(work.hidden.shape[0], self.holdout, gen)
        start = {n: t.detach() for n, t in tensors.items()}
        with FrozenParams(work.block):
            fit = fit_kept_weights(start, {n: w != 0 for n, w in start.items()}, loss_of, learn, judge, self.steps,
                                   self.lr, self.batch, self.check_every, self.patience, gen)
        for n, t in tensors.items():
            t.data.copy_(fit.weights[n].to(t.dtype))
        work.report["blockrecon"] = {"steps_run": fit.steps_run, "best_step": fit.best_step,
                                     "stopped_early": fit.stopped_early,
                                     "held_out_before": round(fit.held_out[0], 6),
                                     "held_out_after": round(min(fit.held_out), 6),
                                     "windows_learned": len(learn), "windows_judged": len(judge)}
