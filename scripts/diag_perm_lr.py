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

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = (2, 12, 25)
SETTINGS = [(3e-2, 50), (3e-3, 50), (3e-3, 200), (1e-3, 200), (3e-4, 200)]


def main() -> None:
    from diag_blocks import dense_blocks
    from shuffleprune.masks import Pattern
    from shuffleprune.perm.pruning import PermOptions, block_permutations
    from shuffleprune.runtime.facts import machine, versions
    from shuffleprune.prune.input_stats import input_groups

    rows = []
    base = PermOptions(perm="learned", init="search", holdout=0.25, seed=0)
    for b in dense_blocks(32, 256, 0, max(BLOCKS)):
        if b.index not in BLOCKS:
            continue
        for lr, steps in SETTINGS:
            t0 = time.time()
            _, info = block_permutations(b.block, b.linears, {n: s.col_norm for n, s in b.stats.items()},
                                         input_groups(b.stats), b.hidden,
                                         b.target, b.captured, b.index, Pattern(2, 4),
                                         replace(base, lr=lr, steps=steps), b.device)
            s = info["summary"]
            row = {"block": b.index, "lr": lr, "steps": steps, "identity": s["recon_before"],
                   "search": s["recon_search"], "final": s["recon_final"], "best_step": s["recon_best_step"],
                   "chosen": s["chosen"], "seconds": round(time.time() - t0, 1)}
            rows.append(row)
            print(row, flush=True)
    out = ROOT / "scripts" / "results" / "perm_lr_blocks.json"
    out.write_text(json.dumps({"what": __doc__.strip().splitlines()[0], "calib": {"source": "wiki", "nsamples": 32,
                               "seqlen": 256, "seed": 0}, "pattern": "2:4", "perm_block": 64, "holdout": 0.25,
                               "judged_on": "held-out windows", "rows": rows,
                               "command": " ".join(["python", *sys.argv]), "machine": machine(),
                               "versions": versions()}, indent=1))


if __name__ == "__main__":
    main()
