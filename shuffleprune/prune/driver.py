"""The block walk: sequential, block-wise one-shot pruning with error propagation and resume.

The driver knows nothing about methods. It captures block 0's inputs, lets every stage prepare
(model-level passes), then for each decoder block runs the recipe's stages in order, propagates
the pruned block's outputs to the next block and checkpoints (``--resume`` continues
bit-identically). Only the current block sits on the compute device.
"""
from __future__ import annotations

import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from shuffleprune.block_inputs import CapturedInputs, capture_block_inputs, run_block, run_blocks
from shuffleprune.blocks import Blocks, find_blocks, text_config
from shuffleprune.conv1d import linears_from_conv1d
from shuffleprune.deploy.sparse_linear import SparseLinear
from shuffleprune.errors import UserError, given_path
from shuffleprune.evaluation.perplexity import perplexity, scored_tokens
from shuffleprune.masks import satisfies_nm, sparsity_of
from shuffleprune.models import LoadedModel, load_model, local_model_source, refuse_quantized, upcast_for_cpu
from shuffleprune.outdir import check_free_space, held_alone, size_text, space_errors, tree_bytes
from shuffleprune.perm.core import strength
from shuffleprune.placement import held_for_run
from shuffleprune.prune.checkpoint import build_report, write_checkpoint
from shuffleprune.prune.config import PruneConfig
from shuffleprune.prune.run_dir import (activation_bytes, checkpoint_block, clear_out, discard_unresumable, disk_need,
                                        done_index_maps, finish, load_block, load_data, load_inputs, prepare_out, resumable, save_data,
                                        save_state, work_dir)
from shuffleprune.prune.run_texts import RunTexts, open_texts, run_tokens
from shuffleprune.prune.selection import dense_outside_linears, selected_weights, traced_weights
from shuffleprune.prune.stage import BlockWork, Run
from shuffleprune.quiet import library_progress_bars
from shuffleprune.runtime.determinism import deterministic_algorithms
from shuffleprune.runtime.devices import pick_device, tf32_matmuls
from shuffleprune.runtime.memory import (fits_on_device, free_memory_bytes, logits_bytes, memory_errors, peak_memory_mb,
                                         reset_peak_memory, start_run_peak)


@dataclass
class PruneResult:
    report: dict
    model: torch.nn.Module = field(repr=False)
    tokenizer: object = field(repr=False)


def _local_inputs(config: PruneConfig) -> list[str | None]:
    """What the run reads from disk: the model (the embedded GGUF when none is named), the texts and
    earlier index maps (the recipe file was read into ``config`` already)."""
    maps = [entry.get("path") for entry in config.stages]
    return [local_model_source(config.model), config.calib, config.eval_text, *maps]


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
    out = given_path(out, "--out")
    existed = out is not None and out.exists()
    resume_hint = lambda: "; then the same command with --resume continues it" if resumable(out) else ""
    full = nullcontext() if out is None else space_errors(out, "--out", hint=resume_hint)
    strict = deterministic_algorithms(config.deterministic, hint=lambda: (
        " and with --resume, which continues from the last finished block" if resumable(out) else ""))
    short = memory_errors(lambda: "lower --batch-size, --nsamples or --seqlen" + resume_hint())
    with held_alone(out) if out is not None else nullcontext():   # a second run on --out is refused, touching nothing
        try:   # a caller's model is pruned in place and given back where and as it was
            with full, short, held_for_run(loaded.model) if loaded is not None else nullcontext(), \
                    tf32_matmuls(device, config.tf32), strict, library_progress_bars(progress):
                return _walk(config, device, out, resume, overwrite, progress, on_block_done, loaded, documents or {})
        except BaseException:
            if out is not None:
                discard_unresumable(out, existed)
            raise


def _walk(config: PruneConfig, device: torch.device, out: Path | None, resume: bool, overwrite: bool,
          progress: bool, on_block_done: Callable[[int], None] | None, loaded: LoadedModel | None,
          documents: dict[str, tuple[str, ...]]) -> PruneResult:
    """The run: load, calibrate (or reload a resumed run's data), capture, prepare, walk the blocks, report."""
    t_start = time.time()
    spec = config.spec()
    texts = open_texts(config, documents)
    state = prepare_out(out, resume, overwrite, _local_inputs(config))
    if state is not None and state["config_key"] != config.key():
        raise UserError("--resume with different settings than the interrupted run; repeat its exact options")
    lm, save_dtype = _load_prunable(config, device, loaded)
    model = lm.model
    blocks = find_blocks(model)
    linears, experts = selected_weights(blocks, config, spec.pattern)
    _check_device_memory(spec.stages, model, {n: w for block in linears + experts for n, w in block.items()}, device)
    max_pos = getattr(text_config(model), "max_position_embeddings", None) or config.seqlen
    seqlen = min(config.seqlen, max_pos)
    if seqlen < config.seqlen:   # as SparseGPT's and Wanda's loaders: windows of the model's context at most
        warnings.warn(f"--seqlen {config.seqlen} is longer than the model's context ({max_pos} positions): "
                      f"calibration windows of {max_pos} tokens", stacklevel=2)
    dense_stream = "dense_stream" in spec.needs()
    _check_activation_memory(model, config.nsamples, seqlen, dense_stream, device)
    if out is not None:   # before --out is cleared: a run its disk cannot hold leaves the earlier output
        result, peak = disk_need(model, blocks, config.nsamples * seqlen, dense_stream, save_dtype)
        check_free_space(out, result, peak, freed=tree_bytes(out) if state is None else 0)
    clear_out(out, state is not None)
    ctx = min(config.eval_ctx or seqlen, max_pos)
    work = work_dir(out)
    if state is None:
        state, tokens, held_out = _start_state(config, texts, lm, seqlen, ctx, device, progress, work)
    else:   # the blocks done are reloaded after the capture (in _block_streams)
        tokens, held_out = load_data(work)
    del texts   # a large local text is not held through the walk

    run = Run(model=model, blocks=blocks, linears=linears, experts=experts, tokens=tokens, pattern=spec.pattern,
              spec=spec, device=device, batch_size=config.batch_size, seed=config.seed, work=work, progress=progress)
    t0 = time.time()
    streams, not_called, gates = _block_streams(run, state["next_block"], config)
    unseen = dense_outside_linears(blocks, run.experts, not_called | gates)
    state["calib_seconds"] += time.time() - t0
    for stage in spec.stages:  # model-level passes (on resume: reloading what they saved)
        stage.prepare(run)
    state["prune_seconds"] += run.notes.pop("prepare_seconds", 0.0)
    state.update(run.notes)
    if work is not None and state["next_block"] == 0:
        save_state(state, work)  # from here on, an interrupted run can --resume
    all_perms = _prune_blocks(run, state, streams, config.recipe, on_block_done)

    if "pruned_ppl" not in state:  # a resumed run that only had its checkpoint left to write skips this
        t0 = time.time()
        bos = lm.tokenizer.bos_token_id if state["texts"]["bos"] else None
        state["pruned_ppl"] = _held_out_ppl(model, held_out, ctx, device, progress, bos, state["texts"]["eval"]) \
            if held_out is not None else None
        state["eval_seconds"] += time.time() - t0
        if work is not None:
            save_state(state, work)
    compute_dtype = str(next(model.parameters()).dtype)
    model.to(save_dtype)
    report = build_report(config, lm, state, spec.pattern, all_perms, device, compute_dtype, str(save_dtype),
                          resume, time.time() - t_start)
    report["outside_linears"] = unseen
    report["not_called"] = sorted(not_called)
    report["gating_linears"] = sorted(gates)
    if out is not None:
        write_checkpoint(out, model, lm.tokenizer, report, all_perms, config)
        finish(out)
    return PruneResult(report=report, model=model, tokenizer=lm.tokenizer)


def _check_device_memory(stages: list, model: torch.nn.Module, weights: dict, device: torch.device) -> None:
    """Refuse, before any data is read, a run with a stage that holds more on the CUDA device at once
    than is free there (with 1 GiB to spare): it could only fail later, out of memory."""
    if device.type != "cuda":
        return
    for stage in stages:
        extra = stage.device_bytes(weights)
        if extra and not fits_on_device(model, device, extra):
            raise UserError(f"the '{stage.name}' {stage.kind} stage holds the whole model on {device} and at least "
                            f"{size_text(extra)} more at once (with 1 GiB to spare), and "
                            f"{size_text(free_memory_bytes(device))} are free "
                            f"there; {stage.smaller}, or run on --device cpu")


def _check_activation_memory(model: torch.nn.Module, nsamples: int, seqlen: int, dense_stream: bool,
                             device: torch.device) -> None:
    """Refuse, before any text is read, calibration activations larger than the memory free where they are
    held (``device``: CUDA's free memory, the CPU's available memory): the walk could only fail later, or
    push the machine into swap. It holds a block's inputs and outputs per stream (the pruned model's, and the
    dense model's where a stage needs it) and one more such tensor while the capture joins its batches or a
    block's outputs are formed: 3 (5 with the dense stream) times the inputs, where the recipes' measured
    peaks were 3.1–3.3 (5.2–5.3) times. What stages hold besides is not counted."""
    one = activation_bytes(model, nsamples * seqlen)
    need = one * (5 if dense_stream else 3)
    free = free_memory_bytes(device)
    if free is not None and need > free:
        streams = " for the pruned and the dense model" if dense_stream else ""
        raise UserError(f"--nsamples {nsamples} windows of {seqlen} tokens need about {size_text(need)} for the blocks' "
                        f"inputs and outputs{streams} on {device}, and {size_text(free)} are free there; lower "
                        "--nsamples or --seqlen")


def _load_prunable(config: PruneConfig, device: torch.device, loaded: LoadedModel | None
                   ) -> tuple[LoadedModel, torch.dtype]:
    """The model to prune (``loaded`` or ``config.model``), in its compute dtype for ``device``, and the
    dtype its checkpoint is saved in; an exported (already compressed) checkpoint is refused."""
    lm = loaded or load_model(config.model, config.dtype, full_precision=True, trust_remote_code=config.trust_remote_code)
    linears_from_conv1d(lm.model)   # a caller's own GPT-2-style model: its Conv1D layers as nn.Linear
    save_dtype = lm.save_dtype or lm.model.dtype
    upcast_for_cpu(lm.model, config.dtype, device)  # the checkpoint keeps save_dtype
    if any(isinstance(m, SparseLinear) for m in lm.model.modules()):
        raise UserError("this model is an exported checkpoint (compressed N:M layers); prune its dense original, "
                        "or the pruned checkpoint it was exported from, instead")
    return lm, save_dtype


def _start_state(config: PruneConfig, texts_in: RunTexts, lm: LoadedModel, seqlen: int, ctx: int,
                 device: torch.device, progress: bool, work: Path | None) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """A new run: its calibration windows and held-out tokens (saved for ``--resume``), the dense
    model's held-out perplexity, and the state every checkpoint updates."""
    t0 = time.time()
    tokens, held_out, texts = run_tokens(config, texts_in, lm.tokenizer, seqlen, ctx)
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
        save_data(work, tokens, held_out)
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
    """Capture block 0's inputs, trace one window through the blocks (:func:`~shuffleprune.prune.selection.traced_weights`), and on a
    resume reload the blocks done and the inputs of block ``start``. Returns the streams, and the
    linears not called and kept dense as gates."""
    stream = "dense_stream" in run.spec.needs()
    run.captured = capture_block_inputs(run.model, run.blocks, run.tokens, run.device, config.batch_size)
    dense_captured = run.captured.with_own_states() if stream else None
    # one window through the blocks, before a resume refills what blocks hand on: the trace's own
    # writes (one window, where the run writes batches) must not be what the next block reads
    not_called, gates = traced_weights(run, run.captured.hidden[:1], config)
    hidden = run.captured.hidden if start == 0 else _resume_blocks(run, start, dense_captured)
    run.captured.hidden = None
    if dense_captured is not None:
        dense_captured.hidden = None
    dense_hidden = None
    if stream and start < len(run.blocks):
        dense_hidden = hidden.clone() if start == 0 else load_inputs(run.work, start, dense=True).to(run.device)
    return _Streams(hidden, dense_hidden, dense_captured), not_called, gates


def _resume_blocks(run: Run, start: int, dense_captured: CapturedInputs | None) -> torch.Tensor | None:
    """Reload the ``start`` blocks an interrupted run finished and return block ``start``'s inputs
    from its checkpoint (None when every block is done). The blocks' keyword arguments were just
    recaptured; state that blocks hand later blocks is refilled by running the blocks done: the
    dense ones first (for the dense stream), then the pruned ones."""
    done = Blocks(run.blocks.name, run.blocks.layers[:start])
    last = start == len(run.blocks)
    hidden = None if last else load_inputs(run.work, start).to(run.device)
    shared = run.captured.holds_shared_state() and not last
    if shared and dense_captured is not None:
        run_blocks(done, run.captured.hidden, dense_captured, run.device, run.batch_size)
    for i in range(start):
        load_block(run.work, i, run.blocks.layers[i])
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
        all_perms.update(done_index_maps(run.work, start))
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
            checkpoint_block(run.work, i, block, perms, None if last else streams.hidden, state,
                             None if last else streams.dense_hidden)
        if on_block_done is not None:
            on_block_done(i)
    streams.hidden = streams.dense_hidden = None
    return all_perms


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
