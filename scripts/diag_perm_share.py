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
    from shuffleprune.blocks import block_linears, capture_block_inputs, find_blocks
    from shuffleprune.calib import calibration_windows, get_source
    from shuffleprune.masks import Pattern
    from shuffleprune.methods import get_method
    from shuffleprune.models import load_model
    from shuffleprune.perm_learning import cosine_loss
    from shuffleprune.perm_prune import _score, prune_in_permuted_coordinates
    from shuffleprune.perm_search import swap_search
    from shuffleprune.pipeline import run_block
    from shuffleprune.runtime import machine, versions
    from shuffleprune.stats import collect_input_stats, input_groups

    lm = load_model(None)
    blocks = find_blocks(lm.model)
    tokens = calibration_windows(get_source("wiki"), lm.tokenizer, 16, 256, 0)
    dev = torch.device("cpu")
    cap = capture_block_inputs(lm.model, blocks, tokens, dev, 8)
    hidden, wanda, rows = cap.hidden, get_method("wanda"), []
    for idx in range(max(BLOCKS) + 1):
        block = blocks.layers[idx]
        linears = block_linears(block, f"{blocks.name}.{idx}")
        with collect_input_stats(linears, False) as stats:
            target = run_block(block, hidden, cap, idx, dev, 8)
        if idx in BLOCKS:
            groups, orig = input_groups(stats), {n: l.weight.data.clone() for n, l in linears.items()}
            row = {"block": idx}
            for label in ("none", "group", "linear"):
                units = groups if label != "linear" else [[n] for g in groups for n in g]
                for unit in units:
                    perm = None if label == "none" else swap_search(
                        torch.cat([_score(orig[n], stats[n]) for n in unit]), 2, 4, 64)
                    for n in unit:
                        linears[n].weight.data = (wanda(orig[n], stats[n], Pattern(2, 4)) if perm is None else
                                                  prune_in_permuted_coordinates(wanda, orig[n], stats[n], Pattern(2, 4), perm))
                row[label] = round(float(cosine_loss(target, run_block(block, hidden, cap, idx, dev, 8))), 6)
                for n in linears:
                    linears[n].weight.data = orig[n].clone()
            rows.append(row)
            print(row, flush=True)
        hidden = target  # dense propagation
    out = ROOT / "scripts" / "results" / "perm_share_blocks.json"
    out.write_text(json.dumps({"what": __doc__.strip().splitlines()[0], "calib": {"source": "wiki", "nsamples": 16,
                               "seqlen": 256, "seed": 0}, "pattern": "2:4", "perm_block": 64, "rows": rows,
                               "command": " ".join(["python", *sys.argv]), "machine": machine(),
                               "versions": versions()}, indent=1))


if __name__ == "__main__":
    main()
