"""What each decoder block is called with, and running blocks alone.

``capture_block_inputs`` runs the model's own forward up to the blocks to record block 0's hidden
states and every block's call arguments (attention masks, position embeddings, …), whatever the
architecture passes; ``run_block`` runs one block on recorded inputs; ``block_probe`` runs every
block on one fixed probe sequence, so a change to one block (a folded or moved index map) can be
checked on that block alone; ``logits_after_blocks`` finishes the model's forward from its last
block's output (a model scored block by block, one block on the device at a time). How recorded
arguments are held and given to a batch of windows: :mod:`shuffleprune.block_args`.
"""
from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import torch
from torch import nn
from tqdm.auto import tqdm

from shuffleprune.block_args import (CarriedOutputs, SharedState, WindowData, carried_outputs, fill_window_data, for_batch,
                                     mark_per_window, rebind_carried, shared_states, window_data)
from shuffleprune.blocks import Blocks, find_blocks, text_config
from shuffleprune.errors import UserError


def first_tensor(output: Any) -> torch.Tensor:
    """The hidden states in a block's output (a tensor, or the first element of a tuple)."""
    return output[0] if isinstance(output, (tuple, list)) else output


class _StopForward(Exception):
    pass


class _StandIn(nn.Module):
    """Takes a decoder block's place in the model's block list for one forward; attributes it lacks
    are the block's (models read some, like ``attention_type``, off their blocks)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("block"), name)


@contextmanager
def _standing_in(blocks: Blocks, stand_ins: list[_StandIn]) -> Iterator[None]:
    """The first ``len(stand_ins)`` blocks replaced by ``stand_ins`` for the duration."""
    originals = list(blocks.layers)
    for i, stand_in in enumerate(stand_ins):
        blocks.layers[i] = stand_in
    try:
        yield
    finally:
        for i, block in enumerate(originals):
            blocks.layers[i] = block


class _Recorder(_StandIn):
    """Stands in for a decoder block during capture: records the call and returns its input unchanged
    (in the blocks' own output convention, :meth:`CapturedInputs.block_output`) or, when nothing more
    is needed, stops the forward."""

    def __init__(self, block: nn.Module, index: int, sink: "CapturedInputs", stop: bool, record_kwargs: bool):
        super().__init__(block)
        self.index = index
        self.sink = sink
        self.stop = stop
        self.record_kwargs = record_kwargs

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
        return self.sink.block_output(hidden)


@dataclass
class CapturedInputs:
    """Block 0's hidden states, window by window along dim 0 (``[n, L, d]``), and each block's extra
    call arguments, recorded for one window (:meth:`call_args` gives them for a batch). A model whose
    blocks take the windows along another dim of their hidden states (Gemma 3n's AltUp passes
    ``[altup, batch, L, d]``) has it in ``batch_dim``: :meth:`to_block` and :meth:`from_block` move it."""

    hidden: torch.Tensor | None = None
    batch_dim: int = 0
    args: list[tuple] = field(default_factory=list)      # per block
    kwargs: list[dict] = field(default_factory=list)     # per block
    # what blocks return besides their hidden states: None when they return a tensor, else the rest of
    # their tuple (block 0's own answer on the first window: attention weights that are None, …)
    output_rest: tuple | None = None
    batches: list[torch.Tensor] = field(default_factory=list)
    carried: CarriedOutputs | None = None   # what blocks return that the model hands the next block

    def block_output(self, hidden: torch.Tensor) -> Any:
        """``hidden`` as a block would return it (a tensor, or a tuple led by it)."""
        return hidden if self.output_rest is None else (hidden, *self.output_rest)

    def holds_shared_state(self) -> bool:
        """Whether blocks hand later blocks data through a :class:`SharedState` or what they return."""
        return self.carried is not None or any(isinstance(v, SharedState) for kw in self.kwargs for v in kw.values())

    def with_own_states(self) -> "CapturedInputs":
        """These call arguments with every :class:`SharedState` replaced by a new, empty one (handed
        to the same blocks), and what blocks return kept apart: a second stream of activations (the unpruned
        model's, beside the pruned one) whose blocks read what its own earlier blocks stored or returned.
        Without shared states: ``self``."""
        if not self.holds_shared_state():
            return self
        fresh: dict[int, SharedState] = {}
        kwargs = [{k: fresh.setdefault(id(v), SharedState(v.windows)) if isinstance(v, SharedState) else v
                   for k, v in kw.items()} for kw in self.kwargs]
        if self.carried is None:
            return replace(self, kwargs=kwargs)
        carried = CarriedOutputs(self.carried.windows)
        return replace(self, args=rebind_carried(self.args, carried), kwargs=rebind_carried(kwargs, carried),
                       carried=carried)

    def to_block(self, hidden: torch.Tensor) -> torch.Tensor:
        """Windows' hidden states (windows along dim 0) as the blocks take them."""
        return hidden if self.batch_dim == 0 else hidden.movedim(0, self.batch_dim)

    def from_block(self, output: Any) -> torch.Tensor:
        """The hidden states in a block's output, windows along dim 0."""
        hidden = first_tensor(output)
        return hidden if self.batch_dim == 0 else hidden.movedim(self.batch_dim, 0)

    def call_args(self, index: int, windows: slice | torch.Tensor, device: torch.device) -> tuple[tuple, dict]:
        """Block ``index``'s extra positional and keyword arguments for the calibration ``windows``
        (a slice or row indices of :attr:`hidden`) on ``device``."""
        batch = windows.stop - windows.start if isinstance(windows, slice) else len(windows)
        return (for_batch(self.args[index], windows, batch, device),
                for_batch(self.kwargs[index], windows, batch, device))


def _forward_with_recorders(model: nn.Module, blocks: Blocks, originals: list[nn.Module], sink: CapturedInputs,
                            input_ids: torch.Tensor, last: int, record_kwargs: bool) -> None:
    """The model's forward on ``input_ids`` with recorders for blocks ``0..last``, stopped at block ``last``."""
    recorders = [_Recorder(block, i, sink, stop=i == last, record_kwargs=record_kwargs)
                 for i, block in enumerate(originals[: last + 1])]
    with _standing_in(blocks, recorders):
        try:
            model(input_ids=input_ids, use_cache=False)
        except _StopForward:
            pass


def _rest_of_output(output: Any) -> tuple | None:
    """What a block's ``output`` holds besides its hidden states (:attr:`CapturedInputs.output_rest`)."""
    return tuple(output[1:]) if isinstance(output, (tuple, list)) else None


@torch.no_grad()
def capture_block_inputs(model: nn.Module, blocks: Blocks, tokens: torch.Tensor, device: torch.device,
                         batch_size: int = 8) -> CapturedInputs:
    """Run the model's own embedding/mask/rotary code on ``tokens`` ``[n, seqlen]``, stopping at the blocks.

    Block 0 is first run for real on one window, to learn what blocks return (a tensor, or a tuple
    of some length the model unpacks). Each block's arguments are then recorded from a single window
    passed through identity stand-ins for all blocks, answering in that convention, so they have
    batch dimension 1 and broadcast to any batch of equal length (windows are never padded); those
    that grow with the batch (a bias laid out ``[batch·heads, …]``, a mask whose batch size a model
    checks) are found by recording two windows too, and repeated or expanded per batch
    (:meth:`CapturedInputs.call_args`); those that differ between the two windows hold each
    window's own data (:class:`WindowData`). Block 0's hidden states, and any such data, are then
    recorded for all windows. Modules outside the block list are moved to ``device`` for the
    capture and moved back.
    """
    originals = list(blocks.layers)
    last = len(originals) - 1
    with outside_blocks_on(model, blocks, device):
        first = CapturedInputs()
        _forward_with_recorders(model, blocks, originals, first, tokens[:1].to(device), last=0, record_kwargs=True)
        block0_home = _module_device(originals[0])
        probe = originals[0].to(device)(first.batches[0], *first.args[0], **first.kwargs[0])
        originals[0].to(block0_home)
        sink = CapturedInputs(output_rest=_rest_of_output(probe))
        _forward_with_recorders(model, blocks, originals, sink, tokens[:1].to(device), last=last, record_kwargs=True)
        if len(sink.kwargs) != len(originals):
            raise UserError("capturing block inputs failed: the model did not call every decoder block")
        sink.kwargs = shared_states(sink.kwargs, tokens.shape[0])
        sink.args, sink.kwargs, sink.carried = carried_outputs(sink.args, sink.kwargs, sink.output_rest, tokens.shape[0])
        if tokens.shape[0] > 1:  # recorded for two windows too: which arguments grow with the batch
            pair = CapturedInputs(output_rest=sink.output_rest)
            _forward_with_recorders(model, blocks, originals, pair, tokens[:2].to(device), last=last,
                                    record_kwargs=True)
            shared: dict[int, WindowData] = {}
            sink.args = [mark_per_window(a, b, shared) for a, b in zip(sink.args, pair.args)]
            sink.kwargs = [mark_per_window(a, b, shared) for a, b in zip(sink.kwargs, pair.kwargs)]
            sink.batch_dim = _batch_dim(sink.batches[0], pair.batches[0])
            del pair, shared
        else:
            sink.batch_dim = _batch_dim(sink.batches[0], None)
        # the last block given each window's own data: recorded through it, for every batch of windows
        with_data = [i for i in range(len(originals)) if window_data((sink.args[i], sink.kwargs[i]))]
        upto = max(with_data, default=0)
        sink.batches = []
        for start in range(0, tokens.shape[0], batch_size):
            batch = CapturedInputs(output_rest=sink.output_rest)
            _forward_with_recorders(model, blocks, originals, batch, tokens[start:start + batch_size].to(device),
                                    last=upto, record_kwargs=bool(with_data))
            sink.batches += batch.batches
            filled: set[int] = set()
            for i in with_data:
                fill_window_data((sink.args[i], sink.kwargs[i]), (batch.args[i], batch.kwargs[i]), filled)
    sink.hidden = torch.cat([b.movedim(sink.batch_dim, 0) for b in sink.batches])
    sink.batches = []
    return sink


def _batch_dim(one: torch.Tensor, two: torch.Tensor | None) -> int:
    """The dim of block 0's hidden states that holds the windows: the one that doubles from one window
    (``one``) to two (``two``); with a single window, the first of size 1."""
    if two is not None:
        grown = [d for d in range(one.dim()) if two.shape[d] == 2 * one.shape[d]]
        if len(grown) == 1 and one.shape[grown[0]] == 1:
            return grown[0]
    return next((d for d in range(one.dim()) if one.shape[d] == 1), 0)


@contextmanager
def outside_blocks_on(model: nn.Module, blocks: Blocks, device: torch.device) -> Iterator[None]:
    """The model's modules outside the block list (embeddings, final norm, LM head, rotary tables)
    on ``device`` for the duration, then back where each was."""
    outside = _modules_outside(model, blocks)
    homes = [_module_device(m) for m in outside]
    for m in outside:
        m.to(device)
    try:
        yield
    finally:
        for m, home in zip(outside, homes):
            m.to(home)


class _Replay(_StandIn):
    """Stands in for a decoder block: block 0's returns the given last block's output, the others
    pass their input on (each in the blocks' output convention)."""

    def __init__(self, block: nn.Module, output: torch.Tensor | None, captured: CapturedInputs):
        super().__init__(block)
        self.output = output
        self.captured = captured

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.output is not None:
            return self.captured.block_output(self.captured.to_block(self.output))
        return self.captured.block_output(args[0] if args else kwargs["hidden_states"])


@torch.no_grad()
def logits_after_blocks(model: nn.Module, blocks: Blocks, input_ids: torch.Tensor, last_output: torch.Tensor,
                        captured: CapturedInputs) -> torch.Tensor:
    """The model's logits for ``input_ids`` given what its last block returned for them: its own
    forward runs with stand-ins for the blocks (answering as ``captured`` says blocks do), so
    whatever follows them (final norm, LM head, a logit soft-cap) is the model's own code. Modules
    outside the blocks must be on ``input_ids``'s device (:func:`outside_blocks_on`)."""
    replays = [_Replay(block, last_output if i == 0 else None, captured) for i, block in enumerate(blocks.layers)]
    with _standing_in(blocks, replays):
        return model(input_ids=input_ids, use_cache=False).logits


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
        windows = slice(s, s + chunk.shape[0])
        args, kwargs = captured.call_args(index, windows, device)
        output = block(captured.to_block(chunk.to(device)), *args, **kwargs)
        if captured.carried is not None:   # what the next block is handed of it, kept for these windows
            captured.carried.keep(index, output, windows, chunk.shape[0])
        out[s:s + batch_size] = captured.from_block(output).to(out.device)
    return out


@torch.no_grad()
def run_blocks(blocks: Blocks, hidden: torch.Tensor, captured: CapturedInputs, device: torch.device,
               batch_size: int, progress: bool = False,
               around: Callable[[nn.Module], AbstractContextManager] | None = None) -> torch.Tensor:
    """The last block's outputs for block 0's inputs ``hidden`` (kept where ``hidden`` lives): every
    block in turn, each moved to ``device`` for its turn and back (one block on the device at a time),
    run inside ``around(block)`` where given (a trace of what the block does, on the device)."""
    for i, block in enumerate(tqdm(blocks.layers, desc="blocks", disable=not progress, leave=False)):
        home = _module_device(block)
        try:
            block.to(device)
            with around(block) if around is not None else nullcontext():
                hidden = run_block(block, hidden, captured, i, device, batch_size)
        finally:
            block.to(home)
    return hidden


def called_modules(blocks: Blocks, captured: CapturedInputs, hidden: torch.Tensor, device: torch.device,
                   modules: list[dict[str, nn.Module]],
                   around: Callable[[nn.Module], AbstractContextManager] | None = None) -> set[str]:
    """The names among ``modules`` (per block: ``{name: module}``) whose forward runs when the blocks
    run, one after another, on block 0's inputs ``hidden`` (one window is enough), each block inside
    ``around`` where given. A layer whose weight the model reads directly (Mamba's ``dt_proj``:
    ``dt_proj.weight @ x``) is not called."""
    called: set[str] = set()
    hooks = [m.register_forward_pre_hook(lambda *_, name=name: called.add(name))
             for block in modules for name, m in block.items()]
    try:
        run_blocks(blocks, hidden, captured, device, hidden.shape[0], around=around)
    finally:
        for hook in hooks:
            hook.remove()
    return called


def probe_inputs(model: nn.Module, blocks: Blocks) -> CapturedInputs:
    """The blocks' inputs for a fixed random probe sequence (16 tokens, seed 0), on the model's device."""
    tokens = torch.randint(0, text_config(model).vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    return capture_block_inputs(model, blocks, tokens, next(model.parameters()).device, 1)


def block_probe(model: nn.Module, blocks: Blocks) -> Callable[[int], torch.Tensor]:
    """``run(i)``: block ``i``'s output on its input for a fixed random probe sequence (the inputs are
    computed once here), so a change to one block — a folded or moved index map — is checked on that
    block alone."""
    captured = probe_inputs(model, blocks)
    device = next(model.parameters()).device
    inputs, hidden = [], captured.hidden
    if captured.carried is not None:   # every block's return kept from this first pass, as its hidden states are
        captured.carried.keep_all = True
    for i, block in enumerate(blocks.layers):
        inputs.append(hidden)
        hidden = run_block(block, hidden, captured, i, device, 1)
    if captured.carried is not None:
        captured.carried.frozen = True

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
