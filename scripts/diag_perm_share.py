"""Diagnostic: one permutation per shared input (group) vs one per linear, with the swap search.

    .venv/bin/python scripts/diag_perm_share.py   # → scripts/results/perm_share_blocks.json

Embedded SmolLM2-135M, 16×256 `wiki` calibration windows (seed 0), blocks fed the *dense* model's
inputs. For blocks 2, 12, 25: block-output ``1 − cos`` after Wanda 2:4 with no permutation, with the
swap search per input group (q/k/v, gate/up share) and per linear.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = (2, 12, 25)


def main() -> None:
    from diag_blocks import dense_blocks
    from shuffleprune.masks import Pattern
    from shuffleprune.prune.methods import get_method
    from shuffleprune.perm.learning import cosine_loss
    from shuffleprune.perm.pruning import _score
    from shuffleprune.prune.stages.prune import prune_in_permuted_coordinates
    from shuffleprune.perm.search import swap_search
    from shuffleprune.block_inputs import run_block
    from shuffleprune.runtime.facts import machine, versions
    from shuffleprune.prune.input_stats import input_groups

    wanda, rows = get_method("wanda"), []
    for b in dense_blocks(16, 256, 0, max(BLOCKS)):
        if b.index not in BLOCKS:
            continue
        linears, stats = b.linears, b.stats
        groups, orig = input_groups(stats), {n: l.weight.data.clone() for n, l in linears.items()}
        row = {"block": b.index}
        for label in ("none", "group", "linear"):
            units = groups if label != "linear" else [[n] for g in groups for n in g]
            for unit in units:
                perm = None if label == "none" else swap_search(
                    torch.cat([_score(orig[n], stats[n].col_norm) for n in unit]), 2, 4, 64)
                for n in unit:
                    linears[n].weight.data = (wanda(orig[n], stats[n], Pattern(2, 4)) if perm is None else
                                              prune_in_permuted_coordinates(wanda, orig[n], stats[n], Pattern(2, 4), perm))
            row[label] = round(float(cosine_loss(b.target, run_block(b.block, b.hidden, b.captured, b.index, b.device, 8))), 6)
            for n in linears:
                linears[n].weight.data = orig[n].clone()
        rows.append(row)
        print(row, flush=True)
    out = ROOT / "scripts" / "results" / "perm_share_blocks.json"
    out.write_text(json.dumps({"what": __doc__.strip().splitlines()[0], "calib": {"source": "wiki", "nsamples": 16,
                               "seqlen": 256, "seed": 0}, "pattern": "2:4", "perm_block": 64, "rows": rows,
                               "command": " ".join(["python", *sys.argv]), "machine": machine(),
                               "versions": versions()}, indent=1))


if __name__ == "__main__":
    main()
