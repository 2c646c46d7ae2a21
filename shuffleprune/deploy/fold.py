"""Folding index maps away before compression.

When a linear's input is produced elementwise from the outputs of other linears of its block (LLaMA's
down_proj reads ``act(gate(h)) · up(h)``), permuting those producers' output rows by the consumer's index map
makes the consumer read its input in order. Candidates are found from shapes alone (producers whose
``out_features`` equal the consumer's ``in_features``; where a module of per-channel weights sits between
producer and consumer, as MLA's ``q_a_layernorm`` between ``q_a_proj`` and ``q_b_proj``, its weights are
permuted with the rows, found by forward hooks) and every fold is kept only if the block's output on a probe
input is unchanged (a fold inside a block cannot change anything outside it), and the whole decoder's too
(:data:`MODEL_FOLD_TOLERANCE`), so no architecture is assumed. Example: o_proj's map folds into v_proj's rows
under multi-head attention when it stays within heads (permutation blocks dividing the head size); under GQA
v_proj has fewer rows than o_proj has inputs, and the fold is tried only when the map is identical for the
query heads that share a KV head (head counts from the model config); otherwise the map stays a runtime gather
(as when a fold into q/k would break attention).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import combinations
from typing import Callable

import torch
from torch import nn

from shuffleprune.block_inputs import block_probe
from shuffleprune.blocks import block_linears, decoder_of, find_blocks, head_layout, resolved_heads, text_config
from shuffleprune.conv1d import plain_linear_like
from shuffleprune.deploy.block_io import record_block_io
from shuffleprune.perm.linear import PermutedLinear

# A fold is kept when the block's output on the probe (float32) moves by less than this, relative to its
# largest value: an exact fold only reorders sums (0 to 3e-7 seen), an inexact one moved it by 1.6e-5
# (a norm's weights left behind) to 4.6e-5 (rows of a linear that does not feed the consumer permuted too)
FOLD_TOLERANCE = 1e-5
# After every block's folds the whole decoder runs the probe once more: a fold can pass its own block's
# check and still change a later block that reads what it changed through the KV cache (Gemma 3n's
# shared KV: o_proj's map folded into v_proj's rows reorders the cached values another layer reads).
# Reordered sums alone stay far below this, relative to the decoder output's largest value.
MODEL_FOLD_TOLERANCE = 1e-3

def _permute_rows(linear: nn.Linear, perm: torch.Tensor) -> None:
    linear.weight.data = linear.weight.data[perm].contiguous()
    if linear.bias is not None:
        linear.bias.data = linear.bias.data[perm].contiguous()


def grouped_head_perm(perm: torch.Tensor, heads_of: tuple[int | None, int | None, int | None],
                       rows: int) -> torch.Tensor | None:
    """GQA: the row permutation of a producer with ``rows`` = KV heads × head size that matches
    ``perm`` over query heads × head size — when ``perm`` stays within heads and is identical for
    all query heads sharing a KV head; else None. ``heads_of``: (query heads, KV heads, head size),
    any of them unknown (:func:`~shuffleprune.blocks.head_layout`)."""
    layout = resolved_heads(heads_of, perm.numel())
    if layout is None or layout[1] * layout[2] != rows:
        return None
    heads, kv, d = layout
    local = perm.view(heads, d) - (torch.arange(heads) * d).unsqueeze(1)
    if local.min() < 0 or local.max() >= d:
        return None  # leaves its head
    group = heads // kv
    local = local.view(kv, group, d)
    if not bool((local == local[:, :1]).all()):
        return None  # query heads sharing a KV head disagree
    return (local[:, 0] + (torch.arange(kv) * d).unsqueeze(1)).flatten()


def fold_permutations(model: nn.Module) -> dict[str, list[str]]:
    """Fold input index maps into producer rows where the block's output stays the same, and the whole
    decoder's too (:func:`_undo_folds_that_change_the_model`); returns ``{consumer: [producers]}`` of
    the folds made (in place: folded consumers become plain linears reading their input in order)."""
    blocks = find_blocks(model)
    run = block_probe(model, blocks)
    config = text_config(model)
    whole = _decoder_probe(model, blocks)
    whole_reference = whole()
    made: list[_Fold] = []
    for i, block in enumerate(blocks.layers):
        reference = run(i)
        linears = block_linears(block, blocks.prefix(i))
        for name, consumer in linears.items():
            if not isinstance(consumer, PermutedLinear):
                continue
            perm = consumer.perm.cpu()
            if torch.equal(perm, torch.arange(perm.numel())):
                continue  # nothing to fold: the export omits an identity map
            producers = [n for n, lin in linears.items() if n != name and lin.out_features == consumer.in_features]
            # fewest rows moved first: a producer that does not feed the consumer, moved along with
            # those that do, changes the block only a little where its output matters little
            subsets = [[p] for p in producers] + [list(c) for c in combinations(producers, 2)]
            subsets += [producers] if len(producers) > 2 else []
            attempts = [(subset, {p: perm for p in subset}) for subset in subsets if subset]
            heads_of = head_layout(model.get_submodule(name.rpartition(".")[0]), config, consumer.in_features)
            for n, lin in linears.items():  # GQA: a narrower producer (v_proj) under a head-consistent map
                if n != name and lin.out_features < consumer.in_features:
                    rows = grouped_head_perm(perm, heads_of, lin.out_features)
                    if rows is not None:
                        attempts.append(([n], {n: rows}))
            through = _through_channelwise(block, blocks.prefix(i), partial(run, i), name, consumer, linears)
            channel = []
            if through is not None:   # producer → norm → consumer: the norm's weights move with the rows
                attempts.insert(0, ([through[0]], {through[0]: perm}))
                channel = [through[1]]
            plain = plain_linear_like(consumer, consumer.in_features, consumer.out_features, bias=consumer.bias is not None)
            plain.weight.data = consumer.weight.data  # W[:, perm] reading x[perm] == reading x' = x[perm] in order
            if consumer.bias is not None:
                plain.bias.data = consumer.bias.data
            for k, (subset, row_perms) in enumerate(attempts):
                fold = _Fold(name, consumer, plain, {p: (linears[p], row_perms[p]) for p in subset},
                             channel if k == 0 else [], perm)
                fold.apply(model)
                if _moved(run(i), reference) < FOLD_TOLERANCE:
                    made.append(fold)
                    linears[name] = plain   # the module in the model now: a later fold may move its rows
                    break
                fold.undo(model)
    _undo_folds_that_change_the_model(model, made, lambda: bool(_moved(whole(), whole_reference) < MODEL_FOLD_TOLERANCE))
    return {fold.name: list(fold.rows) for fold in made}


@dataclass
class _Fold:
    """One fold: ``name``'s consumer replaced by its plain twin ``plain``, the producers' rows (and the
    vectors of a per-channel module between them) permuted."""

    name: str
    consumer: nn.Module
    plain: nn.Module
    rows: dict[str, tuple[nn.Module, torch.Tensor]]   # producer name → (module, row permutation)
    channels: list[nn.Module]
    perm: torch.Tensor

    def apply(self, model: nn.Module) -> None:
        for module, rows in self.rows.values():
            _permute_rows(module, rows)
        _permute_channels(self.channels, self.perm)
        model.set_submodule(self.name, self.plain)

    def undo(self, model: nn.Module) -> None:
        model.set_submodule(self.name, self.consumer)
        _permute_channels(self.channels, torch.argsort(self.perm))
        for module, rows in self.rows.values():
            _permute_rows(module, torch.argsort(rows))


def _decoder_probe(model: nn.Module, blocks) -> Callable[[], torch.Tensor]:
    """The decoder's output (float32) on a fixed random 16-token probe, run as a whole (KV cache and
    all, as generation runs it)."""
    decoder = decoder_of(model, blocks)
    tokens = torch.randint(0, text_config(model).vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    tokens = tokens.to(next(model.parameters()).device)

    def run() -> torch.Tensor:
        with torch.no_grad():
            return decoder(input_ids=tokens).last_hidden_state.float()
    return run


def _moved(out: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """How far ``out`` is from ``reference`` (a block's probe or the decoder's), relative to the
    reference's largest value."""
    return (out - reference).abs().max() / reference.abs().max().clamp_min(1e-6)


def _undo_folds_that_change_the_model(model: nn.Module, made: list[_Fold], unchanged: Callable[[], bool]) -> None:
    """Where the whole decoder moved although every fold passed its block's check: undo folds from the
    last until it does not, then put back, one at a time, those undone before the one that made the
    difference, keeping each that leaves the decoder unchanged (``made`` is updated in place)."""
    if not made or unchanged():
        return
    undone = []
    while made and not unchanged():
        undone.append(made.pop())
        undone[-1].undo(model)
    if not unchanged():
        raise RuntimeError("export: undoing every permutation fold did not restore the model's output")
    undone.pop()   # the fold whose undo restored the output stays undone
    for fold in reversed(undone):
        fold.apply(model)
        if unchanged():
            made.append(fold)
        else:
            fold.undo(model)


def _through_channelwise(block: nn.Module, prefix: str, run: Callable[[], torch.Tensor], name: str,
                         consumer: nn.Module, linears: dict[str, nn.Module]) -> tuple[str, nn.Module] | None:
    """``(producer, module)`` when ``name``'s input is the output of a module whose parameters are all
    per-channel vectors of that width (a norm between two linears, as MLA's ``q_a_layernorm``) and that
    module reads a linear's output of that width: a fold then permutes the linear's rows and the
    module's vectors (forward hooks on the block's probe; None otherwise)."""
    width = consumer.in_features
    between = record_block_io(block, run, lambda m: m is consumer).producer_of(name[len(prefix) + 1:])
    if between is None:
        return None
    module = block.get_submodule(between)
    params = list(module.parameters())
    if not params or any(p.shape != (width,) for p in params):
        return None
    source = record_block_io(block, run, lambda m: m is module).producer_of(between)
    producer = f"{prefix}.{source}" if source is not None else None
    if producer not in linears or producer == name or linears[producer].out_features != width:
        return None
    return producer, module


def _permute_channels(modules: list[nn.Module], perm: torch.Tensor) -> None:
    for module in modules:
        for p in module.parameters():
            p.data = p.data[perm.to(p.device)].contiguous()
