"""Experts kept in a layout of the model's own (:mod:`shuffleprune.stacked_experts`), served compressed: the
dense parameter becomes a stand-in on the meta device, and each matrix product on a view of it runs on the
compressed experts the view selects, while the model's own forward runs unchanged around them."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from shuffleprune.deploy.sparse_experts import SparseExperts, grouped_runs_on
from shuffleprune.errors import UserError
from shuffleprune.stacked_experts import expert_layout, matmul_operands


def serve_stacked(scope: nn.Module, owner: nn.Module, param: str, experts: SparseExperts,
                  view: tuple[int, int, int], transposed: bool) -> None:
    """Serve experts kept in a layout of the model's own (:mod:`shuffleprune.stacked_experts`) from
    ``experts``: ``owner.param`` becomes a stand-in on the meta device (its shape, views and offsets,
    no data), and while ``scope`` runs (the module whose forward holds every use of it, found when
    the export traced the model) :class:`StackedProducts` computes each matrix product on a view of
    it with the compressed experts. The model's own forward runs unchanged around them."""
    dense = getattr(owner, param)
    stand_in = torch.empty(dense.shape, dtype=dense.dtype, device="meta")
    del owner._parameters[param]                  # no dense copy
    setattr(owner, param, stand_in)
    held = getattr(scope, "nm_stacked", None)
    if held is None:
        held = scope.nm_stacked = {}
        forward = scope.forward

        @torch.compiler.disable   # torch.compile: the scope runs eagerly (one graph break), the mode inside it
        def serve(*args, **kwargs):
            with StackedProducts(held):
                return forward(*args, **kwargs)
        scope.forward = serve
    held[id(stand_in)] = (stand_in, experts, view, transposed)


class StackedProducts(TorchFunctionMode):
    """While active: a matrix product whose right operand (``F.linear``'s weight turned round) is a
    view of a stand-in of ``held`` (``{id: (stand_in, SparseExperts, view, transposed)}``) runs on the
    compressed experts the view selects: one expert's slice through its :class:`.sparse_linear.SparseLinear`, all
    of them at once (``torch.bmm``) expert by expert. Any other call runs as it is."""

    def __init__(self, held: dict[int, tuple]):
        super().__init__()
        self.held = held

    def __torch_function__(self, func, types, args=(), kwargs=None):
        operands = matmul_operands(func, args, kwargs)
        if operands is not None and operands[1].is_meta:
            x, w = operands
            entry = self.held.get(id(w if w._base is None else w._base))
            if entry is not None:
                bias = (args[2] if len(args) > 2 else (kwargs or {}).get("bias")) if func is F.linear else None
                y = _stacked_product(x, w, *entry)
                return y if bias is None else y + bias
        return func(*args, **(kwargs or {}))


STACKED_GROUPED_MAX_ROWS = 16   # auto: all experts at once by the grouped (decode) kernel up to this many rows each


def _stacked_grouped(experts: SparseExperts, x: torch.Tensor) -> bool:
    """Whether a product over all stacked experts at once runs as one grouped launch: as ``mode``
    says, and under ``auto`` where the kernel runs (CUDA, N and M powers of two) for decode-sized
    inputs (not measured on a GPU yet: the per-expert layers' own choices serve longer inputs)."""
    if experts.mode != "auto":
        return experts.mode == "grouped"
    return grouped_runs_on(x) and experts.kernels_apply() and x.shape[1] <= STACKED_GROUPED_MAX_ROWS


def _stacked_product(x: torch.Tensor, w: torch.Tensor, stand_in: torch.Tensor, experts: SparseExperts,
                     view: tuple[int, int, int], transposed: bool) -> torch.Tensor:
    """``x · w`` for ``w`` a view (``[in, out]``, or ``[experts, in, out]``) of a stacked-experts
    stand-in, computed by the compressed experts it selects."""
    if expert_layout(w, stand_in) != (view, transposed):
        raise UserError(f"the model reads its exported experts {tuple(stand_in.shape)} in a way its export did not "
                        f"see ({tuple(w.shape)} at offset {w.storage_offset()}); export it again with this transformers")
    if w.dim() == 3:
        if x.dim() != 3 or x.shape[0] != len(experts):
            raise UserError(f"a product of {tuple(x.shape)} with all {len(experts)} exported experts at once needs "
                            "the experts as its leading dimension")
        if _stacked_grouped(experts, x):   # every (expert, row) pair in one launch
            ids = torch.arange(len(experts), device=x.device).repeat_interleave(x.shape[1])
            y, _ = experts.grouped(x.reshape(-1, x.shape[-1]), ids, 1)
            return y.view(len(experts), x.shape[1], -1)
        return torch.stack([experts[e](x[e]) for e in range(len(experts))])
    return experts[(w.storage_offset() - stand_in.storage_offset()) // w.numel()](x)
