"""Diagnostic: does a smaller step size let the learned permutation improve on its search start?

    .venv/bin/python scripts/diag_perm_lr.py   # → scripts/results/perm_lr_blocks.json

Embedded SmolLM2-135M, Wanda 2:4, 32×256 `wiki` calibration windows (seed 0), blocks fed the
*dense* model's inputs. For blocks 2, 12, 25: ``--perm learned --perm-init search`` at several Adam
learning rates and step counts, a quarter of the windows held out (``holdout 0.25``); the block
output ``1 − cos`` on the held-out windows of the identity, the search start, the final hardened
permutation and the best training step's.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = (2, 12, 25)
SETTINGS = [(3e-2, 50), (3e-3, 50), (3e-3, 200), (1e-3, 200), (3e-4, 200)]


def main() -> None:
    from shuffleprune.blocks import block_linears, capture_block_inputs, find_blocks
    from shuffleprune.calib import calibration_windows, get_source
    from shuffleprune.masks import Pattern
    from shuffleprune.models import load_model
    from shuffleprune.perm_prune import PermOptions, block_permutations
    from shuffleprune.pipeline import run_block
    from shuffleprune.runtime import machine, versions
    from shuffleprune.stats import collect_input_stats, input_groups

    lm = load_model(None)
    blocks = find_blocks(lm.model)
    tokens = calibration_windows(get_source("wiki"), lm.tokenizer, 32, 256, 0)
    dev = torch.device("cpu")
    cap = capture_block_inputs(lm.model, blocks, tokens, dev, 8)
    hidden, rows = cap.hidden, []
    base = PermOptions(perm="learned", init="search", holdout=0.25, seed=0)
    for idx in range(max(BLOCKS) + 1):
        block = blocks.layers[idx]
        prefix = f"{blocks.name}.{idx}"
        linears = block_linears(block, prefix)
        with collect_input_stats(linears, False) as stats:
            target = run_block(block, hidden, cap, idx, dev, 8)
        if idx in BLOCKS:
            groups = input_groups(stats)
            for lr, steps in SETTINGS:
                t0 = time.time()
                _, info = block_permutations(block, prefix, linears, stats, groups, hidden, target, cap, idx,
                                             Pattern(2, 4), replace(base, lr=lr, steps=steps), dev)
                s = info["summary"]
                row = {"block": idx, "lr": lr, "steps": steps, "identity": s["recon_before"],
                       "search": s["recon_search"], "final": s["recon_final"], "best_step": s["recon_best_step"],
                       "chosen": s["chosen"], "seconds": round(time.time() - t0, 1)}
                rows.append(row)
                print(row, flush=True)
        hidden = target  # dense propagation
    out = ROOT / "scripts" / "results" / "perm_lr_blocks.json"
    out.write_text(json.dumps({"what": __doc__.strip().splitlines()[0], "calib": {"source": "wiki", "nsamples": 32,
                               "seqlen": 256, "seed": 0}, "pattern": "2:4", "perm_block": 64, "holdout": 0.25,
                               "judged_on": "held-out windows", "rows": rows,
                               "command": " ".join(["python", *sys.argv]), "machine": machine(),
                               "versions": versions()}, indent=1))


if __name__ == "__main__":
    main()
