"""The matrices dynamic sparse training masks, each seen as ``[out, in]``, and their densities.

A layer is an ``nn.Linear``, a transformers ``Conv1D`` (stored ``[in, out]``) or one expert's matrix
of a fused MoE parameter (:class:`~shuffleprune.blocks.ExpertWeight`, a view into the fused
tensor), in transformers' experts interface or stacked in a layout of the model's own (Llama 4,
DBRX: found by tracing one probe forward, :mod:`shuffleprune.stacked_experts`). The accessors here give the weight, its gradient and its optimizer moments as ``[out, in]``
views, so the sparsifier reads and writes all three kinds the same way.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from shuffleprune.blocks import (OUTSIDE_LINEARS_WARN_SHARE, Blocks, ExpertWeight, block_experts, find_blocks, gating_linears,
                                 is_fused_experts, is_plain_linear)
from shuffleprune.errors import UserError
from shuffleprune.stacked_experts import candidate_params, traced_stacked_experts

Layer = nn.Module | ExpertWeight


def is_conv1d(module: nn.Module) -> bool:
    """transformers' GPT-2 ``Conv1D`` (also when a parametrization has subclassed it)."""
    return any(c.__name__ == "Conv1D" for c in type(module).__mro__) and hasattr(module, "nf")


def sparsifiable_layers(model: nn.Module, experts: bool = True, head: bool = False) -> dict[str, Layer]:
    """Every ``nn.Linear`` (:func:`~shuffleprune.blocks.is_plain_linear`: not a subclass with its own
    ``forward``, like a MoE router) and transformers ``Conv1D``, except a layer sharing its weight with
    the input embeddings (a tied LM head) and, unless ``head``, the output embeddings (an untied LM
    head: ``prune`` and ``export`` leave it dense too) and the linears that route, gate or mix
    (:func:`block_gates`: prune keeps them dense too); with ``experts``, also every expert matrix of
    the MoE layers (named ``….experts.down_proj[3]``: fused in transformers' experts interface, or
    stacked in the model's own layout, :func:`stacked_expert_layers`). Without, warns when the
    experts, left dense, hold a large share of the weights."""
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied = embed.weight if embed is not None else None
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") and not head else None
    found: dict[str, Layer] = {n: m for n, m in model.named_modules()
                               if (is_plain_linear(m) or is_conv1d(m)) and m.weight is not tied and m is not output}
    try:
        blocks = find_blocks(model)
    except UserError:   # not a decoder LM (a user's own network): its linears, no experts
        blocks = None
    stacked = {} if blocks is None else stacked_expert_layers(model, blocks)
    if blocks is not None:  # routers, gates and coefficient layers stay dense, as prune keeps them
        for gate in block_gates(blocks, found, stacked):
            del found[gate]
    if experts:
        return found | block_experts(model, "") | stacked
    fused = sum(p.numel() for m in model.modules() if is_fused_experts(m)
                for p in m.parameters(recurse=False) if p.dim() == 3)
    fused += sum(e.weight.numel() for e in stacked.values())
    share = fused / max(1, fused + sum(m.weight.numel() for m in found.values()))
    if share > OUTSIDE_LINEARS_WARN_SHARE:
        warnings.warn(f"{share:.0%} of the model's weights are fused MoE experts, which this method does not "
                      "sparsify (they stay dense); rigl, set, srigl, dsb and nm mask them", UserWarning, stacklevel=3)
    return found


def block_gates(blocks: Blocks, layers: dict[str, nn.Module], stacked: dict[str, ExpertWeight]) -> set[str]:
    """The names among ``layers`` (named from the model's root) that route, gate or mix in a decoder
    block (:func:`~shuffleprune.blocks.gating_linears`; ``stacked``: the blocks' traced experts)."""
    gates = set()
    for prefix, block in blocks.named():
        inside = prefix + "."
        in_block = {n: m for n, m in layers.items() if n.startswith(inside)}
        experts = block_experts(block, prefix) | {n: e for n, e in stacked.items() if n.startswith(inside)}
        gates |= gating_linears(in_block, experts)
    return gates


def stacked_expert_layers(model: nn.Module, blocks: Blocks) -> dict[str, ExpertWeight]:
    """The expert matrices the decoder blocks keep stacked in parameters of their own layout, found
    by one forward of a fixed probe (in eval mode, without gradients:
    :func:`~shuffleprune.stacked_experts.traced_stacked_experts`). Nothing to trace (no block
    matrix outside linears, ``Conv1D`` and fused experts): ``{}``, no forward."""
    if not any(any(candidate_params(block)) for block in blocks.layers):
        return {}
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            found = traced_stacked_experts(model, blocks)
    finally:
        model.train(training)
    return {name: e for block in found for name, e in block.items()}


def out_in(layer: Layer, t: torch.Tensor) -> torch.Tensor:
    """A view ``[out, in]`` of a tensor shaped like ``layer``'s stored weight (``Conv1D`` stores
    ``[in, out]``; an expert's is the whole fused tensor, of which this is the expert's matrix)."""
    if isinstance(layer, ExpertWeight):
        return layer.matrix(t)
    return t.t() if is_conv1d(layer) else t


def stored_param(layer: Layer) -> nn.Parameter:
    """The parameter that holds ``layer``'s weight (and that the optimizer steps): the weight, its
    unmasked original under a ``diag`` parametrization, or an expert's whole fused tensor."""
    if isinstance(layer, ExpertWeight):
        return getattr(layer.owner, layer.param)
    if hasattr(layer, "parametrizations") and "weight" in layer.parametrizations:
        return layer.parametrizations.weight.original
    return layer.weight


def weight_of(layer: Layer) -> torch.Tensor:
    """``[out, in]`` view of the stored weight's data: writes go into the model."""
    return out_in(layer, stored_param(layer).data)


def grad_of(layer: Layer) -> torch.Tensor | None:
    """``[out, in]`` view of the weight's gradient, ``None`` before the first backward."""
    g = stored_param(layer).grad
    return None if g is None else out_in(layer, g)


def moments_of(layer: Layer, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """``[out, in]`` views of the optimizer's per-weight state (Adam's moments) of ``layer``."""
    if optimizer is None:
        return []
    p = stored_param(layer)
    return [out_in(layer, v) for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v) and v.shape == p.shape]


def shape_of(layer: Layer) -> tuple[int, int]:
    """``(out, in)``."""
    return tuple(weight_of(layer).shape)


def layer_densities(shapes: dict[str, tuple[int, int]], density: float, distribution: str) -> dict[str, float]:
    """Per-layer densities (``shapes``: name → (out, in)) whose weighted mean is ``density``."""
    if distribution == "uniform" or density >= 1.0:
        return {n: density for n in shapes}
    sizes = {n: o * i for n, (o, i) in shapes.items()}
    raw = {n: (o + i) / (o * i) for n, (o, i) in shapes.items()}
    dense: set[str] = set()
    budget = density * sum(sizes.values())
    while True:  # ERK with layers capped at density 1 (the budget of capped layers is set aside)
        free = budget - sum(sizes[n] for n in dense)
        scale = free / sum(raw[n] * sizes[n] for n in shapes if n not in dense)
        over = [n for n in shapes if n not in dense and raw[n] * scale > 1.0]
        if not over:
            return {n: 1.0 if n in dense else raw[n] * scale for n in shapes}
        dense.update(over)
