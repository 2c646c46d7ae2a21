"""Fused MoE experts in an export: every expert's matrix held compressed as a :class:`SparseLinear`.

transformers 5 stores a layer's experts as one ``[experts, out, in]`` parameter per projection
(``[experts, in, out]`` when the layer ``is_transposed``) and picks the experts forward by name from
its experts interface (``config._experts_implementation``). ``export`` compresses each expert of a
pruned fused parameter like a linear layer (``NAME[e].values`` / ``NAME[e].meta``, and the
expert's index map ``NAME[e].perm`` when it has one: the kernel reads its input through it); on load
:func:`attach_sparse_experts` puts those in ``module.nm_experts[param][e]``, drops the dense
parameter, and selects :func:`nm_experts_forward`, registered with transformers as
``"shuffleprune_nm"``: the eager experts loop (tokens grouped by expert, gate or activation, biases,
post-expert norm, routing weights) with each projection run by the expert's sparse layer, or by its
dense slice where a parameter was left dense.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shuffleprune.blocks import ExpertWeight, block_experts, expert_name, experts_by_tensor, is_fused_experts
from shuffleprune.deploy.format import check_compressed, check_index_map
from shuffleprune.deploy.sparse_linear import SparseLinear
from shuffleprune.errors import UserError

IMPLEMENTATION = "shuffleprune_nm"


def _project(module: nn.Module, param: str, expert: int, x: torch.Tensor) -> torch.Tensor:
    """``x`` through expert ``expert``'s ``param`` projection (sparse when exported so), plus its bias."""
    held = getattr(module, "nm_experts", {})
    if param in held:
        out = held[param][expert](x)
    else:
        w = getattr(module, param)[expert]
        out = x @ w if module.is_transposed else F.linear(x, w)
    if getattr(module, "has_bias", False):
        out = out + getattr(module, f"{param}_bias")[expert]
    return out


def nm_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts forward of a layer with compressed experts: for each expert some token chose, its
    tokens through up (or gate-up), the gate or activation, and down, weighted and summed per token."""
    out = torch.zeros(hidden_states.shape, dtype=torch.float32, device=hidden_states.device)
    up = "gate_up_proj" if self.has_gate else "up_proj"
    k = top_k_index.shape[-1]
    chosen = top_k_index.reshape(-1)
    order = chosen.argsort(stable=True)                   # (token, slot) pairs grouped by expert
    counts = torch.bincount(chosen, minlength=self.num_experts).tolist()   # the one host sync
    ends = torch.tensor(counts).cumsum(0).tolist()
    for expert in range(self.num_experts):               # ids past num_experts: expert-parallel sentinels
        if counts[expert] == 0:
            continue
        pairs = order[ends[expert] - counts[expert]:ends[expert]]
        token, slot = pairs // k, pairs % k
        h = _project(self, up, expert, hidden_states[token])
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        y = _project(self, "down_proj", expert, h)
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        out.index_add_(0, token, y.float() * top_k_weights[token, slot, None].float())
    return out.to(hidden_states.dtype)


def _register() -> None:
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as exc:  # transformers 4 has no experts interface (nor fused experts)
        raise UserError("this export holds fused MoE experts, which need transformers 5 or newer; "
                        "pip install -U transformers") from exc

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, nm_experts_forward)


def exportable_experts(block: nn.Module, prefix: str) -> dict[str, dict[int, ExpertWeight]]:
    """``{full_param_name: its experts}`` of a block's fused expert parameters whose every expert was
    pruned (has zeros); a parameter left dense, wholly or in part, stays in the dense checkpoint."""
    return {name: experts for name, experts in experts_by_tensor(block_experts(block, prefix)).items()
            if all(bool((e.weight == 0).any()) for e in experts.values())}


def attach_sparse_experts(model: nn.Module, tensors: dict[str, torch.Tensor], fmt: dict, policy: str = "auto") -> None:
    """Hold the exported fused expert parameters of ``model`` compressed (``fmt["experts"]``) and run
    their layers with :func:`nm_experts_forward`."""
    entries = fmt.get("experts") or {}
    if not entries:
        return
    _register()
    n, m = fmt["n"], fmt["m"]
    configs = {}
    for name, info in entries.items():
        owner_name, _, param = name.rpartition(".")
        module = model.get_submodule(owner_name)
        dense = getattr(module, param, None)
        rows, cols = info["shape"]
        if not is_fused_experts(module) or dense is None or dense.shape[0] != info["experts"]:
            raise UserError(f"exported experts '{name}' ({info['experts']} × {rows}×{cols}) do not match the model config")
        layers = []
        for e in range(info["experts"]):
            key = expert_name(name, e)
            if f"{key}.values" not in tensors or f"{key}.meta" not in tensors:
                raise UserError(f"corrupt export: tensor '{key}.values' or '{key}.meta' missing from the sparse file")
            values, meta, perm = tensors[f"{key}.values"], tensors[f"{key}.meta"], tensors.get(f"{key}.perm")
            check_compressed(f"{key}.values/meta", values, meta, (rows, cols), n, m)
            check_index_map(key, perm, cols)
            layers.append(SparseLinear(values.to(dense.dtype), meta, cols, n, m, perm, None, policy=policy))
        if not hasattr(module, "nm_experts"):
            module.nm_experts = nn.ModuleDict()
        module.nm_experts[param] = nn.ModuleList(layers)
        module.register_parameter(param, None)   # no dense copy
        configs[id(module.config)] = module.config
    for config in configs.values():
        config._experts_implementation = IMPLEMENTATION
