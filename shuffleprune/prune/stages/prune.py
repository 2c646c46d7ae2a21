"""``prune`` stages: each linear's mask and weight update, in permuted coordinates when the block has
index maps. One stage per method of :mod:`shuffleprune.prune.methods` (``magnitude``, ``wanda``,
``sparsegpt``, ``gradual``: gradual OBS masks inside the exact masked least-squares update); linears
that read one input are pruned in order of their group. The experts of fused MoE layers are pruned
with the statistics of their routed tokens; an expert that no calibration token reached gets a
magnitude mask (listed in the block's report as ``experts_pruned_by_magnitude``)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from shuffleprune.masks import Pattern
from shuffleprune.perm.core import in_permuted_columns
from shuffleprune.prune.input_stats import InputStats
from shuffleprune.errors import UserError
from shuffleprune.prune.methods import PruneFn, magnitude, sparsegpt, wanda
from shuffleprune.prune.methods.gradual import gradual_lstsq
from shuffleprune.prune.stage import BlockWork, Run, RunSpec, Stage, register


def prune_in_permuted_coordinates(method: PruneFn, weight: torch.Tensor, stats: InputStats | None,
                                  pattern: Pattern, perm: torch.Tensor) -> torch.Tensor:
    """Prune ``W[:, perm]`` with ``method`` (mask and any weight update in permuted coordinates) and
    return the result in the original column order. ``result[:, perm]`` satisfies the pattern."""
    return in_permuted_columns(lambda wp: method(wp, None if stats is None else stats.permuted(perm), pattern),
                               weight, perm)


class _MethodStage(Stage):
    method: PruneFn
    reads: frozenset[str] = frozenset()   # what the method reads from the statistics stage

    def needs(self) -> set[str]:
        return set(type(self).reads)

    def prune_fn(self) -> PruneFn:
        """The method with this stage's parameters bound."""
        return type(self).method

    def apply(self, run: Run, work: BlockWork) -> None:
        method = self.prune_fn()
        weights, unrouted = work.weights(), []
        for group in work.groups + work.expert_groups:
            for name in group:
                held, stats, perm, fn = weights[name], work.stats.get(name), work.perms.get(name), method
                if name in work.experts and stats is not None and stats.tokens == 0:  # no token reached this expert
                    unrouted.append(name)
                    fn, stats = magnitude, None
                weight = held.weight.data.float()
                new_w = fn(weight, stats, run.pattern) if perm is None else \
                    prune_in_permuted_coordinates(fn, weight, stats, run.pattern, perm)
                held.weight.data.copy_(new_w.to(held.weight.dtype))
        if unrouted:
            work.report["experts_pruned_by_magnitude"] = unrouted


@register
@dataclass
class Magnitude(_MethodStage):
    kind, name, method = "prune", "magnitude", staticmethod(magnitude)


@register
@dataclass
class Wanda(_MethodStage):
    kind, name, method, reads = "prune", "wanda", staticmethod(wanda), frozenset({"norms"})


@register
@dataclass
class SparseGPT(_MethodStage):
    kind, name, method, reads = "prune", "sparsegpt", staticmethod(sparsegpt), frozenset({"gram"})


@register
@dataclass
class Gradual(_MethodStage):
    """Masks chosen in rounds from the exact masked least-squares solution of the round before
    (:mod:`shuffleprune.prune.methods.gradual`)."""

    kind, name, reads = "prune", "gradual", frozenset({"gram"})
    rounds: int = 4        # unstructured sparsity: steps to the target (N:M always takes M − N)
    damp: float = 0.01     # ridge term, as a fraction of mean(diag XᵀX)
    iters: int = 100       # conjugate-gradient steps per round at most
    tol: float = 1e-6

    def check(self, spec: RunSpec) -> None:
        if self.rounds < 1 or self.iters < 1 or self.damp <= 0 or self.tol <= 0:
            raise UserError("prune 'gradual': rounds and iters must be ≥ 1, damp and tol > 0")

    def prune_fn(self) -> PruneFn:
        return partial(gradual_lstsq, rounds=self.rounds, damp=self.damp, iters=self.iters, tol=self.tol)
