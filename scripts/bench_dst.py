"""Benchmark: dynamic sparse training of a small decoder LM on offline text, same steps and seeds for all.

    .venv/bin/python scripts/bench_dst.py                       # defaults below (sized for < 1 h on 2 CPU cores)
    .venv/bin/python scripts/bench_dst.py --steps 20 --seeds 0 --methods rigl dsb   # a quick look

Rows: dense, RigL, SET, and each structured method × perm {none, random, learned}; each run in its
own subprocess (wall time and peak RSS are its own). Final held-out perplexity, the gap to RigL of
the same seed, train seconds and peak RSS relative to the same method without permutation.
Results: ``scripts/results/bench_dst.json`` (+ ``.md``); rerunning skips rows already there.

``nm`` (the exportable N:M method) runs at the sparsity of its pattern, so it gets its own file and
RigL reference at that sparsity:

    .venv/bin/python scripts/bench_dst.py --sparsity 0.5 --methods rigl nm --out scripts/results/bench_dst_nm.json

The longer run (4× the steps, one seed, three methods):

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_dst.py --steps 1200 --delta-t 100 --seeds 0 \
        --methods rigl srigl dsb --work out/bench_dst_long --out scripts/results/bench_dst_long.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STRUCTURED = ["srigl", "dsb", "pixelfly", "diag"]
PERMUTABLE = ("srigl", "dsb", "pixelfly", "diag", "nm")  # every structured method gets none / random / learned


def nm_pattern(sparsity: float) -> str:
    """The N:M pattern (M in 4, 8, 16) whose sparsity is ``sparsity``, for ``--method nm``."""
    for m in (4, 8, 16):
        n = (1 - sparsity) * m
        if abs(n - round(n)) < 1e-9 and 0 < round(n) < m:
            return f"{round(n)}:{m}"
    raise SystemExit(f"no N:M pattern with M in 4, 8, 16 has sparsity {sparsity}; nm needs e.g. 0.5 or 0.75")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="gpt2")
    ap.add_argument("--config-kw", default="n_layer=2,n_embd=128,n_head=4")
    ap.add_argument("--data", default="wiki")
    ap.add_argument("--tokenizer", default="bpe:4096", help="default: a 4096-token BPE trained on the local text")
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--delta-t", type=int, default=25)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--sparse-head", action="store_true", help="also sparsify an untied LM head (dst's --sparse-head)")
    ap.add_argument("--methods", nargs="+", default=["dense", "rigl", "set"] + STRUCTURED)
    ap.add_argument("--work", default=str(ROOT / "out" / "bench_dst"))
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_dst.json"))
    args = ap.parse_args()

    from shuffleprune.runtime.facts import machine, versions

    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    results.update({"what": "DST from scratch, small decoder LM, offline text", "machine": machine(),
                    "versions": versions("accelerate"), "setup": {k: v for k, v in vars(args).items() if k != "out"}})
    done = {(r["method"], r["perm"], r["seed"]) for r in results["rows"]}
    runs = []
    for seed in args.seeds:
        for method in args.methods:
            perms = ["none", "random", "learned"] if method in PERMUTABLE else ["none"]
            runs += [(method, perm, seed) for perm in perms]
    for method, perm, seed in runs:
        if (method, perm, seed) in done:
            continue
        run_dir = Path(args.work) / f"{method}-{perm}-s{seed}"
        cmd = [sys.executable, "-m", "shuffleprune.cli", "dst", "--arch", args.arch, "--config-kw", args.config_kw,
               "--data", args.data, "--tokenizer", args.tokenizer, "--method", method, "--sparsity", str(args.sparsity), "--steps", str(args.steps),
               "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--delta-t", str(args.delta_t),
               "--block", str(args.block), "--perm", perm,
               *(["--pattern", nm_pattern(args.sparsity)] if method == "nm" else []), "--seed", str(seed), "--eval-every", "0",
               "--checkpoint-every", str(args.steps), "--out", str(run_dir), "--overwrite", "--quiet",
               *(["--sparse-head"] if args.sparse_head else [])]
        print(" ".join(cmd[3:]), flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
            raise SystemExit(f"{method}/{perm}/seed {seed} failed")
        rep = json.loads((run_dir / "dst_report.json").read_text())
        results["rows"].append({"method": method, "perm": perm, "sparsity": args.sparsity if method != "dense" else 0.0,
                                "seed": seed, "steps": args.steps, "ppl": rep["final_ppl"],
                                "train_seconds": rep["train_seconds"], "peak_rss_mb": rep["peak_rss_mb"],
                                "density": rep["density"], "command": " ".join(["python", *cmd[1:]])})
        _summarise(results)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
        out.with_suffix(".md").write_text(_markdown(results))
        print(f"    ppl {rep['final_ppl']:.2f}  {rep['train_seconds']:.0f}s", flush=True)


def _summarise(results: dict) -> None:
    rigl = {r["seed"]: r["ppl"] for r in results["rows"] if r["method"] == "rigl"}
    base = {(r["method"], r["seed"]): r for r in results["rows"] if r["perm"] == "none"}
    for r in results["rows"]:
        r["gap_to_rigl"] = None if r["seed"] not in rigl else round(r["ppl"] - rigl[r["seed"]], 3)
        ref = base.get((r["method"], r["seed"]))
        r["time_vs_no_perm"] = None if ref is None else round(r["train_seconds"] / ref["train_seconds"], 3)
        r["rss_vs_no_perm"] = None if ref is None else round(r["peak_rss_mb"] / ref["peak_rss_mb"], 3)


def _markdown(results: dict) -> str:
    s = results["setup"]
    lines = [f"# DST benchmark: {s['arch']} {s['config_kw']}, {s['data']}, sparsity {s['sparsity']}, {s['steps']} steps", "",
             "| method | perm | seed | ppl | gap to RigL | train s | time vs no perm | peak RSS MB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        lines.append(f"| {r['method']} | {r['perm']} | {r['seed']} | {r['ppl']:.2f} | {r['gap_to_rigl']} | "
                     f"{r['train_seconds']:.0f} | {r['time_vs_no_perm']} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
