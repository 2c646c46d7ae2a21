"""The block walk: sequential, block-wise one-shot pruning with error propagation and resume.

The driver knows nothing about methods. It captures block 0's inputs, lets every stage prepare
(model-level passes), then for each decoder block runs the recipe's stages in order, propagates
the pruned block's outputs to the next block and checkpoints (``--resume`` continues
bit-identically). Only the current block sits on the compute device.
"""
from __future__ import annotations

import json
import shutil
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from shuffleprune.block_inputs import CapturedInputs, called_modules, capture_block_inputs, run_block, run_blocks
from shuffleprune.blocks import (OUTSIDE_LINEARS_WARN_SHARE, Blocks, ExpertWeight, block_experts, block_linears, find_blocks,
                                  GATING_WIDTH, gating_linears, is_plain_linear, parse_expert_name, selected_by_globs, text_config,
                                  weights_outside_linears)
from shuffleprune.calib import (TextSource, bos_token, calibration_windows, default_eval_source, eval_tokens, open_text,
                               same_text, text_contains)
from shuffleprune.conv1d import linears_from_conv1d
from shuffleprune.deploy.sparse_linear import SparseLinear
from shuffleprune.errors import UserError
from shuffleprune.evaluation.perplexity import perplexity, scored_tokens
from shuffleprune.masks import satisfies_nm, sparsity_of
from shuffleprune.models import LoadedModel, load_model, local_model_source, refuse_quantized, upcast_for_cpu
from shuffleprune.outdir import (check_free_space, check_writable, clear_dir, held_alone, refuse_clearing_inputs, size_text,
                                 space_errors, tree_bytes)
from shuffleprune.perm.core import strength
from shuffleprune.perm.linear import load_index_maps, save_index_maps
from shuffleprune.placement import held_for_run
from shuffleprune.prune.atomic import atomic_json, atomic_save
from shuffleprune.prune.checkpoint import build_report, write_checkpoint
from shuffleprune.prune.config import PruneConfig
from shuffleprune.prune.stage import BlockWork, Run
from shuffleprune.quiet import library_progress_bars
from shuffleprune.runtime.determinism import deterministic_algorithms
from shuffleprune.runtime.devices import indexed_cuda, pick_device, tf32_matmuls
from shuffleprune.runtime.memory import (fits_on_device, logits_bytes, peak_memory_mb, reset_peak_memory,
                                         start_run_peak, tensor_bytes)
from shuffleprune.stacked_experts import MatmulTrace, stacked_experts

RESUME_DIR = ".resume"


@dataclass
class PruneResult:
    report: dict
    model: torch.nn.Module = field(repr=False)
    tokenizer: object = field(repr=False)


def resumable(out: Path | str | None) -> bool:
    """Whether ``out`` holds the state of an interrupted run that ``--resume`` can continue."""
    return out is not None and (Path(out) / RESUME_DIR / "state.json").is_file()


NOTHING_SELECTED = "no linear layers selected; check --only / --skip"


def _prepare_out(out: Path | None, resume: bool, overwrite: bool, config: PruneConfig) -> dict | None:
    """Validate ``--out`` (never one holding the run's inputs); return the saved resume state when resuming.
    A fresh run's ``--out`` is emptied later, once the model has loaded (:func:`_clear_out`)."""
    if out is None:
        if resume:
            raise UserError("--resume needs --out DIR (where the interrupted run checkpointed)")
        return None
    check_writable(out, "--out")
    state_file = out / RESUME_DIR / "state.json"
    if resume:
        if not state_file.is_file():
            raise UserError(f"nothing to resume in '{out}': no {RESUME_DIR}/state.json (run without --resume)")
        return json.loads(state_file.read_text())
    if out.exists() and any(out.iterdir()):
        refuse_clearing_inputs(out, _local_inputs(config))
        leftover = [p.name for p in out.iterdir()] == [RESUME_DIR] and not state_file.is_file()
        if not overwrite and not leftover:  # a run stopped before its first checkpoint left nothing to keep
            hint = "--resume to continue it, or " if state_file.is_file() else ""
            raise UserError(f"output dir '{out}' is not empty; use {hint}--overwrite, or another --out")
    return None


def _clear_out(out: Path | None, resume: bool) -> None:
    """Empty a fresh run's ``--out`` (checked by :func:`_prepare_out`): only once the model has
    loaded and its layers are selected, so a model that fails to load never costs an earlier run's output."""
    if out is not None and not resume and out.exists() and any(out.iterdir()):
        clear_dir(out)


def _local_inputs(config: PruneConfig) -> list[str | None]:
    """What the run reads from disk: the model (the embedded GGUF when none is named), the texts and
    earlier index maps (the recipe file was read into ``config`` already)."""
    maps = [entry.get("path") for entry in config.stages]
    return [local_model_source(config.model), config.calib, config.eval_text, *maps]


@dataclass
class _Texts:
    """The run's texts, opened (a local file read and parsed) before the model loads."""

    calib: TextSource
    eval: TextSource | None
    eval_name: str | None
    shared: bool   # one local file split between calibration and evaluation


def _open_texts(config: PruneConfig, documents: dict[str, tuple[str, ...]]) -> _Texts:
    """Open ``--calib`` and the held-out text (a name in ``documents``: those passed in memory): an
    unknown, missing or unreadable text fails here, before the model is loaded, and a local file is
    read once for the run."""
    eval_name = _eval_name(config)
    shared = same_text(config.calib, eval_name)
    if not shared and text_contains(config.calib, eval_name):
        warnings.warn(f"the perplexity text '{eval_name}' is part of the calibration text '{config.calib}': its perplexity "
                      "is not held out (give --eval-text a text outside it, or the same directory to split it)",
                      stacklevel=2)
    calib = open_text(config.calib, documents, shared)
    held = None if eval_name is None else (calib if shared else open_text(eval_name, documents))
    return _Texts(calib, held, eval_name, shared)


def _texts(config: PruneConfig, texts: _Texts, tokenizer, seqlen: int,
           ctx: int) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """Calibration windows, held-out tokens, and what was used of each text (documents, tokens, BOS)."""
    tokenizer_bos = bos_token(tokenizer)
    bos = tokenizer_bos if config.bos == "window" else None
    special = config.bos == "text"   # each text encoded as the tokenizer encodes it alone, as the papers' loaders
    calib_info: dict = {}
    tokens = calibration_windows(texts.calib, tokenizer, config.nsamples, seqlen, config.seed, bos=bos, info=calib_info,
                                 special_tokens=special)
    eval_info: dict = {}
    held_out = (eval_tokens(texts.eval, tokenizer, config.eval_tokens, eval_info, ctx, special)
                if texts.eval is not None else None)
    info = {"eval_text": texts.eval_name, "shared_file_split": texts.shared, "bos": bos is not None,
            "bos_mode": config.bos if tokenizer_bos is not None else None,   # None: the tokenizer adds no BOS
            "calib": calib_info,   # documents, tokens (and conversations, chat_template for chat data)
            "eval": None if held_out is None else {**eval_info, "tokens_read": int(held_out.numel())}}
    return tokens, held_out, info


def _held_out_ppl(model: torch.nn.Module, held_out: torch.Tensor, ctx: int, device: torch.device, progress: bool,
                  bos: int | None, record: dict) -> float:
    """Perplexity of the model (kept on the CPU between stages) on ``device``: moved there whole when
    it fits, else scored one block at a time on it (``record["block_by_block"]``: either time was)."""
    whole = fits_on_device(model, device, logits_bytes(model, ctx))
    record["block_by_block"] = record.get("block_by_block", False) or not whole
    try:
        return perplexity(model.to(device) if whole else model, held_out, ctx, device, progress=progress, bos=bos,
                          blockwise=not whole)
    finally:
        model.to("cpu")


def _eval_name(config: PruneConfig) -> str | None:
    """The held-out text: ``--eval-text``, the default for the calibration source, or None."""
    if config.eval_text is None:
        return None
    return default_eval_source(config.calib) if config.eval_text == "auto" else config.eval_text


def prune(config: PruneConfig, out: Path | str | None = None, resume: bool = False, overwrite: bool = False,
          progress: bool = True, on_block_done: Callable[[int], None] | None = None,
          loaded: LoadedModel | None = None, documents: dict[str, tuple[str, ...]] | None = None) -> PruneResult:
    """Prune ``config.model`` with ``config.stages`` and (with ``out``) write an HF checkpoint,
    ``prune_report.json``, ``recipe.yaml`` and a ``README.md`` model card.

    ``on_block_done(i)`` is called after block ``i`` is pruned and checkpointed (tests use it to
    simulate a crash). ``loaded`` lets a Python caller pass an already-loaded model (pruned in place,
    run in eval mode, given back on its devices in its dtypes and mode, or dispatched by its
    ``device_map`` again: :func:`~shuffleprune.placement.held_for_run`), ``documents``
    texts in memory under the names ``config.calib`` / ``config.eval_text`` give them
    (:func:`~shuffleprune.calib.sources.documents_name`). With
    ``config.tf32`` on a CUDA device, float32 matmuls use TF32 for the run; with ``config.deterministic``,
    PyTorch's deterministic algorithms run it (:func:`~shuffleprune.runtime.determinism.deterministic_algorithms`;
    both restored afterwards).
    """
    device = pick_device(config.device)
    start_run_peak(device)   # the report's peak_cuda_mb: this run's
    if loaded is not None:   # before it is moved (a named model is refused as it loads)
        refuse_quantized(loaded.model.config, loaded.source)
    out = Path(out) if out is not None else None
    existed = out is not None and out.exists()
    full = nullcontext() if out is None else space_errors(
        out, "--out", hint=lambda: "; then the same command with --resume continues it" if resumable(out) else "")
    strict = deterministic_algorithms(config.deterministic, hint=lambda: (
        " and with --resume, which continues from the last finished block" if resumable(out) else ""))
    with held_alone(out) if out is not None else nullcontext():   # a second run on --out is refused, touching nothing
        try:   # a caller's model is pruned in place and given back where and as it was
            with full, held_for_run(loaded.model) if loaded is not None else nullcontext(), \
                    tf32_matmuls(device, config.tf32), strict, library_progress_bars(progress):
                return _walk(config, device, out, resume, overwrite, progress, on_block_done, loaded, documents or {})
        except BaseException:
            if out is not None:
                _discard_unresumable(out, existed)
            raise


def _discard_unresumable(out: Path, existed: bool) -> None:
    """After a failed run: remove what it wrote before its first checkpoint (``.resume`` without a
    ``state.json``: nothing ``--resume`` could continue), and ``out`` itself if this run created it
    and it is empty again."""
    work = out / RESUME_DIR
    if work.is_dir() and not (work / "state.json").is_file():
        shutil.rmtree(work, ignore_errors=True)
    if not existed and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


def _walk(config: PruneConfig, device: torch.device, out: Path | None, resume: bool, overwrite: bool,
          progress: bool, on_block_done: Callable[[int], None] | None, loaded: LoadedModel | None,
          documents: dict[str, tuple[str, ...]]) -> PruneResult:
    """The run: load, calibrate (or reload a resumed run's data), capture, prepare, walk the blocks, report."""
    t_start = time.time()
    spec = config.spec()
    texts = _open_texts(config, documents)
    state = _prepare_out(out, resume, overwrite, config)
    if state is not None and state["config_key"] != config.key():
        raise UserError("--resume with different settings than the interrupted run; repeat its exact options")
    lm, save_dtype = _load_prunable(config, device, loaded)
    model = lm.model
    blocks = find_blocks(model)
    linears, experts = _selected_weights(blocks, config, spec.pattern)
    _check_device_memory(spec.stages, model, {n: w for block in linears + experts for n, w in block.items()}, device)
    max_pos = getattr(text_config(model), "max_position_embeddings", None) or config.seqlen
    seqlen = min(config.seqlen, max_pos)
    if out is not None:   # before --out is cleared: a run its disk cannot hold leaves the earlier output
        result, peak = _disk_need(model, blocks, config.nsamples * seqlen, "dense_stream" in spec.needs(), save_dtype)
        check_free_space(out, result, peak, freed=tree_bytes(out) if state is None else 0)
    _clear_out(out, state is not None)
    ctx = min(config.eval_ctx or seqlen, max_pos)
    work = out / RESUME_DIR if out is not None else None
    if state is None:
        state, tokens, held_out = _start_state(config, texts, lm, seqlen, ctx, device, progress, work)
    else:   # the blocks done are reloaded after the capture (in _block_streams)
        data = torch.load(work / "data.pt")
        tokens, held_out = data["tokens"], data["held_out"]
    del texts   # a large local text is not held through the walk

    run = Run(model=model, blocks=blocks, linears=linears, experts=experts, tokens=tokens, pattern=spec.pattern,
              spec=spec, device=device, batch_size=config.batch_size, seed=config.seed, work=work, progress=progress)
    t0 = time.time()
    streams, not_called, gates = _block_streams(run, state["next_block"], config)
    unseen = _dense_outside_linears(blocks, run.experts, not_called | gates)
    state["calib_seconds"] += time.time() - t0
    for stage in spec.stages:  # model-level passes (on resume: reloading what they saved)
        stage.prepare(run)
    state["prune_seconds"] += run.notes.pop("prepare_seconds", 0.0)
    state.update(run.notes)
    if work is not None and state["next_block"] == 0:
        atomic_json(state, work / "state.json")  # from here on, an interrupted run can --resume
    all_perms = _prune_blocks(run, state, streams, config.recipe, on_block_done)

    if "pruned_ppl" not in state:  # a resumed run that only had its checkpoint left to write skips this
        t0 = time.time()
        bos = lm.tokenizer.bos_token_id if state["texts"]["bos"] else None
        state["pruned_ppl"] = _held_out_ppl(model, held_out, ctx, device, progress, bos, state["texts"]["eval"]) \
            if held_out is not None else None
        state["eval_seconds"] += time.time() - t0
        if work is not None:
            atomic_json(state, work / "state.json")
    compute_dtype = str(next(model.parameters()).dtype)
    model.to(save_dtype)
    report = build_report(config, lm, state, spec.pattern, all_perms, device, compute_dtype, str(save_dtype),
                          resume, time.time() - t_start)
    report["outside_linears"] = unseen
    report["not_called"] = sorted(not_called)
    report["gating_linears"] = sorted(gates)
    if out is not None:
        write_checkpoint(out, model, lm.tokenizer, report, all_perms, config)
        shutil.rmtree(out / RESUME_DIR, ignore_errors=True)
    return PruneResult(report=report, model=model, tokenizer=lm.tokenizer)


def _check_device_memory(stages: list, model: torch.nn.Module, weights: dict, device: torch.device) -> None:
    """Refuse, before any data is read, a run with a stage that holds more on the CUDA device at once
    than is free there (with 1 GiB to spare): it could only fail later, out of memory."""
    if device.type != "cuda":
        return
    for stage in stages:
        extra = stage.device_bytes(weights)
        if extra and not fits_on_device(model, device, extra):
            free = torch.cuda.mem_get_info(indexed_cuda(device))[0]
            raise UserError(f"the '{stage.name}' {stage.kind} stage holds the whole model on {device} and at least "
                            f"{size_text(extra)} more at once (with 1 GiB to spare), and {size_text(free)} are free "
                            f"there; {stage.smaller}, or run on --device cpu")


def _disk_need(model: torch.nn.Module, blocks: Blocks, tokens: int, dense_stream: bool,
               save_dtype: torch.dtype) -> tuple[int, int]:
    """About the bytes a run writes in ``--out``: the checkpoint it ends with (every parameter in
    ``save_dtype``), and its peak, with the per-block checkpoints (in the compute dtype) and two
    copies of the calibration activations between blocks (per stream) still there."""
    result = sum(p.numel() for p in model.parameters()) * torch.finfo(save_dtype).bits // 8
    block_files = tensor_bytes(blocks.layers.parameters())
    embed = model.get_input_embeddings()
    width = getattr(text_config(model), "hidden_size", None) or (embed.weight.shape[1] if embed is not None else 0)
    compute = next(model.parameters()).element_size()
    activations = 2 * tokens * width * compute * (2 if dense_stream else 1)
    return result, result + block_files + activations


def _load_prunable(config: PruneConfig, device: torch.device, loaded: LoadedModel | None
                   ) -> tuple[LoadedModel, torch.dtype]:
    """The model to prune (``loaded`` or ``config.model``), in its compute dtype for ``device``, and the
    dtype its checkpoint is saved in; an exported (already compressed) checkpoint is refused."""
    lm = loaded or load_model(config.model, config.dtype, full_precision=True)
    linears_from_conv1d(lm.model)   # a caller's own GPT-2-style model: its Conv1D layers as nn.Linear
    save_dtype = lm.save_dtype or lm.model.dtype
    upcast_for_cpu(lm.model, config.dtype, device)  # the checkpoint keeps save_dtype
    if any(isinstance(m, SparseLinear) for m in lm.model.modules()):
        raise UserError("this model is an exported checkpoint (compressed N:M layers); prune its dense original, "
                        "or the pruned checkpoint it was exported from, instead")
    return lm, save_dtype


def _start_state(config: PruneConfig, texts_in: _Texts, lm: LoadedModel, seqlen: int, ctx: int,
                 device: torch.device, progress: bool, work: Path | None) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """A new run: its calibration windows and held-out tokens (saved for ``--resume``), the dense
    model's held-out perplexity, and the state every checkpoint updates."""
    t0 = time.time()
    tokens, held_out, texts = _texts(config, texts_in, lm.tokenizer, seqlen, ctx)
    calib_seconds = time.time() - t0
    if work is not None:  # created only once all inputs are known to be good
        work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    bos = lm.tokenizer.bos_token_id if texts["bos"] else None
    dense_ppl = _held_out_ppl(lm.model, held_out, ctx, device, progress, bos, texts["eval"]) \
        if held_out is not None else None
    if held_out is not None:
        texts["eval"]["tokens_scored"] = scored_tokens(held_out.numel(), ctx, bos)
    state = {"config_key": config.key(), "config": asdict(config), "next_block": 0, "layers": [],
             "dense_ppl": dense_ppl, "calib_seconds": calib_seconds, "eval_seconds": time.time() - t0,
             "prune_seconds": 0.0, "seqlen": seqlen, "eval_ctx": ctx, "perm_blocks": [], "texts": texts,
             "eval_tokens": None if held_out is None else int(held_out.numel())}
    if work is not None:
        atomic_save({"tokens": tokens, "held_out": held_out}, work / "data.pt")
    return state, tokens, held_out


@dataclass
class _Streams:
    """What passes from block to block: the next block's inputs from the pruned blocks and, when a stage
    fits to the unpruned model (``dense_stream``), from the dense blocks, with the dense blocks' own
    shared state (keys and values a later block reuses)."""

    hidden: torch.Tensor | None
    dense_hidden: torch.Tensor | None = None
    dense_captured: CapturedInputs | None = None


def _block_streams(run: Run, start: int, config: PruneConfig) -> tuple[_Streams, dict, dict]:
    """Capture block 0's inputs, trace one window through the blocks (:func:`_trace_calls`), and on a
    resume reload the blocks done and the inputs of block ``start``. Returns the streams, and the
    linears not called and kept dense as gates."""
    stream = "dense_stream" in run.spec.needs()
    run.captured = capture_block_inputs(run.model, run.blocks, run.tokens, run.device, config.batch_size)
    dense_captured = run.captured.with_own_states() if stream else None
    # one window through the blocks, before a resume refills what blocks hand on: the trace's own
    # writes (one window, where the run writes batches) must not be what the next block reads
    not_called, gates = _trace_calls(run, run.captured.hidden[:1], config)
    hidden = run.captured.hidden if start == 0 else _resume_blocks(run, start, dense_captured)
    run.captured.hidden = None
    if dense_captured is not None:
        dense_captured.hidden = None
    dense_hidden = None
    if stream and start < len(run.blocks):
        dense_hidden = hidden.clone() if start == 0 else torch.load(run.work / f"dense_hidden_{start}.pt").to(run.device)
    return _Streams(hidden, dense_hidden, dense_captured), not_called, gates


def _resume_blocks(run: Run, start: int, dense_captured: CapturedInputs | None) -> torch.Tensor | None:
    """Reload the ``start`` blocks an interrupted run finished and return block ``start``'s inputs
    from its checkpoint (None when every block is done). The blocks' keyword arguments were just
    recaptured; state that blocks hand later blocks is refilled by running the blocks done: the
    dense ones first (for the dense stream), then the pruned ones."""
    done = Blocks(run.blocks.name, run.blocks.layers[:start])
    last = start == len(run.blocks)
    hidden = None if last else torch.load(run.work / f"hidden_{start}.pt").to(run.device)
    shared = run.captured.holds_shared_state() and not last
    if shared and dense_captured is not None:
        run_blocks(done, run.captured.hidden, dense_captured, run.device, run.batch_size)
    for i in range(start):
        run.blocks.layers[i].load_state_dict(load_file(str(run.work / f"block_{i}.safetensors")))
    if shared:
        run_blocks(done, run.captured.hidden, run.captured, run.device, run.batch_size)
    return hidden


def _prune_blocks(run: Run, state: dict, streams: _Streams, recipe: str,
                  on_block_done: Callable[[int], None] | None) -> dict[str, torch.Tensor]:
    """Blocks ``state["next_block"]`` on, one at a time on the device: the stages, the pruned block's
    outputs as the next block's inputs, a checkpoint. Returns every block's index maps (a resumed
    run's earlier ones reloaded)."""
    start, blocks = state["next_block"], run.blocks
    all_perms: dict[str, torch.Tensor] = {}
    if run.work is not None:
        for j in range(start):
            if (run.work / f"perms_{j}.safetensors").is_file():
                all_perms.update(load_index_maps(run.work / f"perms_{j}.safetensors"))
    bar = tqdm(range(start, len(blocks)), desc=f"{recipe}: {' → '.join(s.name for s in run.spec.stages)} {run.pattern}",
               disable=not run.progress, initial=start, total=len(blocks))
    run.status = bar.set_postfix_str if run.progress else run.status
    for i in bar:
        t0 = time.time()
        block = blocks.layers[i].to(run.device)
        work_i = BlockWork(index=i, prefix=blocks.prefix(i), block=block, linears=run.linears[i],
                           hidden=streams.hidden, experts=run.experts[i])
        if streams.dense_captured is not None:  # the block is still dense here: its outputs on the dense inputs
            work_i.dense_outputs = run_block(block, streams.dense_hidden, streams.dense_captured, i, run.device,
                                             run.batch_size)
        _run_stages(run, work_i, state)
        streams.hidden = work_i.outputs(run)  # the pruned block's outputs: the next block's inputs
        streams.dense_hidden = work_i.dense_outputs
        perms = work_i.perms
        del work_i
        blocks.layers[i] = block.to("cpu")
        state["prune_seconds"] += time.time() - t0
        state["next_block"] = i + 1
        all_perms.update(perms)
        if run.work is not None:
            last = i + 1 == len(blocks)
            _checkpoint_block(run.work, i, block, perms, None if last else streams.hidden, state,
                              None if last else streams.dense_hidden)
        if on_block_done is not None:
            on_block_done(i)
    streams.hidden = streams.dense_hidden = None
    return all_perms


def _selected_weights(blocks, config: PruneConfig, pattern) -> tuple[list[dict], list[dict]]:
    """Per block, the linears and the experts of fused MoE layers that ``--only`` / ``--skip`` select,
    each checked against the pattern. A weight several blocks share (Zamba2's shared attention
    blocks tie their parameters) is pruned once, in the first block that holds it."""
    linears, experts, seen = [], [], set()
    for prefix, block in blocks.named():
        found = {n: lin for n, lin in block_linears(block, prefix, config.only, config.skip).items()
                 if id(lin.weight) not in seen}
        found_experts = {n: e for n, e in block_experts(block, prefix, config.only, config.skip).items()
                         if _matrix_key(e) not in seen}
        seen.update(id(lin.weight) for lin in found.values())
        seen.update(_matrix_key(e) for e in found_experts.values())
        for name, lin in {**found, **found_experts}.items():
            pattern.check_width(name, lin.in_features)
        linears.append(found)
        experts.append(found_experts)
    if not any(linears) and not any(experts) and not any(weights_outside_linears(b, "") for b in blocks.layers):
        raise UserError(NOTHING_SELECTED)   # (stacked experts, found by tracing the blocks, may still come)
    return linears, experts


def _matrix_key(expert: ExpertWeight) -> tuple[int, int]:
    """One expert matrix, however many blocks tie the parameter that holds it."""
    return id(getattr(expert.owner, expert.param)), expert.index


def _trace_calls(run: Run, hidden: torch.Tensor, config: PruneConfig) -> tuple[dict, dict]:
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
    for i, block in enumerate(run.blocks.layers):
        prefix = run.blocks.prefix(i)
        stacked = stacked_experts(block, prefix, trace)
        for name, e in stacked.items():
            if selected_by_globs(name, config.only, config.skip) and _matrix_key(e) not in seen:
                run.pattern.check_width(name, e.in_features)
                run.experts[i][name] = e
                seen.add(_matrix_key(e))
        gated = gating_linears(run.linears[i], block_experts(block, prefix) | stacked)
        gates.update({n: run.linears[i].pop(n) for n in sorted(gated)})
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


def _dense_outside_linears(blocks, experts: list[dict[str, ExpertWeight]],
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


def _run_stages(run: Run, work: BlockWork, state: dict) -> None:
    """One block: every stage in recipe order, then its report rows."""
    if "dense_weights" in run.spec.needs():
        work.dense = {n: lin.weight.detach().float().clone() for n, lin in work.weights().items()}
    cost = state.setdefault("stage_cost", {})
    for stage in run.spec.stages:
        reset_peak_memory(run.device)
        t0 = time.time()
        stage.apply(run, work)
        entry = cost.setdefault(f"{stage.kind}:{stage.name}", {"seconds": 0.0, "blocks": 0, "peak_mb": 0.0})
        entry["seconds"] += time.time() - t0
        entry["blocks"] += 1
        entry["peak_mb"] = max(entry["peak_mb"], peak_memory_mb(run.device))
    state["layers"].extend(_layer_entries(work, run.pattern))
    if work.report:
        state.setdefault("stage_blocks", []).append({"block": work.index, **work.report})
    if work.perm_info is not None:
        state["perm_blocks"].append({"block": work.index, "perms": work.perm_info["perms"], **work.perm_info["summary"]})


def _checkpoint_block(work: Path, i: int, block: torch.nn.Module, perms: dict, next_hidden: torch.Tensor | None,
                      state: dict, next_dense: torch.Tensor | None = None) -> None:
    """Save block ``i``'s weights, maps and outputs (and the dense stream's), then the state that
    points past it (a resume finds either the old state or all of the new files)."""
    save_file({k: v.contiguous() for k, v in block.state_dict().items()}, str(work / f"block_{i}.safetensors"))
    if perms:
        save_index_maps(perms, work / f"perms_{i}.safetensors")
    if next_hidden is not None:
        atomic_save(next_hidden.cpu(), work / f"hidden_{i + 1}.pt")
    if next_dense is not None:
        atomic_save(next_dense.cpu(), work / f"dense_hidden_{i + 1}.pt")
    atomic_json(state, work / "state.json")
    (work / f"hidden_{i}.pt").unlink(missing_ok=True)
    (work / f"dense_hidden_{i}.pt").unlink(missing_ok=True)


def _layer_entries(work: BlockWork, pattern) -> list[dict]:
    """Report rows of the block's linears and experts: shape, sparsity, N:M in memory order, who shares
    an input (experts: ``"expert": true`` and the calibration tokens routed to them)."""
    rows = []
    weights = work.weights()
    groups = work.groups + work.expert_groups
    group_of = {name: group for group in groups for name in group}
    for group in groups:
        for name in group:
            w = weights[name].weight.data
            perm = work.perms.get(name)
            in_memory = w if perm is None else w[:, perm.to(w.device)]  # the order an N:M kernel stores
            entry = {"name": name, "shape": list(w.shape),
                     "shares_input_with": [n for n in group_of[name] if n != name],
                     "sparsity": round(sparsity_of(w), 6),
                     "nm_ok": satisfies_nm(in_memory, pattern.n, pattern.m) if pattern.is_nm else None}
            if perm is not None:
                entry["perm_strength"] = round(strength(perm), 4)
            if name in work.experts:
                stats = work.stats.get(name)
                entry.update(expert=True, routed_tokens=None if stats is None else stats.tokens)
            rows.append(entry)
    return rows
