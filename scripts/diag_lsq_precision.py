"""How close the lsq stage's conjugate-gradient solve gets to the exact masked least-squares optimum,
by precision and step count, on a real model's layers.

    .venv/bin/python scripts/diag_lsq_precision.py                         # embedded SmolLM2, blocks 0 8 16 24

Prunes the model with ``--recipe`` (default ``balanced``: search → SparseGPT) through the normal
driver with one extra stage registered here, ``update: capture``, which copies the dense weight, the
pruned weight and ``XᵀX`` of every linear of the ``--blocks`` named, changes nothing, and ends the
walk after the last of them. Then, for
each captured linear, it solves ``min ‖(W − Ŵ) Xᵀ‖²`` over the mask from the pruned weights with
:func:`masked_lstsq` at each precision and step count, and reports the layer error relative to the
float64 solve at ``tol=1e-6`` (the optimum), and seconds. Written to
``scripts/results/lsq_precision.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shuffleprune.prune import PruneConfig, prune  # noqa: E402
from shuffleprune.prune.methods.lsq import masked_lstsq  # noqa: E402
from shuffleprune.prune.stage import BlockWork, Run, Stage, register  # noqa: E402
from shuffleprune.runtime.facts import machine, versions  # noqa: E402

CAPTURED: dict[str, dict[str, torch.Tensor]] = {}
WANT_BLOCKS: set[int] = set()


class Enough(Exception):
    """Raised after the last wanted block: the later blocks are not needed."""


@register
@dataclass
class Capture(Stage):
    """Copies each wanted block's dense weights, pruned weights and XᵀX; changes nothing."""

    kind = "update"
    name = "capture"

    def needs(self) -> set[str]:
        return {"gram", "dense_weights"}

    def apply(self, run: Run, work: BlockWork) -> None:
        if work.index in WANT_BLOCKS:
            for name, lin in work.linears.items():
                CAPTURED[name] = {"dense": work.dense[name].float().cpu(), "pruned": lin.weight.detach().float().cpu(),
                                  "gram": work.stats[name].gram.cpu()}
        if work.index >= max(WANT_BLOCKS):
            raise Enough


def layer_error(dense: torch.Tensor, weight: torch.Tensor, gram: torch.Tensor) -> float:
    """``‖(W − Ŵ) Xᵀ‖²`` from ``XᵀX`` (undamped), in float64."""
    d = dense.double() - weight.double()
    return float(((d @ gram.double()) * d).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--recipe", default="balanced")
    ap.add_argument("--pattern", default="2:4")
    ap.add_argument("--calib", default="wiki")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--blocks", type=int, nargs="+", default=[0, 8, 16, 24])
    ap.add_argument("--iters", type=int, nargs="+", default=[5, 10, 20, 40, 200])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "lsq_precision.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    WANT_BLOCKS.update(args.blocks)
    cfg = PruneConfig.build(args.recipe, model=args.model, pattern=args.pattern, calib=args.calib,
                            nsamples=args.nsamples, seqlen=args.seqlen, seed=args.seed, eval_text=None,
                            dtype="float32", overrides=["update=capture"])
    try:
        prune(cfg, out=None, progress=False)
    except Enough:
        pass
    rows = []
    for name, d in CAPTURED.items():
        mask = d["pruned"] != 0
        t0 = time.perf_counter()
        exact = masked_lstsq(d["dense"], mask, d["gram"], start=d["pruned"], iters=1000, tol=1e-6)
        exact_seconds = time.perf_counter() - t0
        opt = layer_error(d["dense"], exact, d["gram"])
        row = {"linear": name, "shape": list(d["dense"].shape), "exact_seconds": round(exact_seconds, 3),
               "pruned_over_optimum": layer_error(d["dense"], d["pruned"], d["gram"]) / opt}
        for dtype in (torch.float64, torch.float32):
            for iters in args.iters:
                t0 = time.perf_counter()
                got = masked_lstsq(d["dense"], mask, d["gram"], start=d["pruned"], iters=iters, tol=1e-6 if dtype == torch.float64 else 1e-4,
                                   dtype=dtype)
                key = f"{str(dtype).split('.')[-1]}/iters={iters}"
                row[key] = {"over_optimum": round(layer_error(d["dense"], got, d["gram"]) / opt, 6),
                            "seconds": round(time.perf_counter() - t0, 3)}
        rows.append(row)
        print(name, {k: v for k, v in row.items() if "/" in k and k.endswith(("=20", "=40"))}, flush=True)
    summary = {}
    for key in [k for k in rows[0] if "/" in k]:
        ratios = [r[key]["over_optimum"] for r in rows]
        summary[key] = {"max_over_optimum": max(ratios), "median_over_optimum": sorted(ratios)[len(ratios) // 2],
                        "seconds_per_block": round(sum(r[key]["seconds"] for r in rows) / len(args.blocks), 3)}
    result = {"what": "lsq solve vs the float64 optimum per linear (layer error ratio; seconds)",
              "command": " ".join(sys.argv), "model": args.model or "embedded SmolLM2-135M-Instruct",
              "setup": {k: getattr(args, k) for k in ("recipe", "pattern", "calib", "nsamples", "seqlen", "seed", "blocks",
                                                      "threads")},
              "machine": machine(), "load_average_at_end": os.getloadavg(), "versions": versions(),
              "summary": summary, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
