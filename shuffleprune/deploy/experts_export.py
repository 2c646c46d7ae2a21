"""Fused MoE experts as ``export`` stores them: which fused parameters were pruned whole, and each expert's
matrix compressed like a linear layer (``NAME[e].values`` / ``.meta``, ``.perm`` where it has an index map)."""
from __future__ import annotations

import torch
from torch import nn

from shuffleprune.blocks import ExpertWeight, block_experts, expert_name, experts_by_tensor
from shuffleprune.deploy.format import compress


def was_pruned(name: str, weight: torch.Tensor, pruned: set[str] | None) -> bool:
    """Whether the run sparsified the layer or expert matrix ``name``: named in ``pruned`` (its
    report's layers), or, without a report, holding a zero."""
    return name in pruned if pruned is not None else bool((weight == 0).any())


def exportable_experts(block: nn.Module, prefix: str, pruned: set[str] | None = None,
                       stacked: dict[str, ExpertWeight] | None = None) -> dict[str, dict[int, ExpertWeight]]:
    """``{full_param_name: its experts}`` of a block's fused expert parameters (and of ``stacked``,
    its experts in layouts of the model's own) whose every expert :func:`was_pruned`; a parameter
    left dense, wholly or in part, stays in the dense checkpoint."""
    experts = {**block_experts(block, prefix), **(stacked or {})}
    return {name: members for name, members in experts_by_tensor(experts).items()
            if len(members) == next(iter(members.values())).fused().shape[0]
            and all(was_pruned(expert_name(name, e), x.weight, pruned) for e, x in members.items())}


def compress_experts(name: str, experts: dict[int, ExpertWeight], n: int, m: int,
                     maps: dict[int, torch.Tensor] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """One fused projection's pruned experts as the export stores them: each expert's N:M values and
    positions (``{expert_name}.values`` / ``.meta``), in its map's column order where ``maps`` has
    one (stored as ``.perm``, int32), and the format's entry for the projection (expert count,
    ``[out, in]``, the fused layout, whether maps are stored)."""
    tensors, maps = {}, maps or {}
    for e, expert in experts.items():
        key, perm = expert_name(name, e), maps.get(e)
        w = expert.weight if perm is None else expert.weight[:, perm.to(expert.weight.device)]
        tensors[f"{key}.values"], tensors[f"{key}.meta"] = compress(w, n, m, key)
        if perm is not None:
            tensors[f"{key}.perm"] = perm.to(torch.int32).contiguous()
    first = next(iter(experts.values()))
    entry = {"experts": len(experts), "shape": list(first.weight.shape), "transposed": first.transposed,
             "perm": any(e in maps for e in experts)}
    if first.scope is not None:   # a layout of the model's own: how it is read, and by which module's forward
        entry["stacked"] = {"view": list(first.view), "scope": first.scope}
    return tensors, entry
