"""What an ``eval`` row says of a model beside its scores: its label, the run that pruned it, its sparsity, and
the text it was fitted to (whose perplexity would not be held out)."""
from __future__ import annotations

from pathlib import Path

import torch

from shuffleprune.blocks import block_experts, block_linears, find_blocks
from shuffleprune.errors import UserError
from shuffleprune.models import is_embedded
from shuffleprune.placement import weights_readable
from shuffleprune.report import method_label, read_report


def row_label(spec: str | None, seen: set[str], run_model: bool = False) -> str:
    """The row's name: the model's folder or hub id (the embedded default by its name; a ``dst`` or ``finetune``
    run's ``model/``, ``run_model``, as ``RUN/model``), numbered where an earlier row in ``seen`` has it."""
    if is_embedded(spec):
        base = "SmolLM2-135M-Instruct (embedded)"
    else:
        folder = Path(spec)
        base = f"{folder.parent.name}/{folder.name}" if run_model else (folder.name or spec)
    label, k = base, 2
    while label in seen:
        label, k = f"{base} #{k}", k + 1
    seen.add(label)
    return label


def block_sparsity(model: torch.nn.Module) -> float | None:
    """Fraction of exact zeros over the decoder blocks' linear weights and fused experts (None if no
    blocks found)."""
    try:
        blocks = find_blocks(model)
    except UserError:
        return None
    zeros = total = 0
    for prefix, block in blocks.named():
        for lin in {**block_linears(block, prefix), **block_experts(block, prefix)}.values():
            with weights_readable(getattr(lin, "owner", lin)):   # an expert's: its experts module's
                zeros += int((lin.weight == 0).sum())
                total += lin.weight.numel()
    return round(zeros / total, 6) if total else None


def prune_report(path: str) -> dict | None:
    """The prune report beside a model (a pruned or exported checkpoint), if there is a readable one."""
    report = Path(path) / "prune_report.json"
    if not report.is_file():
        return None
    try:
        return read_report(report)
    except UserError:
        return None


def training_run(path: str) -> dict | None:
    """The report of the ``dst`` or ``finetune`` run whose ``model/`` ``path`` is, if there is a readable one."""
    run = Path(path).parent / "dst_report.json"
    if Path(path).name != "model" or not run.is_file():
        return None
    try:
        return read_report(run)
    except UserError:
        return None


def prune_summary(report: dict | None, run: dict | None = None) -> str | None:
    """:func:`~shuffleprune.report.method_label` of a prune report (None without one), ``+ finetune N steps`` for
    the ``model/`` of a ``finetune`` run (``run``: its :func:`training_run` report)."""
    if report is None:
        return None
    tuned = run is not None and isinstance(run.get("train"), dict) and run["train"].get("init") is not None
    return method_label(report) + (f" + finetune {run['train']['steps']} steps" if tuned else "")


def fitted_on(report: dict | None, run: dict | None = None) -> dict | None:
    """What a checkpoint was fitted on, for its results row: the prune run's calibration (text, windows, window
    length, seed) and the ``dst`` or ``finetune`` run's training (text, steps, batch, sequence length, learning
    rate, seed); None for a model neither made."""
    fitted = {}
    if report is not None:
        fitted["calibration"] = {k: report["calib"].get(k) for k in ("source", "nsamples", "seqlen", "seed")}
    train = run.get("train") if run is not None else None
    if isinstance(train, dict):
        fitted["training"] = {k: train.get(k) for k in ("data", "steps", "batch_size", "seq_len", "lr", "seed")}
    return fitted or None


def fitted_texts(report: dict | None, run: dict | None = None) -> list[str]:
    """The texts a checkpoint was fitted to: its prune report's calibration text, and the training text of the
    ``dst`` or ``finetune`` run (``run``: its :func:`training_run` report) whose ``model/`` it is."""
    texts = [report["calib"]["source"]] if report is not None else []
    try:
        texts += [run["train"]["data"]] if run is not None else []
    except (KeyError, TypeError):
        pass
    return texts
