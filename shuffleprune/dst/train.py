"""``shuffleprune dst``: causal-LM training from scratch around :class:`dst.DynamicSparsifier`.

A model built from a transformers config (``--arch gpt2`` with ``--config-kw n_layer=12 …``, or a
config dir / hub id), a tokenizer (the embedded model's by default), a text source (``wikitext103``
online as the papers; ``wiki`` / ``brown`` / files offline), AdamW with cosine LR and warmup, run
through ``accelerate`` (``accelerate launch --multi_gpu -m shuffleprune.cli dst …`` for several
GPUs; on CPU ``ACCELERATE_USE_CPU=true torchrun --nproc_per_node N -m shuffleprune.cli dst …``).

Batches are a pure function of (seed, step): ``batch_size`` windows at seeded random offsets of the
tokenized train split. With several processes that is the global batch: process ``r`` of ``W``
trains on windows ``r, r+W, …`` and DDP averages the gradients, so a run on W processes follows the
single-process run (up to float summation order). A checkpoint (model, optimizer, scheduler,
sparsifier with masks and permutations, RNG state, logs) is written atomically every
``checkpoint_every`` steps; ``--resume`` continues from it and reproduces the uninterrupted run.
"""
from __future__ import annotations

import json
import os
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from shuffleprune.dst.card import model_card
from shuffleprune.dst.config import DSTConfig, TrainConfig
from shuffleprune.dst.fresh_model import build_model, model_config, special_token_id, training_tokenizer
from shuffleprune.dst.pruned_start import check_start, copy_run_files, pruned_start, round_to
from shuffleprune.dst.layers import weight_of
from shuffleprune.dst.sparsifier import DynamicSparsifier
from shuffleprune.dst.structures import diagonal_offsets, pool
from shuffleprune.errors import UserError, given_path
from shuffleprune.outdir import (atomic_write, check_writable, clear_dir, held_alone, refuse_clearing_inputs, size_text,
                                 space_errors, written_beside)
from shuffleprune.quiet import library_progress_bars
from shuffleprune.runtime.determinism import deterministic_algorithms
from shuffleprune.runtime.memory import free_memory_bytes, logits_bytes, memory_errors, tensor_bytes
from shuffleprune.tokenizer_files import save_tokenizer

CHECKPOINT = "checkpoint.pt"
REPORT = "dst_report.json"


def _batch(stream: torch.Tensor, cfg: TrainConfig, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    """Process ``rank``'s share (windows ``rank::world``) of the global batch of ``step``."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, stream.numel() - cfg.seq_len, (cfg.batch_size,), generator=gen)
    return torch.stack([stream[s:s + cfg.seq_len] for s in starts[rank::world].tolist()])


def _state_fingerprint(model: torch.nn.Module, sp: DynamicSparsifier) -> torch.Tensor:
    """Position-weighted sums of every parameter, mask and permutation: equal on all processes iff
    (up to coincidence) they hold the same model and the same sparse structure."""
    def fp(t: torch.Tensor) -> torch.Tensor:
        t = t.detach().double().flatten().cpu()
        return torch.stack([t.sum(), (t * torch.arange(1, t.numel() + 1, dtype=torch.float64).sqrt()).sum()])
    parts = [fp(p) for p in model.parameters()] + [fp(m) for m in sp.masks.values()]
    parts += [fp(p.hard if p.hard is not None else torch.cat(list(p.soft.blocks))) for p in sp.perms.values()]
    return torch.stack(parts) if parts else torch.zeros(1, 2, dtype=torch.float64)


def _structure_report(sp: DynamicSparsifier) -> dict:
    """Final density per layer, checked against the method's structure."""
    out = {}
    for name, mask in sp.masks.items():
        w = weight_of(sp.layers[name])
        zeros_ok = not bool(w[~mask.to(w.device)].any())
        mask = sp.structure_mask(name)  # the structure's column order (an expert with a map: the map's)
        entry = {"density": round(float(mask.float().mean()), 6), "target": round(sp.densities[name], 6),
                 "pruned_weights_zero": zeros_ok}
        if sp.config.method == "srigl":
            fan = mask.sum(1)
            entry["constant_fan_in"] = bool((fan[fan > 0] == fan[fan > 0][0]).all()) if (fan > 0).any() else True
            entry["ablated_neurons"] = int((fan == 0).sum())
        if sp.config.method == "diag":
            offsets = diagonal_offsets(*mask.shape)
            per_diag = torch.zeros(mask.shape[1], dtype=torch.long).scatter_add_(0, offsets.flatten(), mask.long().flatten())
            entry["whole_diagonals"] = bool(((per_diag == 0) | (per_diag == mask.shape[0])).all())
            entry["diagonals"] = int((per_diag > 0).sum())
        if sp.config.method == "nm":
            n, m = sp.config.nm()
            entry["n_of_m"] = bool((mask.reshape(mask.shape[0], -1, m).sum(-1) == n).all())
        if sp.config.method in ("dsb", "pixelfly"):
            blocks = pool(mask.float(), sp.config.block) / sp.config.block ** 2  # fraction of each block kept
            entry["whole_blocks"] = bool(((blocks == 0) | (blocks == 1)).all())
            if name in sp.lowrank_params:
                entry["lowrank_params"] = sp.lowrank_params[name]
        out[name] = entry
    return out


def _check_out(cfg: TrainConfig, out: Path, resume: bool, overwrite: bool, accelerator) -> None:
    """Refuse an ``out`` that cannot be used (it is cleared by :func:`_clear_out` once the data,
    tokenizer and model are ready, so bad input never costs an earlier run's output)."""
    if cfg.batch_size % accelerator.num_processes:
        raise UserError(f"--batch-size {cfg.batch_size} is the global batch: use a multiple of the "
                        f"{accelerator.num_processes} processes")
    check_writable(out, "--out")
    if resume and not (out / CHECKPOINT).is_file():
        raise UserError(f"nothing to resume in '{out}': no {CHECKPOINT}")
    if not resume and out.exists() and any(out.iterdir()):
        refuse_clearing_inputs(out, [cfg.data, cfg.arch, cfg.tokenizer])  # the texts, a config dir, a tokenizer dir
        if not overwrite:
            raise UserError(f"output dir '{out}' is not empty; use --resume, --overwrite or another --out")


def _clear_out(out: Path, resume: bool, accelerator) -> None:
    """Empty ``out`` (main process) for a fresh run, then make sure it exists."""
    accelerator.wait_for_everyone()  # every process has looked at `out` before the main one clears it
    if accelerator.is_main_process:
        if not resume and out.exists():
            clear_dir(out)
        out.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()  # no process writes into `out` before it is cleared


def _token_streams(cfg: TrainConfig, accelerator) -> tuple[object, torch.Tensor, torch.Tensor]:
    """The tokenizer, and the training and held-out texts as token streams."""
    from shuffleprune.calib import get_source
    from shuffleprune.calib.documents import rendered
    from shuffleprune.calib.sampling import encode

    with accelerator.main_process_first():  # downloads, and a bpe:N tokenizer's training, happen once
        source = get_source(cfg.data, shared=True)   # a local file: every 10th document held out
        train_docs = source.documents("train")
        tokenizer = training_tokenizer(cfg.tokenizer, train_docs, source.name, cfg.trust_remote_code)
    train_stream = encode(tokenizer, source.joined(rendered(train_docs, tokenizer)))
    test_stream = encode(tokenizer, source.joined(rendered(source.documents("test"), tokenizer)))
    if cfg.eval_tokens:
        test_stream = test_stream[:cfg.eval_tokens]
    if train_stream.numel() <= cfg.seq_len or test_stream.numel() < cfg.seq_len:
        raise UserError(_too_short(cfg, train_stream.numel(), test_stream.numel()))
    return tokenizer, train_stream, test_stream


def _text_use(cfg: TrainConfig, train_tokens: int, test_tokens: int) -> dict:
    """How much text the run trains on and how often it reads it (``passes``: the steps' windows over its
    training tokens); a warning where that text is a dataset's first rows only (the 20 000 read when no
    rows are named) and the steps read them more than once."""
    from shuffleprune.calib.hub_data import HUB_DATASET_DOCS, hub_dataset_id

    passes = cfg.steps * cfg.batch_size * cfg.seq_len / train_tokens
    hub = hub_dataset_id(cfg.data)
    if hub is not None and hub.stop is None and passes > 1 and is_main_process():
        warnings.warn(f"'{cfg.data}': at most its first {HUB_DATASET_DOCS} rows are read ({train_tokens} tokens to train "
                      f"on), and {cfg.steps} steps read them {passes:.1f} times; to train on more text, name more rows: "
                      f"{hub.dataset}@{hub.split or 'SPLIT'}[:ROWS]", stacklevel=3)
    return {"train_tokens": train_tokens, "heldout_tokens": test_tokens, "passes": round(passes, 3)}


def _too_short(cfg: TrainConfig, train_tokens: int, test_tokens: int) -> str:
    """The one-line error for a text whose parts cannot hold a window of ``--seq-len``: their token counts and the fix."""
    fits = min(train_tokens - 1, test_tokens)   # training windows take seq-len + 1 tokens, held-out ones seq-len
    fix = f"give a longer text or --seq-len {fits} or less" if fits >= 8 else "give a longer text"
    return f"'{cfg.data}' is too short for --seq-len {cfg.seq_len}: {train_tokens} tokens to train on, {test_tokens} held out; {fix}"


def _optimizer(model: torch.nn.Module, cfg: TrainConfig) -> tuple[torch.optim.Optimizer, object]:
    """AdamW (no weight decay on vectors) and its cosine schedule with warmup."""
    from transformers import get_cosine_schedule_with_warmup

    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    return optimizer, get_cosine_schedule_with_warmup(optimizer, cfg.warmup, cfg.steps)


@dataclass
class _Trainer:
    """What a checkpoint holds and restores: the settings, the model, its optimizer and schedule,
    the sparsifier, and the run's counters and logs (``state``)."""

    cfg: TrainConfig
    dst: DSTConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    sparsifier: DynamicSparsifier
    state: dict = field(default_factory=lambda: {"step": 0, "log": [], "evals": [], "train_seconds": 0.0})

    def restore(self, ckpt: Path) -> None:
        """Continue from ``ckpt``: weights, optimizer, schedule, masks and maps, random state, counters."""
        saved = torch.load(ckpt, map_location="cpu", weights_only=False)   # copied onto each process's device below
        saved_cfg = {"trust_remote_code": False, "init": None, **saved["train_config"]}   # (checkpoints from before those fields)
        if saved_cfg != asdict(self.cfg) or saved["dst_config"] != asdict(self.dst):
            raise UserError("--resume with different settings than the checkpointed run; repeat its exact options")
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.sparsifier.load_state_dict(saved["sparsifier"])
        torch.set_rng_state(saved["rng"])
        if saved.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda_rng"])
        self.state = saved["state"]

    def save(self, ckpt: Path, model: torch.nn.Module) -> None:
        """Write the checkpoint atomically; ``model`` is the unwrapped model."""
        tmp = ckpt.with_suffix(".tmp")
        try:
            torch.save({"train_config": asdict(self.cfg), "dst_config": asdict(self.dst),
                        "model": model.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "scheduler": self.scheduler.state_dict(), "sparsifier": self.sparsifier.state_dict(),
                        "rng": torch.get_rng_state(),
                        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                        "state": self.state}, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)   # a part written (a full disk): the last whole checkpoint stays
            raise
        os.replace(tmp, ckpt)


def _report(run: _Trainer, final_ppl: float, device: torch.device, processes: int, ranks_agree: bool | None,
            text_use: dict) -> dict:
    """``dst_report.json``: settings, the text used, loss and perplexity curves, structure, maps, mask updates, cost."""
    from shuffleprune.runtime.facts import versions
    from shuffleprune.runtime.memory import peak_rss_mb

    sp = run.sparsifier
    return {
        "train": asdict(run.cfg), "dst": asdict(run.dst), "text": text_use, "final_ppl": final_ppl,
        "evals": run.state["evals"],
        "loss_curve": run.state["log"], "train_seconds": round(run.state["train_seconds"], 2),
        "peak_rss_mb": round(peak_rss_mb(), 1), "density": round(sp.density(), 6),
        "layers": _structure_report(sp) if sp.masks else {},
        "permutations": {n: {"hardened_at": p.hardened_at, "penalty_curve": [round(v, 4) for v in p.penalty_curve],
                             "strength": None if p.hard is None else round(s, 4)}
                         for (n, p), s in zip(sp.perms.items(), sp.permutation_strength().values())},
        "mask_updates": sp.history, "versions": versions("accelerate"), "device": str(device),
        "processes": processes, "ranks_agree": ranks_agree,
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
    }


def _write_model(out: Path, model: torch.nn.Module, sp: DynamicSparsifier, tokenizer, report: dict,
                 init: str | None = None) -> None:
    """``out/model``: the trained model with its weights in their inputs' own column order (as
    ``prune --perm`` stores them: any client computes it), the tokenizer, a model card and the index
    maps (the order N:M holds in, for ``export``); and ``out/dst_report.json``. A fine-tuned checkpoint
    (``init``) keeps the pruned one's index maps and prune report, so ``export`` and ``eval`` read it as
    they read that one. Each appears whole or not at all (written beside, then renamed into place)."""
    from shuffleprune.perm.linear import INDEX_MAPS, save_index_maps

    with written_beside(out / "model") as tmp:
        model.save_pretrained(tmp, state_dict=sp.checkpoint_state_dict(model))
        save_tokenizer(tokenizer, tmp)
        if init is not None:
            report["carried"] = copy_run_files(init, tmp)
        (tmp / "README.md").write_text(model_card(report))
        hard = {n: p.hard for n, p in sp.perms.items() if p.hard is not None}
        if hard:
            save_index_maps(hard, tmp / INDEX_MAPS)
    atomic_write(out / REPORT, lambda path: path.write_text(json.dumps(report, indent=1)))


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: object,
                sparsifier: DynamicSparsifier, accelerator, cfg: TrainConfig, batch: torch.Tensor) -> torch.Tensor:
    """One optimisation step on ``batch`` (the next-token loss, no KV cache to build), then the
    sparsifier's (masks, permutations) and the schedule's; returns the loss."""
    loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    accelerator.backward(loss)
    if cfg.grad_clip:
        accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    sparsifier.step()
    scheduler.step()
    optimizer.zero_grad()  # after sparsifier.step(): RigL reads the dense gradients at update steps
    return loss


def _ranks_agree(accelerator, model: torch.nn.Module, sparsifier: DynamicSparsifier) -> bool:
    """Whether every process ended with the same weights, masks and permutations (DDP syncs the
    gradients; the rest must have followed); says so on the main process when not."""
    every = accelerator.gather(_state_fingerprint(model, sparsifier).to(accelerator.device).unsqueeze(0))
    agree = bool((every == every[:1]).all())
    if not agree and accelerator.is_main_process:
        print("warning: the processes ended with different weights, masks or permutations", flush=True)
    return agree


def train(cfg: TrainConfig, dst: DSTConfig, out: Path | str, resume: bool = False, overwrite: bool = False,
          progress: bool = True, stop_after: int | None = None, deterministic: bool = False) -> dict:
    """Train; returns the report (also written to ``out/dst_report.json``). ``stop_after`` ends the
    run after that many steps as if killed (tests). ``deterministic``: PyTorch's deterministic algorithms
    (:func:`~shuffleprune.runtime.determinism.deterministic_algorithms`), so that a GPU run repeats bit for bit; a
    resumed run may set it otherwise. A write that runs out of disk space is a one-line error."""
    out = given_path(out, "--out")
    existed = out.exists()
    checkpointed = lambda: (out / CHECKPOINT).exists()
    resumable = lambda: "; then the same command with --resume continues it" if checkpointed() else ""
    strict = deterministic_algorithms(deterministic, hint=lambda: (
        " and with --resume, which continues from the last checkpoint" if checkpointed() else ""))
    # the main process holds --out: a second run on it is refused, touching nothing
    with held_alone(out) if is_main_process() else nullcontext():
        try:
            with space_errors(out, "--out", hint=resumable), memory_errors(lambda: "lower --batch-size or --seq-len, or "
                                                                             "train a smaller model" + resumable()), \
                    strict, _process_group_ended():
                return _train(cfg, dst, out, resume, overwrite, progress, stop_after)
        except BaseException:
            if not existed and out.is_dir() and not any(out.iterdir()):
                out.rmdir()   # made by this run, which wrote nothing in it
            raise


def is_main_process() -> bool:
    """Whether this is a run's main process (rank 0 under torchrun / accelerate launch / an MPI launcher, or
    the only one), told by the launcher's environment as accelerate reads it, without a process group: there
    is none before a run starts it, nor after it ends it."""
    from accelerate.utils import get_cpu_distributed_information

    return get_cpu_distributed_information().rank == 0


@contextmanager
def _process_group_ended():
    """End the process group the run's ``Accelerator`` started (under torchrun / accelerate launch) once the
    run succeeds: every process waits for the others, then destroys it while the interpreter is whole.
    A gloo process that exits with its group alive can abort in the interpreter's teardown (SIGABRT: its
    worker threads release tensors without the GIL; pytorch/pytorch#179291): a known cause of the abort
    one CI run's rank 1 met, not a confirmed one. A group that existed before the run is the caller's and
    is left alone."""
    import torch.distributed as dist

    from accelerate.state import AcceleratorState

    started = dist.is_available() and dist.is_initialized()
    yield
    if not started and dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
        AcceleratorState._reset_state(reset_partial_state=True)   # a later run in this process starts its own


def training_step_bytes(model: torch.nn.Module, tokens: int, device: torch.device) -> int:
    """What one training step of ``tokens`` tokens (this process's windows × ``--seq-len``) holds on ``device``
    at least, besides what is there before the model moves: the logits, their log-softmax and its gradient,
    and the weights' gradients and AdamW's two moments (on a GPU, the weights too). A lower bound, activations
    not counted: the first steps of runs on this CPU grew by 1.3–2.0× it where the vocabulary is large
    (SmolLM2's 49 152 tokens), 10–16× where it is small and activations dominate (``scripts/check_dst_memory.py``)."""
    return logits_bytes(model, tokens) + tensor_bytes(model.parameters()) * (4 if device.type == "cuda" else 3)


def _check_training_memory(model: torch.nn.Module, tokens: int, device: torch.device) -> None:
    """Refuse, before the model moves to ``device`` and before anything is written, a run whose first step
    cannot fit there (:func:`training_step_bytes` against the memory free there)."""
    need = training_step_bytes(model, tokens, device)
    free = free_memory_bytes(device)
    if free is not None and need > free:
        raise UserError(f"a training step of {tokens} tokens on this model needs at least {size_text(need)} on {device} "
                        f"(logits, gradients and optimizer state), and {size_text(free)} are free there; lower "
                        "--batch-size or --seq-len, or train a smaller model")


def _train(cfg: TrainConfig, dst: DSTConfig, out: Path, resume: bool, overwrite: bool, progress: bool,
           stop_after: int | None) -> dict:
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    from shuffleprune.evaluation.perplexity import perplexity

    ckpt = out / CHECKPOINT
    accelerator = Accelerator()
    rank, world = accelerator.process_index, accelerator.num_processes
    cfg.check()
    if dst.method == "keep" and cfg.init is None:
        raise UserError("method 'keep' holds a pruned model's zeros: it fine-tunes a pruned checkpoint (shuffleprune "
                        "finetune); dst trains a model from scratch, which has none")
    if cfg.init is not None and dst.method != "keep":
        raise UserError(f"a pruned checkpoint is fine-tuned with method 'keep', which holds its zeros, not "
                        f"'{dst.method}'")
    dst.check()   # both before `out` is touched
    if cfg.init is not None:
        check_start(cfg.init)
    config = None if cfg.init is not None else model_config(cfg)   # an unknown architecture fails before the text is read
    _check_out(cfg, out, resume, overwrite, accelerator)
    with library_progress_bars(progress):   # the text's download and the start's weights: no bars when quiet
        tokenizer, train_stream, test_stream = _token_streams(cfg, accelerator)
        if cfg.init is not None:
            model, save_dtype = pruned_start(cfg, tokenizer)
        else:
            model, save_dtype = build_model(cfg, len(tokenizer), special_token_id(tokenizer), config), None
    text_use = _text_use(cfg, train_stream.numel(), test_stream.numel())
    _check_training_memory(model, -(-cfg.batch_size // world) * cfg.seq_len, accelerator.device)
    model = model.to(accelerator.device)
    sparsifier = DynamicSparsifier(dst)   # its soft permutations made beside the layers, on the device
    sparsifier.prepare(model)  # before the optimizer: pixelfly adds low-rank parameters
    if cfg.init is not None and not sparsifier.masks:
        raise UserError(f"'{cfg.init}' has no zeros in its linear layers to hold: prune it first "
                        "(shuffleprune prune MODEL --out PRUNED), then fine-tune PRUNED")
    optimizer, scheduler = _optimizer(model, cfg)
    sparsifier.optimizer = optimizer
    run = _Trainer(cfg, dst, model, optimizer, scheduler, sparsifier)
    if resume:
        run.restore(ckpt)
    state = run.state
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    _clear_out(out, resume, accelerator)
    device = accelerator.device

    def evaluate() -> float:
        model.eval()
        ppl = perplexity(accelerator.unwrap_model(model), test_stream.unsqueeze(0), cfg.seq_len, device)
        model.train()
        return ppl

    if cfg.init is not None and not state["evals"]:   # the pruned checkpoint's own perplexity, to start from
        state["evals"].append({"step": 0, "ppl": evaluate()})
    model.train()
    bar = tqdm(range(state["step"], cfg.steps), initial=state["step"], total=cfg.steps,
               desc="finetune" if cfg.init is not None else f"dst {dst.method}",
               disable=not progress or not accelerator.is_main_process)
    for step in bar:
        t0 = time.time()
        loss = _train_step(model, optimizer, scheduler, sparsifier, accelerator, cfg,
                           _batch(train_stream, cfg, step, rank, world).to(device))
        state["train_seconds"] += time.time() - t0
        state["step"] = step + 1
        value = float(accelerator.reduce(loss.detach(), "mean") if world > 1 else loss.detach())
        state["log"].append({"step": step + 1, "loss": round(value, 5)})
        bar.set_postfix_str(f"loss {value:.3f}")
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            state["evals"].append({"step": step + 1, "ppl": evaluate()})
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and accelerator.is_main_process:
            run.save(ckpt, accelerator.unwrap_model(model))
        if stop_after is not None and step + 1 >= stop_after:
            return {"stopped_at": step + 1}
    sparsifier.finalize()  # the model as it is saved: permutations still soft hardened, diag's mask baked
    unwrapped = accelerator.unwrap_model(model)
    if save_dtype is not None:   # a fine-tuned checkpoint is scored with the values its own dtype saves (in float32,
        round_to(unwrapped, save_dtype)   # as eval scores a 16-bit model on a CPU), and saved in that dtype below
    final_ppl = evaluate()
    state["evals"].append({"step": cfg.steps, "ppl": final_ppl})
    ranks_agree = _ranks_agree(accelerator, unwrapped, sparsifier) if world > 1 else None
    report = _report(run, final_ppl, device, world, ranks_agree, text_use)
    if save_dtype is not None:
        unwrapped.to(save_dtype)
    if accelerator.is_main_process:
        with library_progress_bars(progress):
            _write_model(out, unwrapped, sparsifier, tokenizer, report, cfg.init)
        run.save(ckpt, unwrapped)
    return report
