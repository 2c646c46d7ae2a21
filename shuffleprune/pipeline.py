"""Sequential, block-wise one-shot pruning with error propagation and resume.

For each decoder block in order: hook its linear layers and run the calibration inputs through it
(statistics), prune every selected linear, run the inputs through the *pruned* block to get the
next block's inputs, checkpoint. Only the current block sits on the compute device.
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from . import __version__
from .blocks import CapturedInputs, block_linears, capture_block_inputs, find_blocks, first_tensor, tensors_to
from .calib import calibration_windows, default_eval_source, eval_tokens, get_source
from .errors import UserError
from .perm_prune import PermOptions, block_permutations, model_permutations, prune_in_permuted_coordinates
from .perplexity import perplexity
from .sparse_linear import SparseLinear
from .masks import Pattern, parse_pattern, satisfies_nm, sparsity_of
from .permutation import strength
from .permuted_linear import PermutedLinear, load_index_maps, permuted_state_dict, save_index_maps
from .methods import NEEDS_GRAM, NEEDS_STATS, get_method
from .models import INDEX_MAPS, LoadedModel, load_model, upcast_for_cpu  # INDEX_MAPS: int32 perm per permuted linear
from .runtime import peak_rss_mb, pick_device, tf32_matmuls, versions
from .stats import collect_input_stats, input_groups, load_norms, save_norms

RESUME_DIR = ".resume"
REPORT_NAME = "prune_report.json"


@dataclass
class PruneConfig:
    """Everything that determines a pruning run's result (and, for resume, must not change)."""

    model: str | None = None
    method: str = "wanda"
    pattern: str | None = "2:4"
    sparsity: float | None = None
    calib: str = "wiki"
    nsamples: int = 128
    seqlen: int = 2048
    seed: int = 0
    only: list[str] | None = None
    skip: list[str] | None = None
    dtype: str = "auto"
    eval_text: str | None = "auto"   # None: no perplexity
    eval_ctx: int | None = None      # default: the calibration seqlen
    eval_tokens: int | None = None   # cap on held-out tokens
    device: str = "auto"
    batch_size: int = 8              # calibration windows per block forward
    perm: str = "none"               # none | random | search | learned (ShuffleSparse)
    perm_init: str = "identity"      # learned: identity (paper) | search
    recon: str = "block"             # learned: block (sequential) | model (joint, final hidden state)
    perm_loss: str = "cos"           # model recon: cos (paper) | kl (next-token distributions)
    relax: str = "l1l2"              # l1l2 (ShuffleSparse) | sinkhorn (PermLLM)
    perm_block: int = 64
    perm_steps: int = 100
    perm_lr: float = 3e-2
    perm_lr_decay: str = "constant"
    perm_lambda: float = 1e-4
    perm_share: str = "group"
    perm_batch: int = 4
    perm_holdout: float = 0.0
    perm_from: str | None = None     # reuse the index maps of an earlier --perm run (dir or .safetensors)
    mask_stats: str = "auto"         # Wanda's mask statistics: sequential | dense | auto (dense with --recon model)
    tf32: bool = False               # allow TF32 matmuls on CUDA (faster permutation learning)

    def perm_options(self) -> PermOptions:
        return PermOptions(perm=self.perm, init=self.perm_init, recon=self.recon, loss=self.perm_loss, relax=self.relax,
                           block=self.perm_block, steps=self.perm_steps, lr=self.perm_lr, lr_decay=self.perm_lr_decay,
                           lambda_max=self.perm_lambda, share=self.perm_share, batch=self.perm_batch,
                           holdout=self.perm_holdout, seed=self.seed)

    def key(self) -> str:
        fixed = {k: v for k, v in asdict(self).items() if k not in ("device", "batch_size")}
        return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]

    def mask_stats_mode(self) -> str:
        """``sequential`` or ``dense``: ``auto`` is dense exactly when ``--recon model`` learned the
        permutations under the dense model's statistics for a norm-only mask (Wanda)."""
        if self.mask_stats not in ("auto", "sequential", "dense"):
            raise UserError(f"unknown --mask-stats '{self.mask_stats}'; use auto, sequential or dense")
        norm_only = self.method in NEEDS_STATS and self.method not in NEEDS_GRAM
        if self.mask_stats == "dense" and not norm_only:
            raise UserError(f"--mask-stats dense needs --base wanda (its mask reads input norms alone; {self.method}'s "
                            "does not); use --mask-stats sequential")
        if self.mask_stats == "auto":
            learned_on_model = self.perm == "learned" and self.recon == "model" and not self.perm_from
            return "dense" if norm_only and learned_on_model else "sequential"
        return self.mask_stats


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` to a temporary file, then rename it onto ``path``: a resume finds the file whole or not at all."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _atomic_save(obj, path: Path) -> None:
    _atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _atomic_json(obj, path: Path) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2)))


@torch.no_grad()
def run_block(block: torch.nn.Module, hidden: torch.Tensor, captured: CapturedInputs, index: int,
              device: torch.device, batch_size: int) -> torch.Tensor:
    """Outputs of ``block`` for all calibration windows ``hidden`` ``[n, L, d]`` (kept where ``hidden`` lives)."""
    args = tensors_to(captured.args[index], device)
    kwargs = tensors_to(captured.kwargs[index], device)
    out = torch.empty_like(hidden)
    for s in range(0, hidden.shape[0], batch_size):
        out[s:s + batch_size] = first_tensor(block(hidden[s:s + batch_size].to(device), *args, **kwargs)).to(out.device)
    return out


def _step_reporter(bar, block_index: int) -> Callable[[int, float, float], None]:
    """Show the permutation optimisation's step, loss and penalty on the block progress bar."""
    def report(step: int, loss: float, penalty: float) -> None:
        bar.set_postfix_str(f"block {block_index} perm step {step + 1}: loss {loss:.4g} P(M) {penalty:.3g}")
    return report


@dataclass
class PruneResult:
    report: dict
    model: torch.nn.Module = field(repr=False)
    tokenizer: object = field(repr=False)


def _prepare_out(out: Path | None, resume: bool, overwrite: bool) -> dict | None:
    """Validate ``--out``; return the saved resume state when resuming."""
    if out is None:
        if resume:
            raise UserError("--resume needs --out DIR (where the interrupted run checkpointed)")
        return None
    state_file = out / RESUME_DIR / "state.json"
    if resume:
        if not state_file.is_file():
            raise UserError(f"nothing to resume in '{out}': no {RESUME_DIR}/state.json (run without --resume)")
        return json.loads(state_file.read_text())
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            hint = "--resume to continue it, or " if state_file.is_file() else ""
            raise UserError(f"output dir '{out}' is not empty; use {hint}--overwrite, or another --out")
        shutil.rmtree(out)
    return None


def prune(config: PruneConfig, out: Path | str | None = None, resume: bool = False, overwrite: bool = False,
          progress: bool = True, on_block_done: Callable[[int], None] | None = None,
          loaded: LoadedModel | None = None) -> PruneResult:
    """Prune ``config.model`` and (with ``out``) write an HF checkpoint plus ``prune_report.json``.

    ``on_block_done(i)`` is called after block ``i`` is pruned and checkpointed (tests use it to
    simulate a crash). ``loaded`` lets a Python caller pass an already-loaded model. With
    ``config.tf32`` on a CUDA device, float32 matmuls use TF32 for the run (restored afterwards).
    """
    device = pick_device(config.device)
    with tf32_matmuls(device, config.tf32):
        return _prune(config, device, out, resume, overwrite, progress, on_block_done, loaded)


def _prune(config: PruneConfig, device: torch.device, out: Path | str | None, resume: bool, overwrite: bool,
           progress: bool, on_block_done: Callable[[int], None] | None, loaded: LoadedModel | None) -> PruneResult:
    t_start = time.time()
    out = Path(out) if out is not None else None
    pattern: Pattern = parse_pattern(config.pattern, config.sparsity)
    method = get_method(config.method)
    calib_source = get_source(config.calib)
    eval_name = None if config.eval_text is None else (
        default_eval_source(config.calib) if config.eval_text == "auto" else config.eval_text)
    eval_source = get_source(eval_name) if eval_name else None
    perm_opts = config.perm_options()
    perm_opts.check(pattern)
    mask_stats_mode = config.mask_stats_mode()
    if perm_opts.perm == "learned" and perm_opts.holdout and config.nsamples < 2:
        raise UserError(f"--perm-holdout needs at least 2 calibration windows (--nsamples {config.nsamples}); raise --nsamples")
    if config.perm_from and (perm_opts.perm != "none" or not pattern.is_nm):
        raise UserError("--perm-from replaces --perm (leave --perm at none) and needs an N:M --pattern")
    state = _prepare_out(out, resume, overwrite)
    if state is not None and state["config_key"] != config.key():
        raise UserError("--resume with different settings than the interrupted run; repeat its exact options")

    lm = loaded or load_model(config.model, config.dtype)
    model, tokenizer = lm.model, lm.tokenizer
    save_dtype = model.dtype
    upcast_for_cpu(model, config.dtype, device)  # the checkpoint keeps save_dtype
    if any(isinstance(m, (PermutedLinear, SparseLinear)) for m in model.modules()):
        raise UserError("this model is a --perm or exported checkpoint (index maps / compressed layers); "
                        "prune its dense original instead")
    blocks = find_blocks(model)
    layer_names: list[dict[str, torch.nn.Linear]] = []
    for i, block in enumerate(blocks.layers):
        linears = block_linears(block, f"{blocks.name}.{i}", config.only, config.skip)
        for name, lin in linears.items():
            pattern.check_width(name, lin.in_features)
        layer_names.append(linears)
    if not any(layer_names):
        raise UserError("no linear layers selected; check --only / --skip")
    max_pos = getattr(model.config, "max_position_embeddings", None) or config.seqlen
    seqlen = min(config.seqlen, max_pos)
    ctx = min(config.eval_ctx or seqlen, max_pos)

    work = out / RESUME_DIR if out is not None else None
    if state is None:
        t0 = time.time()
        tokens = calibration_windows(calib_source, tokenizer, config.nsamples, seqlen, config.seed)
        held_out = eval_tokens(eval_source, tokenizer, config.eval_tokens) if eval_source else None
        calib_seconds = time.time() - t0
        if work is not None:  # created only once all inputs are known to be good
            work.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        dense_ppl = perplexity(model.to(device), held_out, ctx, device, progress=progress) if held_out is not None else None
        model.to("cpu")
        eval_seconds = time.time() - t0
        state = {"config_key": config.key(), "config": asdict(config), "next_block": 0, "layers": [],
                 "dense_ppl": dense_ppl, "calib_seconds": calib_seconds, "eval_seconds": eval_seconds,
                 "prune_seconds": 0.0, "seqlen": seqlen, "eval_ctx": ctx, "perm_blocks": [],
                 "eval_tokens": None if held_out is None else int(held_out.numel())}
        if work is not None:
            _atomic_save({"tokens": tokens, "held_out": held_out}, work / "data.pt")
    else:
        data = torch.load(work / "data.pt")
        tokens, held_out = data["tokens"], data["held_out"]
        for i in range(state["next_block"]):
            blocks.layers[i].load_state_dict(load_file(str(work / f"block_{i}.safetensors")))

    t0 = time.time()
    start = state["next_block"]
    if start == 0:
        captured = capture_block_inputs(model, blocks, tokens, device, config.batch_size)
        hidden = captured.hidden
    else:  # the blocks' keyword arguments are recomputed; their inputs come from the checkpoint
        captured = capture_block_inputs(model, blocks, tokens[:1], device, 1)
        # every block done (only the checkpoint was left to write): no block input is needed
        hidden = torch.load(work / f"hidden_{start}.pt").to(device) if start < len(blocks) else None
    captured.hidden = None
    state["calib_seconds"] += time.time() - t0

    model_perms, model_perm_info = None, None
    # the dense model's statistics, gathered (or reloaded on resume) before any block is pruned
    dense_stats = _dense_stats(model, layer_names, tokens, device, config.batch_size, work) \
        if mask_stats_mode == "dense" or (perm_opts.perm == "learned" and perm_opts.recon == "model") else None
    if config.perm_from:
        model_perms = _perms_from(config.perm_from, layer_names, pattern)
        model_perm_info = {"perms": {n: {"linears": [n], "strength": round(strength(p), 4)} for n, p in model_perms.items()}}
    elif perm_opts.perm == "learned" and perm_opts.recon == "model":
        t0 = time.time()
        model_perms, model_perm_info = _model_level_perms(model, layer_names, dense_stats, tokens, pattern, perm_opts,
                                                          device, config.batch_size, work, progress)
        state["prune_seconds"] += time.time() - t0  # on resume: reloading the saved maps
        state["perm_model"] = model_perm_info["summary"]
    all_perms: dict[str, torch.Tensor] = {}
    if work is not None:
        for j in range(start):
            if (work / f"perms_{j}.safetensors").is_file():
                all_perms.update(load_index_maps(work / f"perms_{j}.safetensors"))
    gram = config.method in NEEDS_GRAM
    bar = tqdm(range(start, len(blocks)), desc=f"{config.method} {pattern}", disable=not progress,
               initial=start, total=len(blocks))
    for i in bar:
        t0 = time.time()
        block = blocks.layers[i].to(device)
        linears = layer_names[i]
        if mask_stats_mode == "dense":  # masks (and block-wise permutation scores) from the dense statistics:
            stats = {name: dense_stats[name] for name in linears}  # no pass over this block's own inputs
            groups = input_groups(stats)
        elif config.method in NEEDS_STATS:
            with collect_input_stats(linears, gram) as stats:
                run_block(block, hidden, captured, i, device, config.batch_size)
            groups = input_groups(stats)
        else:  # magnitude needs no calibration statistics: skip that pass
            stats, groups = {name: None for name in linears}, [[name] for name in linears]
        perms, perm_info = {}, None
        if model_perms is not None:
            perms = {n: model_perms[n] for n in linears if n in model_perms}
            perm_info = {"perms": {k: v for k, v in model_perm_info["perms"].items() if k in linears}, "summary": {}}
        elif perm_opts.perm != "none":
            target = run_block(block, hidden, captured, i, device, config.batch_size) if perm_opts.perm == "learned" else None
            bar_steps = _step_reporter(bar, i) if progress else None
            perms, perm_info = block_permutations(block, f"{blocks.name}.{i}", linears, stats, groups, hidden, target,
                                                  captured, i, pattern, perm_opts, device, on_step=bar_steps)
            del target
        for group in groups:
            for name in group:
                lin = linears[name]
                perm = perms.get(name)
                if perm is None:
                    new_w = method(lin.weight.data.float(), stats[name], pattern)
                else:
                    new_w = prune_in_permuted_coordinates(method, lin.weight.data.float(), stats[name], pattern, perm)
                lin.weight.data.copy_(new_w.to(lin.weight.dtype))
                w = lin.weight.data
                in_memory = w if perm is None else w[:, perm.to(w.device)]  # the order an N:M kernel stores
                entry = {"name": name, "shape": list(w.shape), "shares_input_with": [n for n in group if n != name],
                         "sparsity": round(sparsity_of(w), 6),
                         "nm_ok": satisfies_nm(in_memory, pattern.n, pattern.m) if pattern.is_nm else None}
                if perm is not None:
                    entry["perm_strength"] = round(strength(perm), 4)
                state["layers"].append(entry)
        if perm_info is not None:
            state["perm_blocks"].append({"block": i, "perms": perm_info["perms"], **perm_info["summary"]})
        del stats
        hidden = run_block(block, hidden, captured, i, device, config.batch_size)
        blocks.layers[i] = block.to("cpu")
        state["prune_seconds"] += time.time() - t0
        state["next_block"] = i + 1
        all_perms.update(perms)
        if work is not None:
            save_file({k: v.contiguous() for k, v in block.state_dict().items()}, str(work / f"block_{i}.safetensors"))
            if perms:
                save_index_maps(perms, work / f"perms_{i}.safetensors")
            if i + 1 < len(blocks):
                _atomic_save(hidden.cpu(), work / f"hidden_{i + 1}.pt")
            _atomic_json(state, work / "state.json")
            stale = work / f"hidden_{i}.pt"
            if stale.exists():
                stale.unlink()
        if on_block_done is not None:
            on_block_done(i)
    del hidden

    if "pruned_ppl" not in state:  # a resumed run that only had its checkpoint left to write skips this
        t0 = time.time()
        state["pruned_ppl"] = (perplexity(model.to(device), held_out, ctx, device, progress=progress)
                               if held_out is not None else None)
        model.to("cpu")
        state["eval_seconds"] += time.time() - t0
        if work is not None:
            _atomic_json(state, work / "state.json")
    pruned_ppl = state["pruned_ppl"]
    compute_dtype = str(next(model.parameters()).dtype)
    model.to(save_dtype)

    report = {
        "tool": "shuffleprune", "version": __version__,
        "model": lm.source, "model_path": lm.path, "method": config.method, "pattern": str(pattern),
        "target_sparsity": pattern.sparsity,
        "calib": {"source": config.calib, "nsamples": config.nsamples, "seqlen": seqlen, "seed": config.seed},
        "eval": {"text": eval_name, "split": "test", "ctx": ctx, "tokens": state["eval_tokens"]},
        "ppl": {"dense": state["dense_ppl"], "pruned": pruned_ppl},
        "sparsity": _overall_sparsity(state["layers"]),
        "nm_ok": all(l["nm_ok"] for l in state["layers"]) if pattern.is_nm else None,
        "layers": state["layers"],
        "perm": None if perm_opts.perm == "none" and not config.perm_from else {
            **asdict(perm_opts), "from": config.perm_from, "blocks": state["perm_blocks"],
            "model": state.get("perm_model"), "index_maps": INDEX_MAPS if all_perms else None},
        "mask_stats": mask_stats_mode if config.method in NEEDS_STATS else None,
        "seconds": {"calibration": round(state["calib_seconds"], 2), "prune": round(state["prune_seconds"], 2),
                    "eval": round(state["eval_seconds"], 2), "this_process": round(time.time() - t_start, 2)},
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "peak_cuda_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if device.type == "cuda" else None,
        "device": str(device), "compute_dtype": compute_dtype,
        "resumed": resume, "command": " ".join(sys.argv),
        "versions": versions(),
        "config": asdict(config),
    }
    if out is not None:
        _write_checkpoint(out, model, tokenizer, report, all_perms)
    return PruneResult(report=report, model=model, tokenizer=tokenizer)


def _perms_from(source: str, layer_names: list[dict], pattern: Pattern) -> dict[str, torch.Tensor]:
    """Index maps of an earlier ``--perm`` run, checked against this model's selected linears."""
    path = Path(source)
    maps = load_index_maps(path / INDEX_MAPS if path.is_dir() else path)
    linears = {n: lin for block in layer_names for n, lin in block.items()}
    for name, perm in maps.items():
        if name not in linears:
            raise UserError(f"--perm-from: '{name}' is not a selected linear of this model")
        if perm.numel() != linears[name].in_features or perm.numel() % pattern.m:
            raise UserError(f"--perm-from: index map '{name}' does not fit its layer ({linears[name].in_features} inputs)")
    return maps


def _dense_stats(model, layer_names: list[dict], tokens: torch.Tensor, device: torch.device, batch_size: int,
                 work: Path | None) -> dict:
    """The unpruned model's input norms for every selected linear, from one pass over the calibration
    windows (saved in the work dir: a resumed run's earlier blocks are already pruned)."""
    saved = work / "dense_stats.safetensors" if work is not None else None
    if saved is not None and saved.is_file():
        return load_norms(saved)
    if saved is not None and (work / "state.json").is_file() and json.loads((work / "state.json").read_text())["next_block"]:
        raise UserError(f"'{work.parent}' was started by an older shuffleprune; rerun with --overwrite instead of --resume")
    linears = {n: lin for block in layer_names for n, lin in block.items()}
    model.to(device)
    with collect_input_stats(linears, gram=False) as stats, torch.no_grad():
        for s in range(0, tokens.shape[0], batch_size):
            model.base_model(input_ids=tokens[s:s + batch_size].to(device))
    model.to("cpu")
    if saved is not None:
        _atomic_write(saved, lambda tmp: save_norms(stats, tmp))
    return stats


def _model_level_perms(model, layer_names: list[dict], stats: dict, tokens: torch.Tensor, pattern: Pattern,
                       opts: PermOptions, device: torch.device, batch_size: int, work: Path | None,
                       progress: bool) -> tuple[dict, dict]:
    """``--recon model``: learn every permutation jointly before the block loop (or reload them on
    resume), with Wanda's score from the dense model's input statistics ``stats``."""
    saved = work / "model_perms.safetensors" if work is not None else None
    if saved is not None and saved.is_file():
        info = json.loads((work / "model_perms.json").read_text())
        return load_index_maps(saved), info
    linears = {n: lin for block in layer_names for n, lin in block.items()}
    bar = tqdm(total=opts.steps, desc="perm (model recon)", disable=not progress)

    def on_step(step: int, loss: float, pen: float) -> None:
        bar.update(1)
        bar.set_postfix_str(f"loss {loss:.4g} P(M) {pen:.3g}")

    perms, info = model_permutations(model, linears, stats, input_groups(stats), tokens, pattern, opts, device,
                                     batch_size, on_step)
    bar.close()
    if saved is not None:
        save_index_maps(perms, saved)
        _atomic_json(info, work / "model_perms.json")
    return perms, info


def _overall_sparsity(layers: list[dict]) -> float:
    total = sum(l["shape"][0] * l["shape"][1] for l in layers)
    zeros = sum(l["sparsity"] * l["shape"][0] * l["shape"][1] for l in layers)
    return round(zeros / total, 6) if total else 0.0


def _disk_full(exc: BaseException) -> bool:
    """``OSError(ENOSPC)``, or safetensors' wrapped form of it (not an ``OSError``)."""
    return getattr(exc, "errno", None) == errno.ENOSPC or "No space left on device" in str(exc)


def _write_checkpoint(out: Path, model, tokenizer, report: dict, perms: dict[str, torch.Tensor]) -> None:
    """Write into ``out/.staging`` then move the files into ``out`` and drop the resume state."""
    staging = out / ".staging"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        # weights of permuted linears go in permuted column order: exactly N:M as stored
        model.save_pretrained(staging, state_dict=permuted_state_dict(model, perms) if perms else None)
        tokenizer.save_pretrained(staging)
        (staging / REPORT_NAME).write_text(json.dumps(report, indent=2))
        if perms:
            save_index_maps(perms, staging / INDEX_MAPS)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if _disk_full(exc):
            need = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**30
            raise UserError(f"no space left on the device of '{out}' for the checkpoint (~{need:.1f} GiB): free "
                            "space or pick another --out; rerun the same command with --resume to write it "
                            "without pruning again") from exc
        raise
    for item in staging.iterdir():
        os.replace(item, out / item.name)
    staging.rmdir()
    shutil.rmtree(out / RESUME_DIR, ignore_errors=True)
