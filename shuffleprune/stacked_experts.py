"""Experts stacked in parameters that a block's own forward multiplies by, found by tracing the block.

transformers' experts interface (:func:`~shuffleprune.blocks.block_experts`) covers most MoE models.
Some keep their own layout: one ``torch.bmm`` over an ``[experts, in, out]`` parameter that every
token passes through (Llama 4), or the experts' matrices stacked in a 2-D parameter ``[experts·rows,
cols]`` and multiplied one slice at a time (DBRX). :class:`MatmulTrace` runs a block once and sees
every matrix product whose right operand (``F.linear``'s weight turned round) is a view of a block
parameter no linear holds; the view's offset, shape and strides say how the parameter tiles into
experts' matrices and which way round each is. A parameter the block reads in two ways, or in
slices that are not whole experts, is left alone (it stays dense, counted in the report's
``outside_linears``). No branch looks at the model's name.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from shuffleprune.blocks import Blocks, ExpertWeight, expert_name, is_fused_experts, is_plain_linear, _join
from shuffleprune.conv1d import Conv1D

# Matrix products ``x · w`` as a forward may write them (``x @ w`` arrives as ``Tensor.__matmul__``).
_LINEAR = (F.linear,)
_PRODUCTS = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm,
             torch.mm, torch.Tensor.mm)

Layout = tuple[tuple[int, int, int], bool]   # (the parameter's 3-D view, experts stored [in, out])


def matmul_operands(func, args: tuple, kwargs: dict | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(x, w)`` of a matrix product ``x · w`` with ``w`` as ``[…, in, out]`` (``F.linear``'s
    ``[out, in]`` weight turned round); ``None`` for any other call."""
    kwargs = kwargs or {}
    if func in _LINEAR:
        x = args[0] if args else kwargs.get("input")
        w = args[1] if len(args) > 1 else kwargs.get("weight")
        w = w.mT if isinstance(w, torch.Tensor) and w.dim() == 2 else None
    elif func in _PRODUCTS:
        x = args[0] if args else kwargs.get("input")
        w = args[1] if len(args) > 1 else kwargs.get("other", kwargs.get("mat2"))
    else:
        return None
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and w.dim() in (2, 3)):
        return None
    return x, w


def operand_key(w: torch.Tensor) -> tuple:
    """Where a matrix operand starts, its shape and strides: equal for two views of the same elements
    in the same order."""
    return w.data_ptr(), tuple(w.shape), w.stride()


def expert_layout(w: torch.Tensor, param: torch.Tensor) -> Layout | None:
    """How ``param`` tiles into experts' matrices, read off ``w`` (a view of it used as ``[in, out]``,
    or ``[experts, in, out]`` for all of them at once): the 3-D shape it is read as and whether each
    expert is stored ``[in, out]``. ``None`` for a view that is not a whole expert (or of only one)."""
    if not param.is_contiguous():
        return None
    if param.is_meta:   # an export's stand-in: no addresses, the same offsets
        offset, rest = w.storage_offset() - param.storage_offset(), 0
    else:
        offset, rest = divmod(w.data_ptr() - param.data_ptr(), param.element_size())
    rows, cols = w.shape[-2:]
    chunk = rows * cols
    if rest or rows < 2 or cols < 2 or param.numel() % chunk or offset % chunk:
        return None
    experts = param.numel() // chunk
    if experts < 2 or (w.dim() == 3 and (offset or w.shape[0] != experts or w.stride(0) != chunk)):
        return None
    s_in, s_out = w.stride()[-2:]
    if s_out == 1 and s_in == cols:
        return (experts, rows, cols), True
    if s_in == 1 and s_out == rows:
        return (experts, cols, rows), False
    return None


def candidate_params(block: nn.Module) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
    """``(module, name, parameter)`` of each matrix (dims ≥ 2) of ``block`` that may hold stacked
    experts: outside linears (GPT-2's ``Conv1D`` among them) and transformers' experts layers."""
    for module in block.modules():
        if is_plain_linear(module) or is_fused_experts(module) or (Conv1D is not None and isinstance(module, Conv1D)):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.dim() >= 2:
                yield module, name, p


class MatmulTrace(TorchFunctionMode):
    """While a block runs inside :meth:`watch`: the layouts its matrix products read its candidate
    parameters in (:func:`candidate_params`), and the innermost module whose forward holds every use
    of each (its *scope*: where a load serves them)."""

    def __init__(self) -> None:
        super().__init__()
        self.params: dict[int, tuple[nn.Module, str, torch.Tensor]] = {}
        self.seen: dict[tuple[int, str], tuple[nn.Module, str, set]] = {}
        self.scopes: dict[tuple[int, str], tuple[str, ...]] = {}
        self.stack: list[str] = []

    @contextmanager
    def watch(self, block: nn.Module) -> Iterator["MatmulTrace"]:
        """Trace ``block`` (on the device it runs on) while it runs inside this context."""
        self.params, self.stack = {}, []
        for module, name, p in candidate_params(block):
            self.params[p.untyped_storage().data_ptr()] = (module, name, p)
        names = {id(m): n for n, m in block.named_modules()}

        def enter(module: nn.Module, _args) -> None:
            self.stack.append(names[id(module)])

        def leave(_module: nn.Module, _args, _out) -> None:
            self.stack.pop()

        hooks = [h for m in block.modules() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
        try:
            with self:
                yield self
        finally:
            for h in hooks:
                h.remove()
            self.params = {}

    def _uses(self, args: tuple, kwargs: dict | None) -> Iterator[tuple[nn.Module, str, torch.Tensor]]:
        """The candidate parameters among a call's tensor arguments."""
        for a in (*args, *(kwargs or {}).values()):
            if isinstance(a, torch.Tensor) and a.layout == torch.strided and not a.is_meta:
                found = self.params.get(a.untyped_storage().data_ptr())
                if found is not None:
                    yield found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.params:
            for module, name, _ in self._uses(args, kwargs):
                path = tuple(self.stack)
                known = self.scopes.setdefault((id(module), name), path)
                common = 0
                while common < min(len(known), len(path)) and known[common] == path[common]:
                    common += 1
                self.scopes[(id(module), name)] = known[:common]
            operands = matmul_operands(func, args, kwargs)
            if operands is not None:
                w = operands[1]
                found = self.params.get(w.untyped_storage().data_ptr()) if w.layout == torch.strided else None
                if found is not None:
                    module, name, p = found
                    entry = self.seen.setdefault((id(module), name), (module, name, set()))
                    entry[2].add(expert_layout(w, p))
        return func(*args, **(kwargs or {}))

    def layouts(self) -> Iterator[tuple[nn.Module, str, Layout, str]]:
        """Each traced parameter read in exactly one experts layout: with that layout and its scope
        (a module path inside the block; ``""`` for the block itself)."""
        for key, (module, name, layouts) in self.seen.items():
            if len(layouts) == 1 and None not in layouts:
                scope = self.scopes.get(key, ())
                yield module, name, next(iter(layouts)), scope[-1] if scope else ""


def stacked_experts(block: nn.Module, prefix: str, trace: MatmulTrace) -> dict[str, ExpertWeight]:
    """``{full_name: ExpertWeight}`` of every expert matrix of ``block`` that ``trace`` found stacked in
    a parameter, named like :func:`~shuffleprune.blocks.block_experts` (``{prefix}.{module}.{param}[{e}]``;
    the driver filters them by ``--only`` / ``--skip``)."""
    paths = {id(m): sub for sub, m in block.named_modules()}
    found = {}
    for module, pname, (view, transposed), scope in trace.layouts():
        if id(module) not in paths:
            continue
        for e in range(view[0]):
            full = expert_name(_join(prefix, paths[id(module)], pname), e)
            found[full] = ExpertWeight(module, pname, e, transposed, view, _join(prefix, scope))
    return found


def traced_stacked_experts(model: nn.Module, blocks: Blocks) -> list[dict[str, ExpertWeight]]:
    """Per block, :func:`stacked_experts` as one forward of a fixed random probe sequence shows them."""
    from shuffleprune.block_inputs import probe_inputs, run_blocks

    captured = probe_inputs(model, blocks)
    trace = MatmulTrace()
    run_blocks(blocks, captured.hidden, captured, next(model.parameters()).device, 1, around=trace.watch)
    return [stacked_experts(block, prefix, trace) for prefix, block in blocks.named()]
