"""``prune`` stages: each linear's mask and weight update, in permuted coordinates when the block has
index maps. One stage per method of :mod:`shuffleprune.prune.methods` (``magnitude``, ``wanda``,
``sparsegpt``); linears that read one input are pruned in order of their group."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from shuffleprune.masks import Pattern
from shuffleprune.perm.core import in_permuted_columns
from shuffleprune.prune.input_stats import InputStats
from shuffleprune.prune.methods import PruneFn, magnitude, sparsegpt, wanda
from shuffleprune.prune.stage import BlockWork, Run, Stage, register


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

    def apply(self, run: Run, work: BlockWork) -> None:
        method = type(self).method
        for group in work.groups:
            for name in group:
                lin = work.linears[name]
                weight, stats, perm = lin.weight.data.float(), work.stats.get(name), work.perms.get(name)
                new_w = method(weight, stats, run.pattern) if perm is None else \
                    prune_in_permuted_coordinates(method, weight, stats, run.pattern, perm)
                lin.weight.data.copy_(new_w.to(lin.weight.dtype))


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
