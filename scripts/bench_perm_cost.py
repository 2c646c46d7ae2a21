"""Cost of learning permutations: seconds per optimisation step and peak memory, for one decoder block.

    .venv/bin/python scripts/bench_perm_cost.py                       # the embedded SmolLM2-135M, CPU
    python scripts/bench_perm_cost.py --llama7b-block --device cuda   # a random LLaMA-2-7B-shaped block

Times the block-level ShuffleSparse loop (``perm.pruning.block_permutations``: STE Hungarian + STE
top-2-of-4 + cosine loss + projection, then the choice of the final permutation on all windows) on
``--windows`` calibration windows of ``--seqlen`` tokens (batch ``--batch`` per step) at two step
counts (``--steps`` and 3×``--steps``): their difference gives the seconds per step, the rest is the
fixed cost per block (choice of the final permutation, Hungarian hardening). The swap search used by
``--perm-init search`` is timed as a third run. It then extrapolates to a whole model at the paper's
settings: blocks × (fixed + ``--paper-steps`` × s/step [+ search]). Results are appended to
``scripts/results/bench_perm_cost.json``.
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
    ap.add_argument("--llama7b-block", action="store_true", help="a random-initialised LLaMA-2-7B-shaped block")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--paper-steps", type=int, default=400)
    ap.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on the GPU (default: full float32)")
    ap.add_argument("--no-search", action="store_true", help="skip timing the swap search (--perm-init search)")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_perm_cost.json"))
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shuffleprune.block_inputs import capture_block_inputs, run_block
    from shuffleprune.blocks import block_linears, find_blocks
    from shuffleprune.masks import Pattern
    from shuffleprune.perm.pruning import PermOptions, block_permutations
    from shuffleprune.runtime.devices import tf32_matmuls
    from shuffleprune.runtime.facts import machine, versions
    from shuffleprune.runtime.memory import peak_rss_mb
    from shuffleprune.prune.input_stats import collect_input_stats, input_groups

    device = torch.device(args.device)
    tf32 = tf32_matmuls(device, args.tf32)  # as `prune --tf32`; held until the script exits
    tf32_on = tf32.__enter__()
    torch.manual_seed(0)
    if args.llama7b_block:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=1, num_attention_heads=32,
                          vocab_size=32000, max_position_embeddings=4096)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        label, n_blocks = "random LLaMA-2-7B-shaped block", 32
        tokens = torch.randint(0, cfg.vocab_size, (args.windows, args.seqlen))
    else:
        from shuffleprune.calib import calibration_windows, get_source
        from shuffleprune.models import load_model

        lm = load_model(None)
        model, label = lm.model, "embedded SmolLM2-135M-Instruct, block 0"
        n_blocks = model.config.num_hidden_layers
        tokens = calibration_windows(get_source("wiki"), lm.tokenizer, args.windows, args.seqlen, 0)
    blocks = find_blocks(model)
    captured = capture_block_inputs(model, blocks, tokens, device, 2)
    hidden = captured.hidden
    block = blocks.layers[0].to(device)
    linears = block_linears(block, blocks.prefix(0))
    with collect_input_stats(linears, False) as stats:
        target = run_block(block, hidden, captured, 0, device, 2)
    groups = input_groups(stats)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    def timed(init: str, steps: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.time()
        opts = PermOptions(perm="learned", init=init, steps=steps, batch=args.batch)
        block_permutations(block, linears, {n: s.col_norm for n, s in stats.items()}, groups,
                           hidden, target, captured, 0,
                           Pattern(2, 4), opts, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.time() - t

    timed("identity", 1)  # warm-up: CUDA context, kernels, allocator
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    short, long_ = args.steps, 3 * args.steps
    t_short, t_long = timed("identity", short), timed("identity", long_)
    per_step = (t_long - t_short) / (long_ - short)
    fixed = max(t_short - short * per_step, 0.0)
    search_s = 0.0 if args.no_search else max(timed("search", short) - t_short, 0.0)
    whole = n_blocks * (fixed + args.paper_steps * per_step + search_s)
    result = {
        "what": label, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "seed": 0, "steps": [short, long_], "windows": args.windows, "seqlen": args.seqlen, "batch_per_step": args.batch,
        "dtype": str(next(block.parameters()).dtype).replace("torch.", ""),
        "tf32": tf32_on,
        "seconds_per_step": round(per_step, 4), "fixed_seconds_per_block": round(fixed, 2),
        "search_seconds_per_block": None if args.no_search else round(search_s, 2),
        "extrapolated_model_hours": round(whole / 3600, 3),
        "extrapolation": f"{n_blocks} blocks × (fixed + {args.paper_steps} steps × s/step"
                         + ("" if args.no_search else " + search") + ")",
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "peak_cuda_mb": round(torch.cuda.max_memory_allocated() / 2**20, 1) if device.type == "cuda" else None,
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(), "versions": versions(),
    }
    out = Path(args.out)
    existing = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    existing["rows"].append(result)
    out.write_text(json.dumps(existing, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "versions")}, indent=1))


if __name__ == "__main__":
    main()
