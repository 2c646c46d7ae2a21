"""``permutation`` stages: one input-channel index map per linear, before its mask is chosen.

- ``random``: a fixed random block-diagonal permutation (the paper's control);
- ``search``: the data-free swap search on Wanda's score (Pool & Yu's heuristic, no training);
- ``learned``: ShuffleSparse — soft permutations trained with the l1−l2 penalty and hardened by
  Hungarian matching, per block (``recon: block``) or all jointly against the final hidden state
  before the walk (``recon: model``, the dense model's statistics);
- ``from``: the index maps of an earlier run (``--perm-from DIR``).

Every kind gives the experts of fused MoE layers their own maps as well, scored on their routed
tokens' norms (an expert no calibration token reached is scored by magnitude, as it is pruned). The
core (soft permutations, penalty, projection, search) lives in :mod:`shuffleprune.perm`.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from shuffleprune.errors import UserError, reason
from shuffleprune.hub import hub_reachable, looks_like_hub_id
from shuffleprune.blocks import text_config
from shuffleprune.perm.core import strength
from shuffleprune.perm.heads import HeadTie, head_ties
from shuffleprune.perm.linear import INDEX_MAPS, load_index_maps, save_index_maps
from shuffleprune.perm.pruning import PermOptions, block_permutations, model_permutations, recon_learning_bytes
from shuffleprune.prune.atomic import atomic_json
from shuffleprune.prune.input_stats import input_groups
from shuffleprune.prune.stage import BlockWork, Run, RunSpec, Stage, register
from shuffleprune.prune.stages.statistics import dense_stats

MODEL_PERMS_FILE = "model_perms.safetensors"


def _ties(model: torch.nn.Module, root: torch.nn.Module, layers: dict, groups: list[list[str]],
          opts: PermOptions) -> dict[str, HeadTie]:
    """The layers whose maps are tied across the query heads of a KV head (``tie_heads``), so that
    ``export`` folds them (:mod:`shuffleprune.perm.heads`)."""
    return head_ties(root, layers, groups, text_config(model), opts.block) if opts.tie_heads else {}


def _norms(stats: dict) -> dict[str, torch.Tensor | None]:
    """Input column norms for the maps' Wanda score; ``None`` (magnitude) where there are no
    statistics or no token reached the layer (an unrouted expert, which the prune stage masks by magnitude)."""
    return {name: None if s is None or s.tokens == 0 else s.col_norm for name, s in stats.items()}


class _PermStage(Stage):
    """Shared by the stages that compute their maps from the block (``random``, ``search``, ``learned``)."""

    def options(self, seed: int = 0) -> PermOptions:
        known = PermOptions.__dataclass_fields__
        return PermOptions(perm=self.name, seed=seed, **{k: v for k, v in self.params().items() if k in known})

    def check(self, spec: RunSpec) -> None:
        self.options().check(spec.pattern)

    def apply(self, run: Run, work: BlockWork) -> None:
        opts = self.options(run.seed)
        target = work.outputs(run) if opts.perm == "learned" else None

        def on_step(step: int, loss: float, penalty: float) -> None:
            run.status(f"block {work.index} perm step {step + 1}: loss {loss:.4g} P(M) {penalty:.3g}")

        groups = work.groups + work.expert_groups
        work.perms, work.perm_info = block_permutations(
            work.block, work.weights(), _norms(work.stats), groups, work.hidden, target,
            run.captured, work.index, run.pattern, opts, run.device, on_step=on_step,
            ties=_ties(run.model, work.block, work.weights(), groups, opts))


@dataclass
class _Fixed(_PermStage):
    """Parameters of the maps that need no training: the block size and who shares a map."""

    block: int = 64
    share: str = "group"
    tie_heads: bool = False  # GQA: the output projection's map shared by the query heads of a KV head (export folds it)


@register
@dataclass
class Random(_Fixed):
    kind = "permutation"
    name = "random"


@register
@dataclass
class Search(_Fixed):
    kind = "permutation"
    name = "search"
    rounds: int = 200    # swap rounds at most; it stops earlier once no swap helps

    def check(self, spec: RunSpec) -> None:
        super().check(spec)
        if self.rounds < 1:
            raise UserError("permutation 'search': rounds must be ≥ 1")


@register
@dataclass
class Learned(_PermStage):
    kind = "permutation"
    name = "learned"
    recon: str = "block"        # block: each block against its dense output; model: all jointly (final hidden state)
    init: str = "identity"      # identity (the paper) | search (the swap search's result)
    relax: str = "l1l2"         # l1l2 (ShuffleSparse) | sinkhorn (PermLLM)
    loss: str = "cos"           # recon model: cos (paper) | kl (next-token distributions)
    block: int = 64
    share: str = "group"
    tie_heads: bool = False
    steps: int = 100
    lr: float = 3e-2
    lr_decay: str = "constant"
    lambda_max: float = 1e-4
    batch: int = 4
    holdout: float = 0.0

    def check(self, spec: RunSpec) -> None:
        super().check(spec)
        if self.holdout and spec.nsamples < 2:
            raise UserError(f"--perm-holdout needs at least 2 calibration windows (--nsamples {spec.nsamples}); raise --nsamples")

    smaller = "learn the permutations block by block (--recon block, recipe 'paper') or take recipe 'accurate'"

    def device_bytes(self, weights: dict) -> int:
        return recon_learning_bytes(weights) if self.recon == "model" else 0

    def prepare(self, run: Run) -> None:
        if self.recon != "model":
            return
        saved = run.work / MODEL_PERMS_FILE if run.work is not None else None
        t0 = time.time()
        if saved is not None and saved.is_file():
            perms, info = load_index_maps(saved), json.loads((run.work / "model_perms.json").read_text())
        else:
            stats = dense_stats(run)
            bar = tqdm(total=self.steps, desc="perm (model recon)", disable=not run.progress)

            def on_step(step: int, loss: float, pen: float) -> None:
                bar.update(1)
                bar.set_postfix_str(f"loss {loss:.4g} P(M) {pen:.3g}")

            layers, groups, opts = {**run.all_linears(), **run.all_experts()}, input_groups(stats), self.options(run.seed)
            perms, info = model_permutations(run.model, layers, _norms(stats), groups, run.tokens, run.pattern, opts,
                                             run.device, run.batch_size, on_step,
                                             ties=_ties(run.model, run.model, layers, groups, opts))
            bar.close()
            if saved is not None:
                save_index_maps(perms, saved)
                atomic_json(info, run.work / "model_perms.json")
        self._perms, self._info = perms, info["perms"]  # what apply hands out, block by block
        run.notes["perm_model"] = info["summary"]
        run.notes["prepare_seconds"] = run.notes.get("prepare_seconds", 0.0) + time.time() - t0

    def apply(self, run: Run, work: BlockWork) -> None:
        if self.recon != "model":
            return super().apply(run, work)
        _assign(work, self._perms, self._info)


def _assign(work: BlockWork, perms: dict[str, torch.Tensor], info: dict) -> None:
    """Give the block its share of maps computed for the whole model before the walk."""
    weights = work.weights()
    work.perms = {n: perms[n] for n in weights if n in perms}
    work.perm_info = {"perms": {k: v for k, v in info.items() if k in weights}, "summary": {}}


@register
@dataclass
class From(Stage):
    """The index maps of an earlier ``--perm`` run (its output dir or an ``index_maps.safetensors``)."""

    kind = "permutation"
    name = "from"
    path: str = ""

    def check(self, spec: RunSpec) -> None:
        if not spec.pattern.is_nm:
            raise UserError("--perm-from needs an N:M --pattern: unstructured masks do not depend on column order")
        if not self.path:
            raise UserError("permutation 'from' needs a path (--perm-from DIR)")
        load_index_maps(self._maps_file())  # a missing, truncated or corrupt file fails now, before the model loads

    def _maps_file(self) -> Path:
        """The maps file: ``path`` itself, ``path/index_maps.safetensors``, or that file of the hub
        repo ``path`` (downloaded, or from the cache offline)."""
        path = Path(self.path).expanduser()
        file = path / INDEX_MAPS if path.is_dir() else path
        if file.is_file():
            return file
        if not path.exists() and looks_like_hub_id(self.path):
            from huggingface_hub import hf_hub_download

            hub_reachable()
            try:
                return Path(hf_hub_download(self.path, INDEX_MAPS))
            except (OSError, ValueError) as exc:
                raise UserError(f"--perm-from: no index maps at '{self.path}', locally or as a hub repo "
                                f"({reason(exc, 120)})") from exc
        raise UserError(f"--perm-from: no index maps at '{file}' (give the output dir of a --perm run)")

    def prepare(self, run: Run) -> None:
        maps = load_index_maps(self._maps_file())
        linears = {**run.all_linears(), **run.all_experts()}
        for name, perm in maps.items():
            if name not in linears:
                raise UserError(f"--perm-from: '{name}' is not a selected linear or expert of this model")
            if perm.numel() != linears[name].in_features or perm.numel() % run.pattern.m:
                raise UserError(f"--perm-from: index map '{name}' does not fit its layer ({linears[name].in_features} inputs)")
        self._perms = maps
        self._info = {n: {"linears": [n], "strength": round(strength(p), 4)} for n, p in maps.items()}

    def apply(self, run: Run, work: BlockWork) -> None:
        _assign(work, self._perms, self._info)
