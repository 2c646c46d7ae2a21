"""Perplexity of a real model scored whole and one block at a time: the two must agree.

    .venv/bin/python scripts/check_blockwise_ppl.py [MODEL] [--out scripts/results/blockwise_ppl.json]

``prune`` and ``eval`` score a model that does not fit the device whole one decoder block at a
time (``perplexity(..., blockwise=True)``). This runs both ways on the same held-out windows, on
the CPU (where both are possible), and records the two perplexities, their relative difference and
the times.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--text", default="brown")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "blockwise_ppl.json"))
    args = ap.parse_args()

    from shuffleprune.calib import bos_token, eval_tokens, get_source
    from shuffleprune.evaluation.perplexity import perplexity
    from shuffleprune.models import load_model
    from shuffleprune.runtime.facts import machine, versions

    lm = load_model(args.model)
    model = lm.model.float()
    tokens = eval_tokens(get_source(args.text), lm.tokenizer, args.tokens)
    bos = bos_token(lm.tokenizer)
    rows = {}
    for blockwise in (False, True):
        t0 = time.time()
        ppl = perplexity(model, tokens, args.ctx, "cpu", batch_size=args.batch_size, bos=bos, blockwise=blockwise)
        rows["blockwise" if blockwise else "whole"] = {"ppl": ppl, "seconds": round(time.time() - t0, 1)}
        print(f"{'blockwise' if blockwise else 'whole':>9}: ppl {ppl:.4f} ({rows['blockwise' if blockwise else 'whole']['seconds']} s)")
    rel = abs(rows["blockwise"]["ppl"] - rows["whole"]["ppl"]) / rows["whole"]["ppl"]
    result = {"what": "perplexity scored whole and one block at a time (perplexity(..., blockwise=True))",
              "model": lm.source, "text": args.text, "ctx": args.ctx, "tokens": int(tokens.numel()),
              "bos": bos is not None, "batch_size": args.batch_size, "dtype": "float32", "device": "cpu",
              "rows": rows, "relative_difference": rel,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(), "versions": versions()}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"relative difference {rel:.2e}; wrote {args.out}")


if __name__ == "__main__":
    main()
