"""What ``shuffleprune finetune`` recovers: a 2:4 checkpoint before and after fine-tuning its kept weights.

    .venv/bin/python scripts/bench_finetune.py                       # → scripts/results/bench_finetune.json
    .venv/bin/python scripts/bench_finetune.py --steps 2 --out /tmp/x.json --work /tmp/ft   # a quick check

1. ``prune``: the embedded SmolLM2-135M-Instruct (or ``--model``) to 2:4 with ``--recipe`` (default ``fast``,
   the demo's: Wanda + swap search) on ``--calib`` windows (default 32×512 of ``wiki``, seed 0), kept in
   ``WORK/pruned`` and reused when its report says the same settings;
2. ``finetune``: those weights trained on ``--data`` (default ``wiki``: every 10th document held out), zeros
   held, ``--steps`` steps of ``--batch-size`` × ``--seq-len`` tokens;
3. ``eval``: dense, pruned and fine-tuned perplexity on ``--eval-text`` (default ``brown``, a text neither step
   trains on) with one code path, ctx ``--eval-ctx``, the first ``--eval-tokens`` tokens; and whether the
   fine-tuned checkpoint still holds the pruned one's zeros, layer by layer, and exports.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def zeros_held(pruned: Path, tuned: Path) -> dict:
    """Whether every zero of the layers the pruning run pruned (its report's) is still zero in the fine-tuned
    checkpoint, how many kept weights became zero (a small value rounded to 16 bits), and how many tensors changed."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(pruned / "model.safetensors")), load_file(str(tuned / "model.safetensors"))
    layers = [f"{layer['name']}.weight" for layer in json.loads((pruned / "prune_report.json").read_text())["layers"]]
    return {"pruned_matrices": len(layers),
            "zeros_held": all(not bool(b[k][a[k] == 0].any()) for k in layers),
            "kept_weights_now_zero": sum(int(((a[k] != 0) & (b[k] == 0)).sum()) for k in layers),
            "kept_weights": sum(int((a[k] != 0).sum()) for k in layers),
            "dtype_kept": all(a[k].dtype == b[k].dtype for k in a),
            "tensors_changed": sum(not torch.equal(a[k], b[k]) for k in a), "tensors": len(a)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--recipe", default="fast")
    parser.add_argument("--calib", default="wiki")
    parser.add_argument("--nsamples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--data", default="wiki")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--heldout-tokens", type=int, default=16384, help="finetune's own held-out perplexity")
    parser.add_argument("--eval-text", default="brown")
    parser.add_argument("--eval-ctx", type=int, default=512)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=ROOT / "out" / "bench_finetune")
    parser.add_argument("--out", type=Path, default=ROOT / "scripts" / "results" / "bench_finetune.json")
    args = parser.parse_args()

    import shuffleprune
    from shuffleprune.runtime.facts import machine, versions

    pruned, run = args.work / "pruned", args.work / "tuned"
    settings = {"recipe": args.recipe, "calib": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen,
                "seed": args.seed, "model": args.model}
    seconds = {}
    marker = args.work / "pruned_settings.json"
    if not (marker.is_file() and json.loads(marker.read_text()) == settings):
        t0 = time.time()
        shuffleprune.prune(args.model, recipe=args.recipe, pattern="2:4", calib=args.calib, nsamples=args.nsamples,
                           seqlen=args.seqlen, seed=args.seed, eval_text="none", out=str(pruned), overwrite=True,
                           progress=False)
        seconds["prune"] = round(time.time() - t0, 1)
        marker.write_text(json.dumps(settings))
    t0 = time.time()
    report = shuffleprune.finetune(pruned, run, data=args.data, steps=args.steps, lr=args.lr, warmup=args.warmup,
                                   seq_len=args.seq_len, batch_size=args.batch_size, eval_every=0,
                                   eval_tokens=args.heldout_tokens,
                                   checkpoint_every=0, seed=args.seed, overwrite=True, progress=False)
    seconds["finetune"] = round(time.time() - t0, 1)
    t0 = time.time()
    scores = shuffleprune.evaluate(["default" if args.model is None else args.model, str(pruned), str(run / "model")],
                                   tasks=["ppl"], ppl_text=args.eval_text, ppl_ctx=args.eval_ctx,
                                   ppl_tokens=args.eval_tokens, progress=False)
    seconds["eval"] = round(time.time() - t0, 1)
    ppl = dict(zip(("dense", "pruned", "finetuned"), (m["ppl"] for m in scores["models"])))
    shuffleprune.export(run / "model", args.work / "deployed", overwrite=True, progress=False)
    result = {
        "what": "2:4 checkpoint before and after `shuffleprune finetune` (zeros held), perplexity on a text "
                "neither pruning nor fine-tuning reads",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(), "versions": versions("transformers", "accelerate"),
        "prune": settings, "finetune": {k: report["train"][k] for k in
                                         ("data", "steps", "lr", "warmup", "batch_size", "seq_len", "seed", "eval_tokens")},
        "finetune_text": report["text"], "finetune_heldout_ppl": report["evals"],
        "eval": {"text": args.eval_text, "ctx": args.eval_ctx, "tokens": args.eval_tokens},
        "ppl": {k: round(v, 2) for k, v in ppl.items()},
        "gap_closed": round((ppl["pruned"] - ppl["finetuned"]) / (ppl["pruned"] - ppl["dense"]), 4),
        "zeros": zeros_held(pruned, run / "model"), "exported": True,
        "train_seconds": report["train_seconds"], "seconds": seconds, "peak_rss_mb": report["peak_rss_mb"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("ppl", "gap_closed", "zeros", "seconds")}, indent=1))


if __name__ == "__main__":
    main()
