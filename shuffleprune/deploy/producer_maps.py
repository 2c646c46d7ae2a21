"""Index maps applied by the producer: the module whose output the mapped layers read writes it in
their order, so those layers read their input in order (issue 24's alternative to the in-kernel map).

An export's q/k/v (and gate/up) share one index map and read the output of one module, in LLaMA-like
blocks an RMSNorm. :func:`move_maps_to_producers` finds, per block, the module whose output *is*
the input tensor of the mapped ``SparseLinear`` layers (forward hooks on a probe), wraps it in
:class:`MappedOutput` and drops the layers' maps. Each move is kept only if the block's output on the
probe is unchanged (another reader of that output — a residual, say — would see it permuted), so no
architecture is assumed. A producer recognised as an RMSNorm (:func:`rms_form`, checked numerically,
not by class name) runs the one-pass Triton kernel ``kernels/norm_map.py`` on CUDA; any other
producer, and the CPU, computes its output and gathers it.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch import nn

from shuffleprune.block_inputs import block_probe
from shuffleprune.blocks import find_blocks
from shuffleprune.deploy.block_io import record_block_io
from shuffleprune.deploy.input_gather import gather_input, map_span
from shuffleprune.deploy.sparse_linear import SparseLinear
from shuffleprune.kernels.gpu import kernels_build


# A move is kept when the block's output on the probe (float32) moves by less than this, relative to its
# largest value: a valid move gives the same numbers (0), XGLM's q/k reading a norm's output moved for
# its v_proj changed it by 7e-5, the bound before (1e-4) let that through
MOVE_TOLERANCE = 1e-5


def rms_form(module: nn.Module, width: int) -> tuple[torch.Tensor, float, float] | None:
    """``(weight, eps, offset)`` when ``module(x)`` computes ``x / sqrt(mean(x²) + eps) · (weight +
    offset)`` over the last dimension (``offset`` 0 for LLaMA-style norms, 1 for Gemma-style), to
    within a few units of the weight's dtype on a probe; else None."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.shape != (width,) or getattr(module, "bias", None) is not None:
        return None
    eps = next((v for v in (getattr(module, a, None) for a in ("variance_epsilon", "eps")) if isinstance(v, float)), None)
    if eps is None:
        return None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, width, generator=gen) * torch.tensor([[0.05], [1.0], [40.0]]) + 0.5  # a mean: LayerNorm differs
    x = x.to(weight.device, weight.dtype)
    with torch.no_grad():
        y = module(x)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    tol = 4 * torch.finfo(weight.dtype).eps
    for offset in (0.0, 1.0):
        ref = normed * (weight.float() + offset)
        if bool(((y.float() - ref).abs() <= tol * ref.abs() + 1e-6).all()):
            return weight, eps, offset
    return None


class MappedOutput(nn.Module):
    """``inner``'s output in an index map's order: ``y = inner(x)[..., perm]``.

    ``kernel``: None (default) runs the fused RMSNorm kernel on CUDA when ``inner`` is an RMSNorm;
    True runs it on any device (tests under ``TRITON_INTERPRET=1``); False never."""

    def __init__(self, inner: nn.Module, perm: torch.Tensor, kernel: bool | None = None):
        super().__init__()
        self.inner, self.kernel = inner, kernel
        self.register_buffer("perm", perm.to(torch.int32))
        self.map_span = map_span(perm)   # the gather is measured per span (input_gather)
        form = rms_form(inner, perm.numel())
        self.eps = None if form is None else form[1]
        scale = None if form is None else (form[0].detach().float() + form[2])[perm.long().to(form[0].device)]
        self.register_buffer("scale", scale)

    def extra_repr(self) -> str:
        return f"width={self.perm.numel()}, fused_rmsnorm={self.scale is not None}"

    def __getattr__(self, name: str):
        """What the model reads off the module it replaced (FalconMamba: ``norm.weight.dtype``) is
        ``inner``'s."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("inner"), name)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        fused = self.scale is not None and not args and not kwargs and \
            (self.kernel or (self.kernel is None and x.is_cuda and kernels_build()))
        if fused:
            if torch.compiler.is_compiling():   # one opaque op: Dynamo neither traces the kernel nor its launch
                return torch.ops.shuffleprune.rmsnorm_mapped(x, self.scale, self.perm, self.eps)
            from shuffleprune.kernels.norm_map import rmsnorm_mapped

            return rmsnorm_mapped(x, self.scale, self.perm, self.eps)
        return gather_input(self.inner(x, *args, **kwargs), self.perm, span=self.map_span)


@torch.library.custom_op("shuffleprune::rmsnorm_mapped", mutates_args=())
def rmsnorm_mapped_op(x: torch.Tensor, scale: torch.Tensor, perm: torch.Tensor, eps: float) -> torch.Tensor:
    """The fused RMSNorm kernel (:func:`shuffleprune.kernels.norm_map.rmsnorm_mapped`) as one operator of a
    ``torch.compile`` graph. Traced as a user Triton kernel instead, its inline assembly (the
    dependent-launch release) defeats PyTorch's analysis of what the kernel writes, so every input
    counts as written and is copied, the norm's ``scale`` and ``perm`` buffers included (on an H100
    the compiled LLaMA-shaped model's CUDA graphs then found 128 kept tensors they did not track, as
    many as two per mapped norm for its 64; ``scripts/results/bench_e2e_compile.json``)."""
    from shuffleprune.kernels.norm_map import rmsnorm_mapped

    return rmsnorm_mapped(x, scale, perm, eps)


@rmsnorm_mapped_op.register_fake
def _rmsnorm_mapped_shape(x: torch.Tensor, scale: torch.Tensor, perm: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


def _is_mapped(module: nn.Module) -> bool:
    return isinstance(module, SparseLinear) and module.perm is not None


def has_maps(model: nn.Module) -> bool:
    """Whether any ``SparseLinear`` of ``model`` reads its input through an index map."""
    return any(_is_mapped(mod) for mod in model.modules())


def move_maps_to_producers(model: nn.Module, kernel: bool | None = None,
                           probe: Callable[[int], torch.Tensor] | None = None) -> dict[str, list[str]]:
    """Move the index maps of ``model``'s ``SparseLinear`` layers to the modules producing their input,
    where the block's output stays the same; returns ``{producer: [layers]}`` of the moves (in place).
    A model without mapped layers (any plain HF checkpoint) is returned untouched, never probed.
    ``probe``: a :func:`~shuffleprune.block_inputs.block_probe` of ``model`` to reuse (built here if None)."""
    if not has_maps(model):
        return {}
    blocks = find_blocks(model)
    run = probe or block_probe(model, blocks)
    half = next(model.parameters()).dtype in (torch.float16, torch.bfloat16)
    moved: dict[str, list[str]] = {}
    for i, block in enumerate(blocks.layers):
        prefix = blocks.prefix(i)
        groups: dict[str, list[str]] = {}
        io = record_block_io(block, partial(run, i), _is_mapped, leaves=True)
        reference = io.output
        for lin in io.inputs:
            producer = io.producer_of(lin)
            if producer is not None:
                groups.setdefault(producer, []).append(lin)
        if not groups:
            continue
        scale = reference.abs().max().clamp_min(1e-6)
        for producer, consumers in groups.items():
            layers = [block.get_submodule(c) for c in consumers]
            perm = layers[0].perm
            if any(not torch.equal(layer.perm, perm) for layer in layers[1:]):
                continue  # readers of one tensor under different maps: only the kernels can serve them
            others = [block.get_submodule(n) for n in io.modules_reading(io.inputs[consumers[0]]) if n not in consumers]
            if any(_holds_state(m) for m in others):
                continue  # a layer reads that output in order (XGLM's q/k beside a mapped v_proj)
            inner = block.get_submodule(producer)
            wrapped = MappedOutput(inner, perm, kernel=False)  # the check compares the layout, not a kernel
            saved = [(layer.perm, layer.shared_gather) for layer in layers]
            block.set_submodule(producer, wrapped)
            for layer in layers:
                layer.perm, layer.shared_gather = None, None
            if _block_unchanged(run, i, reference, scale, 1e-2 if half else MOVE_TOLERANCE):
                wrapped.kernel = kernel
                for layer in layers:  # what was measured with the map no longer applies
                    layer.forget_choices()
                moved[f"{prefix}.{producer}"] = [f"{prefix}.{c}" for c in consumers]
                continue
            block.set_submodule(producer, inner)  # undo: something else reads that output in order
            for layer, (p, shared) in zip(layers, saved):
                layer.perm, layer.shared_gather = p, shared
    return moved


def _holds_state(module: nn.Module) -> bool:
    """Whether ``module`` has weights (parameters or buffers: a compressed layer holds buffers), so that
    what it reads matters by position; stateless ones (an activation, dropout) the probe check covers."""
    return next(module.parameters(), None) is not None or next(module.buffers(), None) is not None


def _block_unchanged(run: Callable[[int], torch.Tensor], i: int, reference: torch.Tensor, scale: torch.Tensor,
                     tol: float) -> bool:
    """Whether block ``i`` still gives ``reference`` (within ``tol`` of its scale); a block that no
    longer runs (its code reads something of the module a move replaced) has changed."""
    try:
        out = run(i)
    except Exception:  # noqa: BLE001 - any model code may trip over the wrapper: the move is undone
        return False
    return bool(((out - reference).abs().max() / scale) < tol)
