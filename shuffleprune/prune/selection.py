"""Which weights a prune run acts on: the linears and MoE experts ``--only`` / ``--skip`` select, less those the
model never calls as layers and those that route, gate or mix, plus experts a block keeps stacked in its own
parameters (found by tracing one window); and the share of the blocks' weights left dense."""
from __future__ import annotations

import warnings

import torch

from shuffleprune.block_inputs import called_modules
from shuffleprune.blocks import (OUTSIDE_LINEARS_WARN_SHARE, ExpertWeight, block_experts, block_linears, GATING_WIDTH,
                                  gating_linears, is_plain_linear, parse_expert_name, selected_by_globs,
                                  weights_outside_linears)
from shuffleprune.errors import UserError
from shuffleprune.prune.config import PruneConfig
from shuffleprune.prune.stage import Run
from shuffleprune.stacked_experts import MatmulTrace, stacked_experts

NOTHING_SELECTED = "no linear layers selected; check --only / --skip"


def selected_weights(blocks, config: PruneConfig, pattern) -> tuple[list[dict], list[dict]]:
    """Per block, the linears and the experts of fused MoE layers that ``--only`` / ``--skip`` select,
    each checked against the pattern. A weight several blocks share (Zamba2's shared attention
    blocks tie their parameters) is pruned once, in the first block that holds it."""
    linears, experts, seen, widths = [], [], set(), []
    for prefix, block in blocks.named():
        found = {n: lin for n, lin in block_linears(block, prefix, config.only, config.skip).items()
                 if id(lin.weight) not in seen}
        found_experts = {n: e for n, e in block_experts(block, prefix, config.only, config.skip).items()
                         if _matrix_key(e) not in seen}
        seen.update(id(lin.weight) for lin in found.values())
        seen.update(_matrix_key(e) for e in found_experts.values())
        widths += [(name, name.removeprefix(f"{prefix}."), lin.in_features)
                   for name, lin in {**found, **found_experts}.items()]
        linears.append(found)
        experts.append(found_experts)
    pattern.check_widths(widths)
    if not any(linears) and not any(experts) and not any(weights_outside_linears(b, "") for b in blocks.layers):
        raise UserError(NOTHING_SELECTED)   # (stacked experts, found by tracing the blocks, may still come)
    return linears, experts


def _matrix_key(expert: ExpertWeight) -> tuple[int, int]:
    """One expert matrix, however many blocks tie the parameter that holds it."""
    return id(getattr(expert.owner, expert.param)), expert.index


def traced_weights(run: Run, hidden: torch.Tensor, config: PruneConfig) -> tuple[dict, dict]:
    """Run one window through the blocks and select what the forward shows: the experts a block keeps
    stacked in its own parameters (:mod:`shuffleprune.stacked_experts`) join the run's experts; the
    linears the model never calls (it reads their weight directly, like Mamba's ``dt_proj``) leave the
    run, dense, with a warning: no statistics can reach them; so do, among those called, the linears
    that route, gate or mix (:func:`~shuffleprune.blocks.gating_linears`: MoE routers, scalar gates,
    coefficient layers). Returns ``(not called, gates)``."""
    trace = MatmulTrace()
    called = called_modules(run.blocks, run.captured, hidden, run.device, run.linears, around=trace.watch)
    dropped = {n: lin for block in run.linears for n, lin in block.items() if n not in called}
    run.linears = [{n: lin for n, lin in block.items() if n in called} for block in run.linears]
    seen = {_matrix_key(e) for block in run.experts for e in block.values()}
    gates: dict[str, torch.nn.Module] = {}
    widths = []
    for i, block in enumerate(run.blocks.layers):
        prefix = run.blocks.prefix(i)
        stacked = stacked_experts(block, prefix, trace)
        for name, e in stacked.items():
            if selected_by_globs(name, config.only, config.skip) and _matrix_key(e) not in seen:
                widths.append((name, name.removeprefix(f"{prefix}."), e.in_features))
                run.experts[i][name] = e
                seen.add(_matrix_key(e))
        gated = gating_linears(run.linears[i], block_experts(block, prefix) | stacked)
        gates.update({n: run.linears[i].pop(n) for n in sorted(gated)})
    run.pattern.check_widths(widths)
    if not any(run.linears) and not any(run.experts):
        if gates and not dropped:
            raise UserError(f"the selected linears route, gate or mix (e.g. {next(iter(gates))}: at most {GATING_WIDTH} "
                            "inputs or outputs, or one per MoE expert), which prune keeps dense; nothing can be pruned: "
                            "select other layers with --only / --skip")
        raise UserError(f"none of the selected linears is called as a layer by this model (e.g. {next(iter(dropped))}); "
                        "nothing can be pruned" if dropped else NOTHING_SELECTED)
    if dropped:
        warnings.warn(f"{len(dropped)} linear layers stay dense: the model reads their weights without calling them "
                      f"as layers (e.g. {next(iter(dropped))}), so no calibration statistics reach them",
                      UserWarning, stacklevel=3)
    return dropped, gates


def dense_outside_linears(blocks, experts: list[dict[str, ExpertWeight]],
                           not_called: dict[str, torch.nn.Module]) -> dict:
    """The blocks' matrix weights that pruning does not see (:func:`weights_outside_linears`, less the
    selected experts of fused MoE layers, plus the linears the model never calls): their share of all
    the blocks' matrix weights and the first few names, with a warning when the share is large (a
    model with an unsupported experts layout gets only its attention and shared layers pruned)."""
    unseen, in_linears = {name: lin.weight.numel() for name, lin in not_called.items()}, 0
    for i, block in enumerate(blocks.layers):
        prefix = blocks.prefix(i)
        unseen.update(weights_outside_linears(block, prefix))
        in_linears += sum(m.weight.numel() for m in block.modules() if is_plain_linear(m))
        for name, expert in experts[i].items():
            unseen[parse_expert_name(name)[0]] -= expert.weight.numel()
            in_linears += expert.weight.numel()
    in_linears -= sum(unseen[name] for name in not_called)
    unseen = {name: n for name, n in unseen.items() if n > 0}
    total = sum(unseen.values())
    share = total / max(1, total + in_linears)
    largest = sorted(unseen, key=lambda name: -unseen[name])[:8]
    if share > OUTSIDE_LINEARS_WARN_SHARE:
        warnings.warn(f"{share:.0%} of the decoder blocks' weights stay dense (e.g. {largest[0]}): left out by "
                      "--only/--skip, or outside the nn.Linear layers and MoE experts that prune acts on", UserWarning, stacklevel=3)
    return {"share": round(share, 6), "numel": total, "names": largest}
