"""The one place that knows how a decoder-only LM is laid out, found from the module tree.

``find_blocks`` locates the decoder block list (the largest ``ModuleList`` of blocks that all
contain linear layers), ``block_linears`` lists a block's ``nn.Linear`` layers filtered by
``--only`` / ``--skip`` globs (``model_linears``: every block's), ``block_experts`` the expert matrices of its fused MoE layers (each
seen as a linear's weight, :class:`ExpertWeight`; experts in a layout of the model's own are found
by tracing a block, :mod:`shuffleprune.stacked_experts`), and ``weights_outside_linears`` what
none reaches. How blocks are called and run alone is :mod:`shuffleprune.block_inputs`. No branch looks
at the model's name.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Callable, Iterator

import torch
from torch import nn

from shuffleprune.errors import UserError

from shuffleprune.conv1d import Conv1D


@dataclass
class Blocks:
    """The decoder block list of a model and its dotted name (e.g. ``model.layers``)."""

    name: str
    layers: nn.ModuleList

    def __len__(self) -> int:
        return len(self.layers)

    def prefix(self, index: int) -> str:
        """Block ``index``'s dotted name, which its layers' full names start with."""
        return f"{self.name}.{index}"

    def named(self) -> Iterator[tuple[str, nn.Module]]:
        """``(prefix, block)`` of every block, in order."""
        return ((self.prefix(i), block) for i, block in enumerate(self.layers))


def find_blocks(model: nn.Module) -> Blocks:
    """Find the decoder blocks: the ``ModuleList`` with the most parameters among those whose every
    member contains linear layers (hybrid models mix block classes in it: Jamba's attention and
    Mamba blocks). GPT-2's ``Conv1D`` layers count as linears (prune and ``load_model`` hold them as
    ``nn.Linear``: :mod:`shuffleprune.conv1d`)."""
    from shuffleprune.deploy.sparse_linear import SparseLinear

    layer_types = (nn.Linear, SparseLinear, *((Conv1D,) if Conv1D else ()))

    def has_linears(block: nn.Module) -> bool:
        return any(isinstance(m, layer_types) for m in block.modules())

    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if not all(has_linears(block) for block in module):
            continue
        size = sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers())
        if best is None or size > best[0]:
            best = (size, name, module)
    if best is None:
        raise UserError("no decoder block list with nn.Linear layers found in this model")
    return Blocks(name=best[1], layers=best[2])


def text_config(model: nn.Module):
    """The config of the model's language decoder: the model's own, or the text part of a multimodal
    model's (Gemma 3, Llama 4, Mistral 3: ``vocab_size``, heads and context length live there)."""
    config = getattr(model, "config", None)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def head_layout(attention: nn.Module, config, width: int) -> tuple[int | None, int | None, int | None]:
    """(query heads, KV heads, head size) of the attention module whose output projection reads
    ``width`` inputs: from the module's own ``head_dim`` and ``num_key_value_groups`` where it has
    them (transformers' attention modules; per layer, so models whose layers differ are read right),
    else from the model config (``None`` where it has no single value)."""
    d, groups = getattr(attention, "head_dim", None), getattr(attention, "num_key_value_groups", None)
    if isinstance(d, int) and isinstance(groups, int) and d > 0 and groups > 0 and width % (d * groups) == 0:
        return width // d, width // d // groups, d
    return tuple(config_value(config, key) for key in ("num_attention_heads", "num_key_value_heads", "head_dim"))


def resolved_heads(heads_of: tuple[int | None, int | None, int | None], width: int) -> tuple[int, int, int] | None:
    """:func:`head_layout`'s answer completed for a layer of ``width`` head columns: (query heads, KV
    heads, head size), a missing KV count read as multi-head and a missing head size as ``width /
    heads``; None where it does not describe ``width`` columns of whole KV groups."""
    heads, kv, d = heads_of
    kv = kv or heads
    if not heads or not kv or heads % kv or width % heads:
        return None
    d = d or width // heads
    return (heads, kv, d) if heads * d == width else None


def config_value(config, key: str) -> int | None:
    """A config's value, ``None`` where it has none or none for the whole model (transformers refuses
    to read a per-layer attribute of a config whose layers differ, Gemma 4's ``head_dim``)."""
    try:
        return getattr(config, key, None)
    except Exception:  # noqa: BLE001 - AmbiguousGlobalPerLayerAttributeError, and any config that raises
        return None


def is_plain_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` that computes ``x Wᵀ + b``: ``nn.Linear`` itself, a class that says so
    (``is_linear_map``: shuffleprune's ``PermutedLinear``), or a subclass whose own ``forward`` gives
    ``F.linear``'s result on a probe (Falcon's ``FalconLinear``). A subclass that computes something
    else, such as a MoE router that returns its top-k choice, is a custom layer and is left alone."""
    if not isinstance(module, nn.Linear):
        return False
    if type(module).forward is nn.Linear.forward or getattr(type(module), "is_linear_map", False):
        return True
    return _computes_linear(module)


@torch.no_grad()
def _computes_linear(module: nn.Linear) -> bool:
    w = module.weight
    x = torch.randn(2, module.in_features, generator=torch.Generator().manual_seed(0)).to(w.device, w.dtype)
    try:
        out = module(x)
    except Exception:  # noqa: BLE001 - any failure means it is not a drop-in linear layer
        return False
    want = torch.nn.functional.linear(x, w, module.bias)
    return (isinstance(out, torch.Tensor) and out.shape == want.shape
            and torch.allclose(out.float(), want.float(), rtol=1e-3, atol=1e-3))


def block_linears(block: nn.Module, prefix: str, only: list[str] | None = None,
                  skip: list[str] | None = None) -> dict[str, nn.Linear]:
    """``{full_name: module}`` of a block's ``nn.Linear`` layers (:func:`is_plain_linear`; and exported
    ``SparseLinear`` ones), filtered by fnmatch globs on the full name."""
    from shuffleprune.deploy.sparse_linear import SparseLinear

    found = {}
    for sub, module in block.named_modules():
        if not (is_plain_linear(module) or isinstance(module, SparseLinear)):
            continue
        full = _join(prefix, sub)
        if selected_by_globs(full, only, skip):
            found[full] = module
    return found


def model_linears(blocks: Blocks, only: list[str] | None = None,
                  skip: list[str] | None = None) -> dict[str, nn.Linear]:
    """:func:`block_linears` of every block, in block order."""
    return {name: lin for prefix, block in blocks.named() for name, lin in block_linears(block, prefix, only, skip).items()}


def decoder_of(model: nn.Module, blocks: Blocks) -> nn.Module:
    """The text decoder: the innermost module above the block list whose forward takes ``input_ids``, which
    returns the final hidden state (``last_hidden_state``, before any LM head). Usually the list's parent;
    where that module runs the blocks on hidden states only (CPM-Ant's encoder, HRM's stacks), the module
    above it that embeds the tokens. ``model.base_model`` is not always it (Llama 4's causal LM names no base
    model; a multimodal model's is the whole tower)."""
    path = blocks.name.rpartition(".")[0]
    while path:
        module = model.get_submodule(path)
        if _takes_input_ids(module):
            return module
        path = path.rpartition(".")[0]
    return model


def _takes_input_ids(module: nn.Module) -> bool:
    """Whether ``module``'s forward names an ``input_ids`` parameter."""
    try:
        return "input_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):   # a forward without a signature to read
        return False


def _join(*parts: str) -> str:
    """A dotted module path from its non-empty parts (a block's prefix or a submodule's name may be empty)."""
    return ".".join(p for p in parts if p)


def selected_by_globs(name: str, only: list[str] | None, skip: list[str] | None) -> bool:
    """Whether ``--only`` / ``--skip`` fnmatch globs keep ``name``."""
    return (not only or any(fnmatch(name, g) for g in only)) and not (skip and any(fnmatch(name, g) for g in skip))


@dataclass(eq=False)
class ExpertWeight:
    """One expert's matrix inside a fused MoE parameter, seen as a linear layer's weight.

    transformers 5 stores a layer's experts as one parameter ``[experts, out, in]`` (``[experts, in,
    out]`` when the experts module says ``is_transposed``) and calls ``F.linear(x, P[e])`` (or
    ``x @ P[e]``) on the tokens routed to expert ``e``. Custom layouts found by tracing a block
    (:mod:`shuffleprune.stacked_experts`) may keep the experts stacked in a 2-D parameter: ``view`` is
    then the 3-D shape the parameter is read as. ``weight`` is the ``[out, in]`` view of expert
    ``index`` into the parameter as it is now (the block may have moved devices), so a stage writes
    into the model by ``weight.copy_``.
    """

    owner: nn.Module
    param: str
    index: int
    transposed: bool
    view: tuple[int, int, int] | None = None
    scope: str | None = None   # a traced layout's: the module whose forward holds every use (where a load serves it)

    def fused(self, t: torch.Tensor | None = None) -> torch.Tensor:
        """``t``, a tensor shaped like the parameter (by default its data; the parameter itself, its
        gradient or an optimizer moment), as ``[experts, out, in]`` (``[experts, in, out]`` when transposed)."""
        t = getattr(self.owner, self.param).data if t is None else t
        return t if self.view is None else t.view(self.view)

    def matrix(self, t: torch.Tensor | None = None) -> torch.Tensor:
        """This expert's ``[out, in]`` view into ``t`` (as in :meth:`fused`): writes land in ``t``."""
        w = self.fused(t)[self.index]
        return w.t() if self.transposed else w

    def rebuilt(self, weights: dict[int, torch.Tensor], t: torch.Tensor | None = None) -> torch.Tensor:
        """``t`` (as in :meth:`fused`) with expert ``e``'s matrix replaced by ``weights[e]`` (``[out, in]``),
        in the parameter's own shape: a new tensor, differentiable in ``weights`` (and in ``t``)."""
        t = getattr(self.owner, self.param).data if t is None else t
        return with_expert_weights(self.fused(t), weights, self.transposed).reshape(t.shape)

    @property
    def weight(self) -> torch.Tensor:
        return self.matrix()

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


def expert_name(param: str, expert: int) -> str:
    """The name of one expert's matrix in a fused parameter (``…experts.down_proj[3]``): in reports,
    ``--only``/``--skip`` globs, index maps and the export."""
    return f"{param}[{expert}]"


def parse_expert_name(name: str) -> tuple[str, int] | None:
    """``(fused parameter name, expert)`` of an :func:`expert_name`; ``None`` for any other name."""
    if not name.endswith("]") or "[" not in name:
        return None
    param, _, index = name[:-1].rpartition("[")
    return (param, int(index)) if index.isdigit() else None


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a fused experts layer of transformers' experts interface (the
    ``use_experts_implementation`` decorator gives it ``is_transposed`` and a ``config`` whose
    ``_experts_implementation`` picks the forward)."""
    return (isinstance(getattr(module, "is_transposed", None), bool) and hasattr(module, "config")
            and any(p.dim() == 3 for p in module.parameters(recurse=False)))


def block_experts(block: nn.Module, prefix: str, only: list[str] | None = None,
                  skip: list[str] | None = None) -> dict[str, ExpertWeight]:
    """``{full_name: ExpertWeight}`` of every expert matrix in a block's fused experts layers, named
    ``{prefix}.{module}.{param}[{expert}]`` (e.g. ``model.layers.0.mlp.experts.down_proj[3]``) and
    filtered by the same globs as :func:`block_linears`."""
    found = {}
    for sub, module in block.named_modules():
        if not is_fused_experts(module):
            continue
        for pname, p in module.named_parameters(recurse=False):
            if p.dim() != 3:
                continue
            for e in range(p.shape[0]):
                full = expert_name(_join(prefix, sub, pname), e)
                if selected_by_globs(full, only, skip):
                    found[full] = ExpertWeight(module, pname, e, module.is_transposed)
    return found


def experts_by_tensor(experts: dict[str, ExpertWeight]) -> dict[str, dict[int, ExpertWeight]]:
    """``experts`` grouped by the fused tensor that holds them: ``{tensor's full name: {expert: ExpertWeight}}``."""
    grouped: dict[str, dict[int, ExpertWeight]] = {}
    for name, expert in experts.items():
        fused, e = parse_expert_name(name)
        grouped.setdefault(fused, {})[e] = expert
    return grouped


GATING_WIDTH = 8   # a linear with at most this many inputs or outputs computes scores or coefficients, not features


def gating_linears(linears: dict[str, nn.Module], experts: dict[str, ExpertWeight]) -> set[str]:
    """The names among a block's ``linears`` that route, gate or mix rather than transform features
    (``experts``: all of the block's MoE experts, fused or stacked, named from the same root): a
    router — inside the module that holds an experts layer, reading what its experts read, one
    output per expert (DBRX's ``ffn.router.layer``) — and any linear with at most
    :data:`GATING_WIDTH` inputs or outputs — a shared expert's scalar gate (Qwen2-MoE's
    ``shared_expert_gate``), Gemma 3n's AltUp router and coefficient layers (4 streams in, 4 or 16
    coefficients out). They hold a negligible share of the weights, N:M would cut half of each
    score's inputs, and what the block computes hangs on them: prune and dst keep them dense."""
    layers: dict[str, list[ExpertWeight]] = {}   # per module holding an experts layer (…mlp of …mlp.experts.down_proj)
    for param, by_expert in experts_by_tensor(experts).items():
        layers.setdefault(param.rpartition(".")[0].rpartition(".")[0], []).extend(by_expert.values())
    routers = []   # (container, experts, the width the experts read and write: the layer's input)
    for container, members in layers.items():
        count = max(e.index for e in members) + 1
        ins, outs = {e.in_features for e in members}, {e.out_features for e in members}
        routers += [(container, count, width) for width in (ins & outs or ins)]

    def routes(name: str, lin: nn.Module) -> bool:
        out, inp = _widths(lin)
        return any(out == count and inp == width and name.startswith(f"{container}.")
                   for container, count, width in routers)

    return {name for name, lin in linears.items() if min(_widths(lin)) <= GATING_WIDTH or routes(name, lin)}


def _widths(layer: nn.Module) -> tuple[int, int]:
    """A linear's (or a ``Conv1D``'s, stored ``[in, out]``) ``(outputs, inputs)``."""
    out = getattr(layer, "out_features", None) or layer.nf
    return out, layer.weight.numel() // out


def with_expert_weights(fused: torch.Tensor, weights: dict[int, torch.Tensor], transposed: bool) -> torch.Tensor:
    """A fused experts tensor with expert ``e``'s matrix replaced by ``weights[e]`` (``[out, in]``),
    the others as in ``fused``: a new tensor, differentiable in ``weights``."""
    return torch.stack([(weights[e].t() if transposed else weights[e]).to(fused.dtype) if e in weights else fused[e]
                        for e in range(fused.shape[0])])


def weight_params(root: nn.Module, layers: dict[str, "nn.Module | ExpertWeight"]
                  ) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """A function from ``{layer name: [out, in] weight}`` (some of ``layers``: linears and experts
    of fused MoE layers, all inside ``root``) to the parameters ``torch.func.functional_call(root, …)``
    takes to run ``root`` with those weights: a linear's ``weight``, and for experts their fused
    tensor rebuilt with the given experts' matrices (:func:`with_expert_weights`)."""
    paths = {id(m): n for n, m in root.named_modules()}
    path = {name: _join(paths[id(layer.owner)], layer.param) if isinstance(layer, ExpertWeight)
            else _join(paths[id(layer)], "weight") for name, layer in layers.items()}

    def params(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out, fused = {}, {}
        for name, w in weights.items():
            layer = layers[name]
            if isinstance(layer, ExpertWeight):
                fused.setdefault(path[name], (layer, {}))[1][layer.index] = w
            else:
                out[path[name]] = w
        for p, (layer, by_expert) in fused.items():
            out[p] = layer.rebuilt(by_expert)
        return out

    return params


OUTSIDE_LINEARS_WARN_SHARE = 0.05   # above this share of the blocks' matrix weights outside nn.Linear, prune warns


def weights_outside_linears(block: nn.Module, prefix: str) -> dict[str, int]:
    """``{full_name: numel}`` of a block's matrices (parameters of 2 dims or more) held outside
    :func:`is_plain_linear` layers: MoE experts (which prune reaches through :func:`block_experts` and
    :mod:`shuffleprune.stacked_experts`; the driver counts those it selected as seen), routers, other
    custom weights."""
    found = {}
    for sub, module in block.named_modules():
        if is_plain_linear(module):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.dim() >= 2:
                found[_join(prefix, sub, name)] = p.numel()
    return found
