"""``statistics`` stages: the input statistics of each block's linears that masks and permutations read.

- ``sequential`` (Wanda's and SparseGPT's rule): a pass over the block's own inputs, i.e. the
  outputs of the blocks before it *after* they were pruned. Skipped when no later stage reads
  statistics (magnitude without a permutation).
- ``dense``: the unpruned model's norms, from one pass over the calibration windows before any
  block is pruned (saved in the resume directory). Norms only: a stage that needs XᵀX is refused.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from shuffleprune.blocks import decoder_of
from shuffleprune.errors import UserError
from shuffleprune.prune.atomic import atomic_write
from shuffleprune.prune.input_stats import InputStats, collect_input_stats, input_groups, load_norms, save_norms
from shuffleprune.prune.run_dir import STATE_FILE
from shuffleprune.prune.stage import BlockWork, Run, RunSpec, Stage, register

DENSE_STATS_FILE = "dense_stats.safetensors"


def dense_stats(run: Run) -> dict[str, InputStats]:
    """The unpruned model's input norms of every selected linear (computed once per run, saved for
    ``--resume``: a resumed run's earlier blocks are already pruned)."""
    if "dense_stats" in run.cache:
        return run.cache["dense_stats"]
    saved = run.work / DENSE_STATS_FILE if run.work is not None else None
    if saved is not None and saved.is_file():
        stats = load_norms(saved)
    else:
        state = run.work / STATE_FILE if run.work is not None else None
        if state is not None and state.is_file() and json.loads(state.read_text())["next_block"]:
            raise UserError(f"'{run.work.parent}' was started by an older shuffleprune; rerun with --overwrite instead of --resume")
        run.model.to(run.device)
        with collect_input_stats({**run.all_linears(), **run.all_experts()}, gram=False) as stats, torch.no_grad():
            for s in range(0, run.tokens.shape[0], run.batch_size):
                decoder_of(run.model, run.blocks)(input_ids=run.tokens[s:s + run.batch_size].to(run.device),
                                                  use_cache=False)
        run.model.to("cpu")
        if saved is not None:
            atomic_write(saved, lambda tmp: save_norms(stats, tmp))
    run.cache["dense_stats"] = stats
    return stats


@register
@dataclass
class Sequential(Stage):
    kind = "statistics"
    name = "sequential"

    def apply(self, run: Run, work: BlockWork) -> None:
        needs = run.spec.needs() & {"norms", "gram"}
        if not needs:  # nothing reads statistics: skip the pass
            work.stats = {n: None for n in work.weights()}
            work.groups, work.expert_groups = [[n] for n in work.linears], [[n] for n in work.experts]
            return
        with collect_input_stats(work.weights(), gram="gram" in needs) as stats:
            work.outputs(run)
        _set_stats(work, stats)


@register
@dataclass
class Dense(Stage):
    kind = "statistics"
    name = "dense"

    def check(self, spec: RunSpec) -> None:
        if "gram" in spec.needs():
            users = [s.name for s in spec.stages if "gram" in s.needs()]
            raise UserError(f"statistics 'dense' holds input norms only, but {', '.join(users)} needs each block's "
                            "real inputs (XᵀX); use statistics 'sequential' (--mask-stats sequential)")

    def prepare(self, run: Run) -> None:
        dense_stats(run)

    def apply(self, run: Run, work: BlockWork) -> None:
        stats = dense_stats(run)
        _set_stats(work, {name: stats[name] for name in work.weights()})


def _set_stats(work: BlockWork, stats: dict[str, InputStats]) -> None:
    """The block's statistics, and which linears (and which experts' matrices) share an input."""
    work.stats = stats
    groups = input_groups(stats)
    work.groups = [g for g in groups if g[0] in work.linears]
    work.expert_groups = [g for g in groups if g[0] in work.experts]
