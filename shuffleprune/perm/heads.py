"""Index maps that ``export`` can fold under grouped-query attention (head ties).

An attention output projection (LLaMA's ``o_proj``) reads the heads' outputs, ``[heads · d]``
columns. Its index map folds into the value projection's rows (no gather at run time) only when it
stays inside heads and the query heads that share a KV head agree on it: ``v_proj`` has one row per
KV head and dimension, and every query head of a group reads the same value rows. Under multi-head
attention a block-diagonal map with blocks dividing ``d`` always qualifies; under GQA an
independently chosen one almost never does.

A :class:`HeadTie` makes every permutation kind choose such a map: the layer's ``[R, heads·d]``
weight (and score) is viewed as ``[group·R, kv·d]`` — each query head's columns stacked under the
other heads of its group, as extra rows — so one permutation over ``kv·d`` columns serves every
head of a group, and N:M groups (inside a head, since ``d`` is a multiple of the block) see the
same rows they would in the layer. :meth:`HeadTie.expand` turns it into the layer's map.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shuffleprune.blocks import ExpertWeight, head_layout, resolved_heads


@dataclass(frozen=True)
class HeadTie:
    """A layer reading ``heads`` query heads of ``head_dim`` columns, ``heads / kv`` per KV head."""

    heads: int
    kv: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.heads // self.kv

    @property
    def width(self) -> int:
        """The columns of the tied permutation: one head's per KV head."""
        return self.kv * self.head_dim

    def fold(self, t: torch.Tensor) -> torch.Tensor:
        """``[R, heads·d]`` → ``[group·R, kv·d]``: row ``i·R + r``, column ``g·d + j`` is
        ``t[r, (g·group + i)·d + j]`` (query head ``g·group + i`` reads KV head ``g``)."""
        rows = t.shape[0]
        return t.reshape(rows, self.kv, self.group, self.head_dim).permute(2, 0, 1, 3).reshape(
            self.group * rows, self.width)

    def unfold(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`fold`."""
        rows = t.shape[0] // self.group
        return t.reshape(self.group, rows, self.kv, self.head_dim).permute(1, 2, 0, 3).reshape(
            rows, self.heads * self.head_dim)

    def expand(self, perm: torch.Tensor) -> torch.Tensor:
        """A map over the ``kv·d`` folded columns (inside heads) → the layer's map over ``heads·d``:
        ``unfold(fold(W)[:, perm]) == W[:, expand(perm)]``."""
        d = self.head_dim
        local = perm.reshape(self.kv, d) - torch.arange(self.kv, device=perm.device).unsqueeze(1) * d
        if bool((local < 0).any() or (local >= d).any()):
            raise ValueError("a tied map must stay inside heads (its blocks must divide the head size)")
        local = local.repeat_interleave(self.group, dim=0)                  # [heads, d]
        return (local + torch.arange(self.heads, device=perm.device).unsqueeze(1) * d).flatten()


def head_ties(root: nn.Module, linears: dict[str, nn.Module | ExpertWeight], groups: list[list[str]], config,
              block: int) -> dict[str, HeadTie]:
    """The linears of ``root`` whose maps a permutation stage ties (by name): those that read query
    heads under grouped-query attention, found from shapes and the attention module's head layout
    (:func:`~shuffleprune.blocks.head_layout`; no architecture is named): a linear of ``heads·d``
    inputs, ``heads > kv``, ``d`` a multiple of the permutation ``block``, beside a linear of ``kv·d``
    outputs in the same module that does not read its input (``o_proj`` beside ``v_proj``; q/k/v read
    one input, so ``q_proj`` is not tied). ``groups``: the linears that read one input."""
    parent_of = {id(child): module for module in root.modules() for child in module.children()}
    group_of = {name: i for i, g in enumerate(groups) for name in g}
    ties = {}
    for name, layer in linears.items():
        parent = parent_of.get(id(layer))
        if isinstance(layer, ExpertWeight) or parent is None:
            continue
        layout = resolved_heads(head_layout(parent, config, layer.in_features), layer.in_features)
        if layout is None or layout[0] == layout[1] or layout[2] % block:
            continue
        heads, kv, d = layout
        if any(other is not layer and not isinstance(other, ExpertWeight) and parent_of.get(id(other)) is parent
               and other.out_features == kv * d and group_of.get(other_name) != group_of.get(name)
               for other_name, other in linears.items()):
            ties[name] = HeadTie(heads, kv, d)
    return ties
