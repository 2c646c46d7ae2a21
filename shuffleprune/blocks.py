"""The one place that knows how a decoder-only LM is laid out, found from the module tree.

``find_blocks`` locates the decoder block list (the largest ``ModuleList`` of identical blocks that
contain linear layers), ``block_linears`` lists a block's ``nn.Linear`` layers filtered by
``--only`` / ``--skip`` globs, and ``capture_block_inputs`` runs the model's own forward up to the
blocks to record block 0's hidden states and every block's keyword arguments (attention masks,
position embeddings, …), whatever the architecture passes. ``block_probe`` runs every block on one
fixed probe sequence, so a change to one block (a folded or moved index map) can be checked on that
block alone. No branch looks at the model's name.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any, Callable

import torch
from torch import nn

from shuffleprune.errors import UserError

try:  # GPT-2-style layers: recognised so they can be refused clearly
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover
    Conv1D = ()


@dataclass
class Blocks:
    """The decoder block list of a model and its dotted name (e.g. ``model.layers``)."""

    name: str
    layers: nn.ModuleList

    def __len__(self) -> int:
        return len(self.layers)


def find_blocks(model: nn.Module) -> Blocks:
    """Find the decoder blocks: the ``ModuleList`` of same-type modules with the most parameters
    among those whose members contain linear layers."""
    from shuffleprune.deploy.sparse_linear import SparseLinear

    best: tuple[int, str, nn.ModuleList] | None = None
    conv1d_seen = False
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        inner = list(module[0].modules())
        if Conv1D and any(isinstance(m, Conv1D) for m in inner):
            conv1d_seen = True
        if not any(isinstance(m, (nn.Linear, SparseLinear)) for m in inner):
            continue
        size = sum(p.numel() for p in module.parameters()) + sum(b.numel() for b in module.buffers())
        if best is None or size > best[0]:
            best = (size, name, module)
    if best is None:
        if conv1d_seen:
            raise UserError("this model uses GPT-2-style Conv1D layers, which prune does not support; "
                            "use a model built from nn.Linear (LLaMA, Mistral, Qwen2, Gemma, …)")
        raise UserError("no decoder block list with nn.Linear layers found in this model")
    return Blocks(name=best[1], layers=best[2])


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
        if _selected(full, only, skip):
            found[full] = module
    return found


def _join(*parts: str) -> str:
    """A dotted module path from its non-empty parts (a block's prefix or a submodule's name may be empty)."""
    return ".".join(p for p in parts if p)


def _selected(name: str, only: list[str] | None, skip: list[str] | None) -> bool:
    """Whether ``--only`` / ``--skip`` fnmatch globs keep ``name``."""
    return (not only or any(fnmatch(name, g) for g in only)) and not (skip and any(fnmatch(name, g) for g in skip))


@dataclass(eq=False)
class ExpertWeight:
    """One expert's matrix inside a fused MoE parameter, seen as a linear layer's weight.

    transformers 5 stores a layer's experts as one parameter ``[experts, out, in]`` (``[experts, in,
    out]`` when the experts module says ``is_transposed``) and calls ``F.linear(x, P[e])`` (or
    ``x @ P[e]``) on the tokens routed to expert ``e``. ``weight`` is the ``[out, in]`` view of
    expert ``index`` into the parameter as it is now (the block may have moved devices), so a
    stage writes into the model by ``weight.copy_``.
    """

    owner: nn.Module
    param: str
    index: int
    transposed: bool

    def fused(self) -> torch.Tensor:
        return getattr(self.owner, self.param).data

    @property
    def weight(self) -> torch.Tensor:
        w = self.fused()[self.index]
        return w.t() if self.transposed else w

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
                if _selected(full, only, skip):
                    found[full] = ExpertWeight(module, pname, e, module.is_transposed)
    return found


def experts_by_tensor(experts: dict[str, ExpertWeight]) -> dict[str, dict[int, ExpertWeight]]:
    """``experts`` grouped by the fused tensor that holds them: ``{tensor's full name: {expert: ExpertWeight}}``."""
    grouped: dict[str, dict[int, ExpertWeight]] = {}
    for name, expert in experts.items():
        fused, e = parse_expert_name(name)
        grouped.setdefault(fused, {})[e] = expert
    return grouped


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
            out[p] = with_expert_weights(layer.fused(), by_expert, layer.transposed)
        return out

    return params


OUTSIDE_LINEARS_WARN_SHARE = 0.05   # above this share of the blocks' matrix weights outside nn.Linear, prune warns


def weights_outside_linears(block: nn.Module, prefix: str) -> dict[str, int]:
    """``{full_name: numel}`` of a block's matrices (parameters of 2 dims or more) held outside
    :func:`is_plain_linear` layers: fused MoE experts (which prune reaches through
    :func:`block_experts`; the driver counts those it selected as seen), routers, other custom weights."""
    found = {}
    for sub, module in block.named_modules():
        if is_plain_linear(module):
            continue
        for name, p in module.named_parameters(recurse=False):
            if p.dim() >= 2:
                found[_join(prefix, sub, name)] = p.numel()
    return found


def first_tensor(output: Any) -> torch.Tensor:
    """The hidden states in a block's output (a tensor, or the first element of a tuple)."""
    return output[0] if isinstance(output, (tuple, list)) else output


class _StopForward(Exception):
    pass


class _Recorder(nn.Module):
    """Stands in for a decoder block during capture: records the call and returns its input unchanged
    (in the block's own output convention) or, when nothing more is needed, stops the forward."""

    def __init__(self, block: nn.Module, index: int, sink: "CapturedInputs", stop: bool, record_kwargs: bool):
        super().__init__()
        self.block = block
        self.index = index
        self.sink = sink
        self.stop = stop
        self.record_kwargs = record_kwargs

    def __getattr__(self, name: str) -> Any:  # models read attributes like ``attention_type`` off blocks
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("block"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            hidden, rest = args[0], args[1:]
        else:
            hidden, rest = kwargs.pop("hidden_states"), ()
        if self.index == 0:
            self.sink.batches.append(hidden.detach())
        if self.record_kwargs:
            kw = {k: v for k, v in kwargs.items() if k not in ("past_key_value", "past_key_values")}
            if "use_cache" in kw:
                kw["use_cache"] = False
            self.sink.args.append(rest)
            self.sink.kwargs.append(kw)
        if self.stop:
            raise _StopForward
        return (hidden,) if self.sink.output_is_tuple else hidden


class PerWindow:
    """A block argument laid out window by window along dim 0 that does not broadcast over a batch
    (BLOOM's ALiBi bias is ``[batch·heads, 1, L]``): held for one window, repeated for a batch."""

    def __init__(self, one: torch.Tensor):
        self.one = one

    def expand(self, batch: int) -> torch.Tensor:
        return self.one.repeat(batch, *([1] * (self.one.dim() - 1)))


def _for_batch(obj: Any, batch: int, device: torch.device) -> Any:
    """Every tensor inside ``obj`` (nested tuples/lists/dicts) on ``device``, each :class:`PerWindow`
    repeated for ``batch`` windows."""
    if isinstance(obj, PerWindow):
        return obj.expand(batch).to(device)
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_for_batch(o, batch, device) for o in obj)
    if isinstance(obj, list):
        return [_for_batch(o, batch, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _for_batch(v, batch, device) for k, v in obj.items()}
    return obj


def _mark_per_window(one: Any, two: Any) -> Any:
    """The arguments recorded for one window, with those recorded for two windows as two copies of it
    along dim 0 marked :class:`PerWindow`. A leading dim of 1 broadcasts and stays as it is, and so
    does anything else (as recorded for one window)."""
    if isinstance(one, torch.Tensor) and isinstance(two, torch.Tensor):
        if one.dim() == 0 or one.shape == two.shape or one.shape[0] == 1:
            return one
        doubled = two.shape[1:] == one.shape[1:] and two.shape[0] == 2 * one.shape[0]
        return PerWindow(one) if doubled and torch.equal(two, torch.cat([one, one])) else one
    if isinstance(one, (tuple, list)) and isinstance(two, (tuple, list)) and len(one) == len(two):
        return type(one)(_mark_per_window(a, b) for a, b in zip(one, two))
    if isinstance(one, dict) and isinstance(two, dict) and one.keys() == two.keys():
        return {k: _mark_per_window(v, two[k]) for k, v in one.items()}
    return one


@dataclass
class CapturedInputs:
    """Block 0's hidden states ``[n, L, d]`` and each block's extra call arguments, recorded for one window
    (:meth:`call_args` gives them for a batch)."""

    hidden: torch.Tensor | None = None
    args: list[tuple] = field(default_factory=list)      # per block
    kwargs: list[dict] = field(default_factory=list)     # per block
    output_is_tuple: bool = False
    batches: list[torch.Tensor] = field(default_factory=list)

    def call_args(self, index: int, batch: int, device: torch.device) -> tuple[tuple, dict]:
        """Block ``index``'s extra positional and keyword arguments for ``batch`` windows on ``device``."""
        return _for_batch(self.args[index], batch, device), _for_batch(self.kwargs[index], batch, device)


def _forward_with_recorders(model: nn.Module, blocks: "Blocks", originals: list[nn.Module], sink: CapturedInputs,
                            input_ids: torch.Tensor, all_blocks: bool) -> None:
    last = len(originals) - 1 if all_blocks else 0
    for i, block in enumerate(originals[: last + 1]):
        blocks.layers[i] = _Recorder(block, i, sink, stop=i == last, record_kwargs=all_blocks)
    try:
        model(input_ids=input_ids, use_cache=False)
    except _StopForward:
        pass
    finally:
        for i, block in enumerate(originals):
            blocks.layers[i] = block


@torch.no_grad()
def capture_block_inputs(model: nn.Module, blocks: Blocks, tokens: torch.Tensor, device: torch.device,
                         batch_size: int = 8) -> CapturedInputs:
    """Run the model's own embedding/mask/rotary code on ``tokens`` ``[n, seqlen]``, stopping at the blocks.

    Each block's arguments are recorded from a single window passed through identity stand-ins for
    all blocks, so they have batch dimension 1 and broadcast to any batch of equal length (windows
    are never padded); those that do not broadcast (a bias laid out ``[batch·heads, …]``) are found
    by recording two windows too, and repeated per batch (:meth:`CapturedInputs.call_args`). Block
    0's hidden states are then recorded for all windows. Modules outside the block list are moved
    to ``device`` for the capture and moved back.
    """
    originals = list(blocks.layers)
    outside = _modules_outside(model, blocks)
    homes = [_module_device(m) for m in outside]
    for m in outside:
        m.to(device)
    sink = CapturedInputs()
    try:
        _forward_with_recorders(model, blocks, originals, sink, tokens[:1].to(device), all_blocks=True)
        if len(sink.kwargs) != len(originals):
            raise UserError("capturing block inputs failed: the model did not call every decoder block")
        block0_home = _module_device(originals[0])
        probe = originals[0].to(device)(sink.batches[0], *sink.args[0], **sink.kwargs[0])
        originals[0].to(block0_home)
        if isinstance(probe, (tuple, list)) and len(originals) > 1:
            # Blocks return tuples: record again, the stand-ins now answering in that convention.
            sink = CapturedInputs(output_is_tuple=True)
            _forward_with_recorders(model, blocks, originals, sink, tokens[:1].to(device), all_blocks=True)
        sink.output_is_tuple = isinstance(probe, (tuple, list))
        if tokens.shape[0] > 1:  # recorded for two windows too: which arguments grow with the batch
            pair = CapturedInputs(output_is_tuple=sink.output_is_tuple)
            _forward_with_recorders(model, blocks, originals, pair, tokens[:2].to(device), all_blocks=True)
            sink.args = [_mark_per_window(a, b) for a, b in zip(sink.args, pair.args)]
            sink.kwargs = [_mark_per_window(a, b) for a, b in zip(sink.kwargs, pair.kwargs)]
        sink.batches = []
        for start in range(0, tokens.shape[0], batch_size):
            _forward_with_recorders(model, blocks, originals, sink, tokens[start:start + batch_size].to(device),
                                    all_blocks=False)
    finally:
        for m, home in zip(outside, homes):
            m.to(home)
    sink.hidden = torch.cat(sink.batches)
    sink.batches = []
    return sink


def _modules_outside(model: nn.Module, blocks: Blocks) -> list[nn.Module]:
    """Top-most modules that hold parameters/buffers and are not (inside) the block list."""
    out = []

    def visit(module: nn.Module, name: str) -> None:
        for child_name, child in module.named_children():
            full = f"{name}.{child_name}" if name else child_name
            if child is blocks.layers:
                continue
            if blocks.name.startswith(full + "."):
                visit(child, full)
            else:
                out.append(child)
        if module._parameters or module._buffers:
            out.append(_DirectState(module))

    visit(model, "")
    return out


class _DirectState:
    """Moves only a module's own parameters/buffers (not its children)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def to(self, device: torch.device) -> None:
        for key, p in self.module._parameters.items():
            if p is not None:
                p.data = p.data.to(device)
        for key, b in self.module._buffers.items():
            if b is not None:
                self.module._buffers[key] = b.to(device)

    def __hash__(self) -> int:
        return id(self.module)


def _module_device(module) -> torch.device:
    target = module.module if isinstance(module, _DirectState) else module
    for t in list(target.parameters()) + list(target.buffers()):
        return t.device
    return torch.device("cpu")


@torch.no_grad()
def run_block(block: nn.Module, hidden: torch.Tensor, captured: CapturedInputs, index: int,
              device: torch.device, batch_size: int) -> torch.Tensor:
    """Outputs of ``block`` (block ``index``) for all windows ``hidden`` ``[n, L, d]``, ``batch_size``
    windows at a time on ``device``, with the block's captured call arguments; kept where ``hidden`` lives."""
    out = torch.empty_like(hidden)
    for s in range(0, hidden.shape[0], batch_size):
        chunk = hidden[s:s + batch_size]
        args, kwargs = captured.call_args(index, chunk.shape[0], device)
        out[s:s + batch_size] = first_tensor(block(chunk.to(device), *args, **kwargs)).to(out.device)
    return out


def block_probe(model: nn.Module, blocks: Blocks) -> Callable[[int], torch.Tensor]:
    """``run(i)``: block ``i``'s output on its input for a fixed random probe sequence (the inputs are
    computed once here), so a change to one block — a folded or moved index map — is checked on that
    block alone."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.config.vocab_size, (1, 16), generator=gen)
    device = next(model.parameters()).device
    captured = capture_block_inputs(model, blocks, tokens, device, 1)
    inputs, hidden = [], captured.hidden
    for i, block in enumerate(blocks.layers):
        inputs.append(hidden)
        hidden = run_block(block, hidden, captured, i, device, 1)

    def run(i: int) -> torch.Tensor:
        return run_block(blocks.layers[i], inputs[i], captured, i, device, 1).float()
    return run


def lazy_block_probe(model: nn.Module) -> Callable[[int], torch.Tensor]:
    """:func:`block_probe` of ``model``, built on its first call: several rewrites share one probe
    (its inputs are computed once), and callers that never probe pay nothing."""
    built: list[Callable[[int], torch.Tensor]] = []

    def run(i: int) -> torch.Tensor:
        if not built:
            built.append(block_probe(model, find_blocks(model)))
        return built[0](i)
    return run
