"""What an ``eval`` row says of a model beside its scores: its label, the run that pruned it, its sparsity, and
the text it was fitted to (whose perplexity would not be held out)."""
from __future__ import annotations

from pathlib import Path

import torch

from shuffleprune.blocks import block_experts, block_linears, find_blocks
from shuffleprune.errors import UserError
from shuffleprune.models import is_embedded
from shuffleprune.placement import weights_readable
from shuffleprune.report import read_report


def row_label(spec: str | None, path: str, seen: set[str]) -> str:
    """The row's name: the model's folder or hub id (the embedded default by its name), numbered where an earlier
    row in ``seen`` has it."""
    base = "SmolLM2-135M-Instruct (embedded)" if is_embedded(spec) else (Path(spec).name or spec)
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


def prune_summary(report: dict | None) -> str | None:
    """``method pattern`` of a prune report (None without one)."""
    return None if report is None else f"{report['method']} {report['pattern']}"


def fitted_text(path: str, report: dict | None) -> str | None:
    """The text a checkpoint was fitted to: its prune report's calibration text, or the training text
    of the ``dst`` run whose ``model/`` it is."""
    if report is not None:
        return report["calib"]["source"]
    run = Path(path).parent / "dst_report.json"
    if Path(path).name == "model" and run.is_file():
        try:
            return read_report(run)["train"]["data"]
        except (UserError, KeyError, TypeError):
            return None
    return None
