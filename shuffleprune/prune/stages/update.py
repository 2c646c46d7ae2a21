"""``update`` stages: weight updates after the mask, which never loosen it (only kept weights change).

- ``lsq``: the exact masked least-squares update of :mod:`shuffleprune.prune.methods.lsq` — for
  each linear, the kept weights that best reproduce the dense layer's outputs on the block's
  calibration inputs (``XᵀX`` from the statistics stage), after any mask, with or without a
  permutation (the problem is per row and column order does not change it).
"""
from __future__ import annotations

from dataclasses import dataclass

from shuffleprune.errors import UserError
from shuffleprune.prune.methods.lsq import masked_lstsq
from shuffleprune.prune.stage import BlockWork, Run, RunSpec, Stage, register


@register
@dataclass
class LeastSquares(Stage):
    kind = "update"
    name = "lsq"
    damp: float = 0.01     # ridge term, as a fraction of mean(diag XᵀX)
    iters: int = 200       # conjugate-gradient steps at most
    tol: float = 1e-6      # relative residual per row

    def needs(self) -> set[str]:
        return {"gram", "dense_weights"}

    def check(self, spec: RunSpec) -> None:
        if self.iters < 1 or self.damp < 0 or self.tol <= 0:
            raise UserError("update 'lsq': iters must be ≥ 1, damp ≥ 0 and tol > 0")

    def apply(self, run: Run, work: BlockWork) -> None:
        for name, lin in work.linears.items():
            pruned = lin.weight.data
            new_w = masked_lstsq(work.dense[name], pruned != 0, work.stats[name].gram, start=pruned.float(),
                                 damp=self.damp, iters=self.iters, tol=self.tol)
            lin.weight.data.copy_(new_w.to(pruned.dtype))
