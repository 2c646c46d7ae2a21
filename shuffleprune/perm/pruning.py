"""Input-channel permutations for one decoder block during one-shot N:M pruning (ShuffleSparse).

``block_permutations`` returns one index map per linear of a block, and per expert matrix of its
fused MoE layers (an expert's soft permutation is trained through its slice of the fused tensor,
which :func:`~shuffleprune.blocks.weight_params` rebuilds for the block's forward):

- ``random``: a fixed random block-diagonal permutation (the paper's control);
- ``search``: the data-free swap search of :mod:`shuffleprune.perm.search` on Wanda's score (no training);
- ``learned``: soft permutations (one per group of linears that read the same input, or one per
  linear) trained against ``1 − cos(dense block output, sparse block output)`` on the calibration
  windows (:mod:`shuffleprune.perm.learning`), weights frozen, then hardened by Hungarian matching.

``model_permutations`` learns every block's permutations jointly against the final hidden state.
The pruning stages then prune every linear *in permuted coordinates*, so the recomputed mask — and
SparseGPT's weight update — see the same column grouping the N:M kernel will see.

Beyond the paper (documented deviation): the hardened permutation is kept only if it reconstructs
the calibration windows at least as well as the best permutation met during training, the search
start (``--perm-init search``) and the identity; otherwise the best of those is used. A learned
permutation therefore never makes a block's calibration loss worse than its starting point. With
``--perm-holdout F`` a fraction ``F`` of the windows is kept out of learning and the choice is made
on those held-out windows only, so a permutation that merely fits the training windows is not kept.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from shuffleprune.block_inputs import CapturedInputs
from shuffleprune.blocks import ExpertWeight, decoder_of, find_blocks, weight_params
from shuffleprune.errors import UserError, check_values
from shuffleprune.masks import Pattern
from shuffleprune.perm.learning import cosine_loss, hard_masked_weight, kl_loss, learn_permutations, masked_weight
from shuffleprune.perm.search import swap_search
from shuffleprune.perm.core import LR_DECAYS, PermSchedule, SoftPermutation, random_block_perm, strength
from shuffleprune.perm.heads import HeadTie


@dataclass(frozen=True)
class PermOptions:
    """``--perm`` and its knobs (the paper's defaults)."""

    perm: str = "none"          # none | random | search | learned
    init: str = "identity"      # learned: start from the identity (paper) or from the swap search
    relax: str = "l1l2"         # l1l2 (ShuffleSparse) | sinkhorn (PermLLM)
    block: int = 64             # permutation block size B
    steps: int = 100            # optimisation steps per decoder block (block recon) or in all (model recon)
    recon: str = "block"        # block: each block against its dense output; model: all jointly, final hidden state
    loss: str = "cos"           # model recon: cos (1 − cos of the final hidden state, the paper) | kl (of next-token distributions)
    lr: float = 3e-2
    lr_decay: str = "constant"  # constant | cosine (½(1+cos πt/T) over the steps)
    lambda_max: float = 1e-4
    share: str = "group"        # group: q/k/v and gate/up share one permutation; linear: one each
    rounds: int = 200           # swap search: rounds at most (it stops earlier once no swap helps)
    batch: int = 4              # calibration windows per step
    holdout: float = 0.0        # fraction of windows kept out of learning, used only to choose the final permutation
    tie_heads: bool = False     # GQA: one map per KV head for the output projection, so export folds it (perm.heads)
    seed: int = 0

    def check(self, pattern: Pattern) -> None:
        if self.perm not in ("none", "random", "search", "learned"):
            raise UserError(f"unknown --perm '{self.perm}'; use none, random, search or learned")
        if self.recon not in ("block", "model"):
            raise UserError(f"unknown --recon '{self.recon}'; use block or model")
        if self.loss not in ("cos", "kl"):
            raise UserError(f"unknown --perm-loss '{self.loss}'; use cos or kl")
        if self.loss == "kl" and (self.perm != "learned" or self.recon != "model"):
            raise UserError("--perm-loss kl needs --perm learned --recon model (it compares the model's next-token distributions)")
        if self.init not in ("identity", "search"):
            raise UserError(f"unknown --perm-init '{self.init}'; use identity or search")
        if self.perm == "none":
            return
        if not pattern.is_nm:
            raise UserError("--perm needs an N:M --pattern: unstructured masks do not depend on column order")
        if self.relax not in ("l1l2", "sinkhorn"):
            raise UserError(f"unknown --relax '{self.relax}'; use l1l2 or sinkhorn")
        if self.lr_decay not in LR_DECAYS:
            raise UserError(f"unknown --perm-lr-decay '{self.lr_decay}'; use {' or '.join(LR_DECAYS)}")
        if self.share not in ("group", "linear"):
            raise UserError(f"unknown --perm-share '{self.share}'; use group or linear")
        if self.block < pattern.m or self.block % pattern.m:
            fit = pattern.m * max(1, round(self.block / pattern.m))
            raise UserError(f"--perm-block {self.block} must be a positive multiple of M={pattern.m}: set --perm-block {fit} "
                            f"(--set permutation.block={fit}), or --perm none")
        check_values(("--perm-steps", self.steps, self.steps >= 1, ">= 1"),
                     ("--perm-batch", self.batch, self.batch >= 1, ">= 1"),
                     ("--perm-lr", self.lr, self.lr > 0, "> 0"))
        if not 0.0 <= self.holdout < 1.0:
            raise UserError(f"--perm-holdout {self.holdout} must be in [0, 1)")


def split_windows(n_windows: int, holdout: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration window indices ``(learn, judge)``: with ``holdout`` > 0 a random
    ``round(holdout·n)`` (at least 1) are judged on and the others learned on; with 0 both are all windows."""
    everything = torch.arange(n_windows)
    if holdout == 0.0:
        return everything, everything
    if n_windows < 2:
        raise UserError(f"--perm-holdout needs at least 2 calibration windows, got {n_windows}; raise --nsamples")
    order = torch.randperm(n_windows, generator=gen)
    k = min(n_windows - 1, max(1, round(holdout * n_windows)))
    return order[k:].sort().values, order[:k].sort().values


def _score(weight: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
    """Wanda's score ``|W|·‖X_j‖`` from the input column norms ``norm`` (``|W|`` without them) — the
    score the permutation is learned with."""
    return weight.abs() if norm is None else weight.abs() * norm.to(weight.device).unsqueeze(0)


def _units(groups: list[list[str]], share: str) -> list[list[str]]:
    """Linears that share one permutation: an input group (``group``) or each linear alone (``linear``)."""
    return groups if share == "group" else [[n] for g in groups for n in g]


def _searched(units: list[list[str]], scores: dict[str, torch.Tensor], pattern: Pattern,
              opts: PermOptions) -> tuple[dict, float]:
    """Swap-search permutation per unit (rows of its linears stacked), when ``--perm search`` or
    ``--perm-init search``; and the seconds it took."""
    if opts.perm != "search" and opts.init != "search":
        return {}, 0.0
    t0 = time.time()
    found = {u[0]: swap_search(torch.cat([scores[n] for n in u], dim=0), pattern.n, pattern.m, opts.block,
                               max_rounds=opts.rounds)
             for u in units}
    return found, time.time() - t0


def _unit_ties(units: list[list[str]], ties: dict[str, HeadTie]) -> dict[str, HeadTie]:
    """The ties of the units (by first member) whose every member has the same one."""
    out = {}
    for u in units:
        tie = ties.get(u[0])
        if tie is not None and all(ties.get(n) == tie for n in u):
            out[u[0]] = tie
    return out


def _expanded(perms_of_unit: dict[str, torch.Tensor], ties: dict[str, HeadTie]) -> dict[str, torch.Tensor]:
    """Each unit's map over its layers' columns (a tied unit's over ``heads·d``, :meth:`HeadTie.expand`)."""
    return {k: ties[k].expand(p) if k in ties else p for k, p in perms_of_unit.items()}


def _fixed_perms(units: list[list[str]], perms_of_unit: dict[str, torch.Tensor], ties: dict[str, HeadTie],
                 summary: dict | None = None) -> tuple[dict, dict]:
    full = _expanded(perms_of_unit, ties)
    perms = {name: full[u[0]] for u in units for name in u}
    info = {u[0]: {"linears": u, "strength": round(strength(full[u[0]]), 4),
                   **({"tied_heads": ties[u[0]].group} if u[0] in ties else {})} for u in units}
    return perms, {"perms": info, "summary": summary or {}}


@dataclass
class _Problem:
    """What the permutations of one block (or of the model) are learned for: the units sharing one
    permutation, their linears with their frozen float32 weights and Wanda's scores (a tied unit's
    folded, :meth:`HeadTie.fold`), and the swap search's permutations (over those columns)."""
    units: list[list[str]]
    linears: dict[str, nn.Linear | ExpertWeight]
    weights: dict[str, torch.Tensor]
    scores: dict[str, torch.Tensor]
    searched: dict[str, torch.Tensor]
    search_seconds: float
    pattern: Pattern
    opts: PermOptions
    ties: dict[str, HeadTie]   # by unit

    @property
    def key(self) -> dict[str, str]:
        """Each linear's unit (its first member's name)."""
        return {name: u[0] for u in self.units for name in u}

    def width(self, unit: str) -> int:
        """The columns ``unit``'s permutation is over."""
        return self.weights[unit].shape[1]

    def effective(self, perms: dict, masked: Callable) -> dict[str, torch.Tensor]:
        """Every linear's masked weight under its unit's permutation (soft blocks or hard index). On a
        GPU, with gradients on, each is recomputed in the backward rather than kept (activation
        checkpointing: the same values and gradients, without the ~20 bytes a weight of float32
        intermediates a learning step would otherwise hold until its backward; on the CPU, where
        memory is not what binds, the recomputation's time is not spent; it draws no random numbers, so
        no RNG state is kept for it)."""
        key, pattern = self.key, self.pattern
        out = {}
        for n, lin in self.linears.items():
            args = (self.weights[n], self.scores[n], perms[key[n]], pattern.n, pattern.m)
            recompute = torch.is_grad_enabled() and self.weights[n].is_cuda
            w = checkpoint(masked, *args, use_reentrant=False, preserve_rng_state=False) if recompute else masked(*args)
            out[n] = (self.ties[key[n]].unfold(w) if key[n] in self.ties else w).to(lin.weight.dtype)
        return out


def _problem(linears: dict[str, nn.Linear | ExpertWeight], norms: dict[str, torch.Tensor | None],
             groups: list[list[str]], pattern: Pattern, opts: PermOptions,
             ties: dict[str, HeadTie] | None = None) -> _Problem:
    """Units, scores and (where asked for) the swap search's permutations; ``ties`` by linear name."""
    units = _units(groups, opts.share)
    unit_ties = _unit_ties(units, ties or {})
    tie_of = {name: unit_ties[u[0]] for u in units for name in u if u[0] in unit_ties}
    weights = {name: lin.weight.detach().float() for name, lin in linears.items()}
    scores = {name: _score(w, norms[name]) for name, w in weights.items()}
    for name, tie in tie_of.items():
        weights[name], scores[name] = tie.fold(weights[name]), tie.fold(scores[name])
    searched, search_seconds = _searched(units, scores, pattern, opts)
    return _Problem(units, linears, weights, scores, searched, search_seconds, pattern, opts, unit_ties)


def _learn_and_choose(problem: _Problem, recon: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
                      n_windows: int, device: torch.device, gen: torch.Generator,
                      on_step: Callable[[int, float, float], None] | None) -> tuple[dict, dict]:
    """The shared learning loop: soft permutations per unit trained on ``recon(effective weights by
    linear name, window rows)`` (``1 − cos`` or KL), hardened, and the best of {final, best step,
    search, identity} kept — judged on every calibration window, or on the held-out ones
    (``opts.holdout``)."""
    opts, searched = problem.opts, problem.searched
    soft = {u[0]: SoftPermutation(problem.width(u[0]), opts.block, opts.relax,
                                  init_perm=searched.get(u[0])).to(device) for u in problem.units}
    learn_rows, judge_rows = split_windows(n_windows, opts.holdout, gen)

    def loss_fn(m_bars: dict[str, list[torch.Tensor]], step: int) -> torch.Tensor:
        rows = learn_rows[torch.randperm(len(learn_rows), generator=gen)[:opts.batch]]
        return recon(problem.effective(m_bars, masked_weight), rows)

    schedule = PermSchedule(steps=opts.steps, lambda_max=opts.lambda_max, lr_decay=opts.lr_decay)
    t0 = time.time()
    result = learn_permutations(soft, loss_fn, schedule, lr=opts.lr, on_step=on_step)
    learn_seconds = time.time() - t0
    # in tie-break order: the paper's final hardening first, the identity last
    candidates = {"final": result.perms, "best_step": result.best_perms, **({"search": searched} if searched else {}),
                  "identity": {k: torch.arange(sp.size) for k, sp in soft.items()}}

    def full_loss(perms: dict[str, torch.Tensor]) -> float:
        """Loss of hard permutations on every judged window: effective weights built once, by indexing."""
        eff = problem.effective(perms, hard_masked_weight)
        chunks = judge_rows.split(opts.batch)
        return sum(float(recon(eff, rows)) * len(rows) for rows in chunks) / len(judge_rows)

    with torch.no_grad():
        losses = {name: full_loss(c) for name, c in candidates.items()}
    chosen = min(candidates, key=lambda c: losses[c])
    key = problem.key
    full = _expanded(candidates[chosen], problem.ties)
    perms = {name: full[key[name]] for name in problem.linears}
    info = {}
    for k in soft:
        info[k] = {"linears": [n for n in problem.linears if key[n] == k], "strength": round(strength(full[k]), 4),
                   "penalty_curve": [round(v, 4) for v in result.penalty_per_perm[k]],
                   "hardening_step": opts.steps, "chosen": chosen,
                   **({"tied_heads": problem.ties[k].group} if k in problem.ties else {})}
    summary = {"loss_curve": [round(v, 6) for v in result.loss], "best_step": result.best_step,
               "recon_before": round(losses["identity"], 6), "recon_after": round(losses[chosen], 6),
               "recon_final": round(losses["final"], 6), "recon_best_step": round(losses["best_step"], 6),
               "chosen": chosen, "judged_on": "held-out" if opts.holdout else "all",
               "windows_learned": len(learn_rows), "windows_judged": len(judge_rows),
               **({"recon_search": round(losses["search"], 6)} if searched else {}),
               "seconds_search": round(problem.search_seconds, 3), "seconds_learning": round(learn_seconds, 3),
               "seconds_per_step": round(learn_seconds / opts.steps, 4)}
    return perms, {"perms": info, "summary": summary}


class FrozenParams:
    """Context: ``requires_grad=False`` on a module's parameters (restored after)."""

    def __init__(self, module: nn.Module):
        self.params = list(module.parameters())

    def __enter__(self) -> None:
        self.saved = [p.requires_grad for p in self.params]
        for p in self.params:
            p.requires_grad_(False)

    def __exit__(self, *exc) -> None:
        for p, r in zip(self.params, self.saved):
            p.requires_grad_(r)


def block_permutations(block: nn.Module, linears: dict[str, nn.Linear | ExpertWeight],
                       norms: dict[str, torch.Tensor | None], groups: list[list[str]], hidden: torch.Tensor,
                       target: torch.Tensor | None, captured: CapturedInputs, index: int, pattern: Pattern,
                       opts: PermOptions, device: torch.device,
                       on_step: Callable[[int, float, float], None] | None = None,
                       ties: dict[str, HeadTie] | None = None) -> tuple[dict, dict]:
    """Index maps ``{layer name: perm}`` for one block's linears and experts of fused MoE layers
    (``--recon block``), and report entries:
    ``{"perms": per permutation (its linears, strength, penalty curve…), "summary": block loss
    curve and recon before/after}``. ``ties``: the linears whose maps are tied across query heads
    (:func:`shuffleprune.perm.heads.head_ties`)."""
    ties = ties or {}
    gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + index)
    if opts.perm == "random":
        units = _units(groups, opts.share)
        unit_ties = _unit_ties(units, ties)
        width = {u[0]: unit_ties[u[0]].width if u[0] in unit_ties else linears[u[0]].in_features for u in units}
        return _fixed_perms(units, {u[0]: random_block_perm(width[u[0]], opts.block, gen) for u in units}, unit_ties)
    problem = _problem(linears, norms, groups, pattern, opts, ties)
    if opts.perm == "search":
        return _fixed_perms(problem.units, problem.searched, problem.ties,
                            {"seconds_search": round(problem.search_seconds, 3)})

    assert target is not None
    as_params = weight_params(block, linears)

    def recon(eff: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        params = as_params(eff)
        args, kwargs = captured.call_args(index, rows, device)
        out = captured.from_block(functional_call(block, params, (captured.to_block(hidden[rows].to(device)), *args), kwargs))
        return cosine_loss(target[rows].to(device), out)

    with FrozenParams(block):
        return _learn_and_choose(problem, recon, hidden.shape[0], device, gen, on_step)


def recon_learning_bytes(linears: dict[str, nn.Linear | ExpertWeight]) -> int:
    """At least the bytes :func:`model_permutations` holds on a GPU besides the model: per weight it
    learns a map for, a float32 copy (none when the weight is float32 already), its Wanda score in
    float32, and what one step keeps for its backward, its layer's effective weight in the weight's
    dtype (:meth:`_Problem.effective` recomputes the rest; activations are not counted)."""
    return sum(w.numel() * ((0 if w.dtype == torch.float32 else 4) + 4 + w.element_size())
               for w in (lin.weight for lin in linears.values()))


def model_permutations(model: nn.Module, linears: dict[str, nn.Linear | ExpertWeight], norms: dict[str, torch.Tensor],
                       groups: list[list[str]], tokens: torch.Tensor, pattern: Pattern, opts: PermOptions,
                       device: torch.device, batch_size: int = 8,
                       on_step: Callable[[int, float, float], None] | None = None,
                       ties: dict[str, HeadTie] | None = None) -> tuple[dict, dict]:
    """``--recon model`` (PermLLM's setting): all permutations trained jointly on the calibration
    windows ``tokens`` ``[n, L]``, every layer sparsified at once from the dense embeddings, against
    ``1 − cos`` of the dense model's final hidden state (the decoder's output, before the LM head;
    ``opts.loss == "cos"``, the paper) or the KL divergence from the dense model's next-token
    distribution (``"kl"``: both final hidden states through the model's output embeddings — a
    deviation from the paper, aimed at perplexity). ``norms`` are the dense model's input column norms.
    Needs the whole model on ``device``. ``ties`` as :func:`block_permutations`'."""
    head = model.get_output_embeddings() if opts.loss == "kl" else None
    if opts.loss == "kl" and head is None:
        raise UserError("--perm-loss kl needs a model with an LM head (output embeddings); use --perm-loss cos")
    gen = torch.Generator().manual_seed(opts.seed * 1_000_003 + 999_983)
    decoder = decoder_of(model, find_blocks(model))
    as_params = weight_params(decoder, linears)
    model.to(device)
    try:
        problem = _problem(linears, norms, groups, pattern, opts, ties)   # frozen weights and scores on the device
        with torch.no_grad():
            target = torch.cat([decoder(input_ids=tokens[s:s + batch_size].to(device), use_cache=False).last_hidden_state.cpu()
                                for s in range(0, tokens.shape[0], batch_size)])

        def recon(eff: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
            params = as_params(eff)
            out = functional_call(decoder, params, (), {"input_ids": tokens[rows].to(device), "use_cache": False}).last_hidden_state
            dense = target[rows].to(device)
            if head is None:
                return cosine_loss(dense, out)
            with torch.no_grad():  # recomputed per call: every window's logits would not fit (n·L·vocab floats)
                dense_logits = head(dense)
            return kl_loss(dense_logits, head(out))

        with FrozenParams(model):
            return _learn_and_choose(problem, recon, tokens.shape[0], device, gen, on_step)
    finally:
        model.to("cpu")
