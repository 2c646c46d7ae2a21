"""End-to-end decode / prefill speed: a random-initialised LLaMA-2-7B-shaped model, dense vs 2:4 with
index maps (SparseLinear, automatic kernel choice), bf16 on a GPU.

    python scripts/bench_e2e.py                 # CUDA → scripts/results/bench_e2e.json
    python scripts/bench_e2e.py --smoke         # CPU, a 2-layer small config: checks the code path only

The sparse model is built in memory the way ``export`` lays it out: every decoder linear gets a 2:4
mask in permuted column order and a random block-diagonal index map, except down_proj, whose map
``export`` folds into gate/up rows (so it reads its input in order).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_e2e.json"))
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shuffleprune.blocks import block_linears, find_blocks
    from shuffleprune.masks import nm_keep_mask
    from shuffleprune.perm.core import random_block_perm
    from shuffleprune.runtime import machine, versions
    from shuffleprune.deploy.format import compress
    from shuffleprune.deploy.sparse_linear import SparseLinear

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run on a GPU machine, or --smoke on CPU")
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    if args.smoke:
        cfg = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                          vocab_size=1000, max_position_embeddings=1024)
        args.prompt, args.new_tokens = 32, 8
    else:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), device=device)

    def measure(label: str) -> dict:
        """Prefill: median wall time of 3 forward passes over the prompt. Decode: per token, from the
        difference between generating ``--new-tokens`` and 1 token (median of 3 each), so prefill and
        generate's set-up cancel. Everything is run once first, so that SparseLinear's first-call
        kernel choice for each token count and Triton's compilation stay out of the timings."""
        sync = torch.cuda.synchronize if cuda else (lambda: None)

        def wall(fn) -> float:
            sync()
            t = time.perf_counter()
            fn()
            sync()
            return time.perf_counter() - t

        def generate(n: int) -> None:
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

        with torch.no_grad():
            model(ids, use_cache=False)
            generate(args.new_tokens)
            prefill = statistics.median(wall(lambda: model(ids, use_cache=False)) for _ in range(3))
            one = statistics.median(wall(lambda: generate(1)) for _ in range(3))
            many = statistics.median(wall(lambda: generate(args.new_tokens)) for _ in range(3))
        per_token = max(many - one, 1e-9) / (args.new_tokens - 1)
        return {"model": label, "prefill_ms": round(prefill * 1e3, 2),
                "decode_ms_per_token": round(per_token * 1e3, 3),
                "decode_tokens_per_s": round(args.batch / per_token, 2),
                "peak_cuda_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None}

    rows = [measure("dense")]
    blocks = find_blocks(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for i, block in enumerate(blocks.layers):
            for name, lin in block_linears(block, f"{blocks.name}.{i}").items():
                perm = None if name.endswith("down_proj") else random_block_perm(lin.in_features, 64, gen)
                w = lin.weight.data if perm is None else lin.weight.data[:, perm.to(device)]
                w = w * nm_keep_mask(w.float().abs(), 2, 4).to(w.dtype)
                values, meta = compress(w.cpu(), 2, 4, name)
                parent_name, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent_name), child,
                        SparseLinear(values, meta, lin.in_features, 2, 4, perm).to(device))
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    rows.append(measure("2:4+perm (SparseLinear auto)"))
    choices = {}
    for name, mod in model.named_modules():
        if isinstance(mod, SparseLinear):
            choices.setdefault(f"{mod.out_features}x{mod.in_features}", mod.choices)
    result = {"what": "end-to-end decode/prefill, random LLaMA-2-7B-shaped model" + (" (smoke)" if args.smoke else ""),
              "device": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "dtype": str(dtype),
              "param_dtype_device": f"{next(model.parameters()).dtype} {next(model.parameters()).device}",
              "seed": 0, "batch": args.batch, "prompt": args.prompt, "new_tokens": args.new_tokens, "rows": rows,
              "decode_speedup": round(rows[1]["decode_tokens_per_s"] / rows[0]["decode_tokens_per_s"], 3),
              "prefill_speedup": round(rows[0]["prefill_ms"] / rows[1]["prefill_ms"], 3),
              "kernel_choices": choices, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": machine(), "versions": versions("triton")}
    out = Path(args.out) if not args.smoke else Path(args.out).with_name("bench_e2e_smoke.json")
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("rows", "decode_speedup", "prefill_speedup")}, indent=1))


if __name__ == "__main__":
    main()
