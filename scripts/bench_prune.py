"""Benchmark: one-shot pruning of the embedded SmolLM2-135M — shuffleprune vs llm-compressor.

Every method is pruned in its own subprocess (so peak RSS is its own) on the same calibration
windows; perplexity of every result is measured here with the same code on the same held-out text.
llm-compressor runs in a separate venv (``--llmc-venv``, created by ``scripts/setup_llmc.sh``) so
its pins never constrain ours. Results: ``scripts/results/bench_prune.json``.

    .venv/bin/python scripts/bench_prune.py            # defaults below; ~1 h on 2 CPU cores
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shuffleprune.calib import calibration_windows, eval_tokens, get_source
from shuffleprune.evaluation.perplexity import perplexity
from shuffleprune.blocks import find_blocks, model_linears
from shuffleprune.masks import parse_pattern, satisfies_nm
from shuffleprune.models import load_model, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--pattern", default="2:4")
    ap.add_argument("--calib", default="wiki")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-text", default="brown")
    ap.add_argument("--eval-ctx", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--methods", default="dense,magnitude,wanda,sparsegpt")
    ap.add_argument("--llmc-methods", default="wanda,sparsegpt")
    ap.add_argument("--llmc-venv", default=str(ROOT / ".bench-venv"))
    ap.add_argument("--out", default=str(ROOT / "scripts/results/bench_prune.json"))
    args = ap.parse_args()

    model_path = resolve_model_path(args.model)
    lm = load_model(model_path)
    tokens = calibration_windows(get_source(args.calib), lm.tokenizer, args.nsamples, args.seqlen, args.seed)
    held_out = eval_tokens(get_source(args.eval_text), lm.tokenizer, args.eval_tokens)
    pattern = parse_pattern(args.pattern, None)
    base = {"model": args.model or "SmolLM2-135M-Instruct (embedded, GGUF Q4_1 dequantized to fp32)",
            "pattern": args.pattern, "calib": args.calib, "nsamples": args.nsamples, "seqlen": args.seqlen,
            "seed": args.seed, "eval_text": f"{args.eval_text} (test split)", "eval_ctx": args.eval_ctx,
            "eval_tokens": int(held_out.numel())}
    rows = []

    def ppl_of(model) -> float:
        return perplexity(model, held_out, args.eval_ctx, "cpu", progress=False)

    def finish(row: dict, model) -> None:
        row["ppl"] = round(ppl_of(model), 4)
        if row["method"] == "dense":
            row["nm_ok"] = None
        else:
            row["nm_ok"] = all(satisfies_nm(lin.weight, pattern.n, pattern.m)
                               for lin in model_linears(find_blocks(model)).values())
        rows.append({**base, **row})
        print(json.dumps(rows[-1]), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.save(tokens, tmp / "calib.pt")
        for method in args.methods.split(","):
            if method == "dense":
                finish({"method": "dense", "tool": "none", "seconds": 0.0, "peak_rss_mb": None}, lm.model)
                continue
            out = tmp / f"sp-{method}"
            # the method alone, as llm-compressor runs it: no permutation, no weight update
            cmd = [sys.executable, "-m", "shuffleprune.cli", "prune", model_path, "--recipe", "balanced", "--perm", "none",
                   "--base", method, "--pattern", args.pattern,
                   "--calib", args.calib, "--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen),
                   "--seed", str(args.seed), "--eval-text", "none", "--device", "cpu", "--out", str(out), "--quiet"]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            rep = json.loads((out / "prune_report.json").read_text())
            model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            finish({"method": method, "tool": "shuffleprune",
                    "seconds": round(rep["seconds"]["calibration"] + rep["seconds"]["prune"], 2),
                    "peak_rss_mb": rep["peak_rss_mb"]}, model)
        llmc_python = Path(args.llmc_venv) / "bin/python"
        for method in filter(None, args.llmc_methods.split(",")):
            if not llmc_python.exists():
                print(f"skipping llm-compressor rows: {llmc_python} missing (run scripts/setup_llmc.sh)")
                break
            out = tmp / f"llmc-{method}"
            out.mkdir()
            subprocess.run([str(llmc_python), str(ROOT / "scripts/llmc_prune.py"), "--model", model_path,
                            "--tokens", str(tmp / "calib.pt"), "--method", method, "--pattern", args.pattern,
                            "--out", str(out)], check=True, stdout=subprocess.DEVNULL,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
            rep = json.loads((out / "llmc_report.json").read_text())
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
            missing, unexpected = model.load_state_dict(load_file(str(out / "layers.safetensors")), strict=False)
            assert not unexpected, unexpected
            finish({"method": method, "tool": "llmcompressor", "tool_version": rep["llmcompressor"],
                    "seconds": round(rep["seconds"], 2), "peak_rss_mb": round(rep["peak_rss_mb"], 1)}, model)

    result = {"benchmark": "bench_prune", "command": " ".join([Path(sys.executable).name] + sys.argv),
              "date": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": {"platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
                          "cores": os.cpu_count(), "device": "cpu"},
              "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                           "python": platform.python_version()},
              "notes": "seconds = calibration + pruning wall time, model load and perplexity excluded; "
                       "peak_rss_mb = the pruning subprocess's peak RSS (includes loading the model).",
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
