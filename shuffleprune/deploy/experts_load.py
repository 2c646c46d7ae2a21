"""Fused MoE experts of an export loaded compressed: each projection's experts stacked in one
:class:`~shuffleprune.deploy.sparse_experts.SparseExperts` (no dense copy), run by the experts forward registered
with transformers, or, for a layout of the model's own, served through :mod:`.stacked_serving`."""
from __future__ import annotations

import torch
from torch import nn

from shuffleprune.blocks import expert_name, is_fused_experts
from shuffleprune.deploy.format import check_compressed, check_index_map
from shuffleprune.deploy.sparse_experts import IMPLEMENTATION, SparseExperts, register_experts_forward
from shuffleprune.deploy.stacked_serving import serve_stacked
from shuffleprune.errors import UserError


def attach_sparse_experts(model: nn.Module, tensors: dict[str, torch.Tensor], fmt: dict, policy: str = "auto") -> None:
    """Hold the exported fused expert parameters of ``model`` compressed (``fmt["experts"]``) and run
    their layers with :func:`~shuffleprune.deploy.sparse_experts.nm_experts_forward`."""
    entries = fmt.get("experts") or {}
    if not entries:
        return
    if any("stacked" not in info for info in entries.values()):
        register_experts_forward()
    n, m = fmt["n"], fmt["m"]
    configs = {}
    for name, info in entries.items():
        owner_name, _, param = name.rpartition(".")
        module = model.get_submodule(owner_name)
        dense = getattr(module, param, None)
        rows, cols = info["shape"]
        stacked = info.get("stacked")
        fits = dense is not None and (dense.numel() == info["experts"] * rows * cols if stacked
                                      else is_fused_experts(module) and dense.shape[0] == info["experts"])
        if not fits:
            raise UserError(f"exported experts '{name}' ({info['experts']} × {rows}×{cols}) do not match the model config")
        values, metas, perms = [], [], []
        for e in range(info["experts"]):
            key = expert_name(name, e)
            if f"{key}.values" not in tensors or f"{key}.meta" not in tensors:
                raise UserError(f"corrupt export: tensor '{key}.values' or '{key}.meta' missing from the sparse file")
            check_compressed(f"{key}.values/meta", tensors[f"{key}.values"], tensors[f"{key}.meta"], (rows, cols), n, m)
            check_index_map(key, tensors.get(f"{key}.perm"), cols)
            values.append(tensors.pop(f"{key}.values").to(dense.dtype))   # popped: the stack is the one copy
            metas.append(tensors.pop(f"{key}.meta"))
            perms.append(tensors.pop(f"{key}.perm", None))
        mapped = [p is not None for p in perms]
        perm = None if not any(mapped) else torch.stack(
            [p.to(dense.device, torch.int32) if p is not None else torch.arange(cols, dtype=torch.int32, device=dense.device)
             for p in perms])
        if not hasattr(module, "nm_experts"):
            module.nm_experts = nn.ModuleDict()
        module.nm_experts[param] = SparseExperts(torch.stack(values).to(dense.device), torch.stack(metas).to(dense.device),
                                                 cols, n, m, None if perm is None else perm.to(dense.device), mapped,
                                                 policy=policy)
        module.nm_experts[param].owner = module
        if stacked:
            serve_stacked(model.get_submodule(stacked["scope"]), module, param, module.nm_experts[param],
                          tuple(stacked["view"]), info["transposed"])
            continue
        module.register_parameter(param, None)   # no dense copy
        configs[id(module.config)] = module.config
    for config in configs.values():
        config._experts_implementation = IMPLEMENTATION
