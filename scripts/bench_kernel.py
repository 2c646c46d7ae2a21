"""Benchmark the 2:4 kernels on a GPU: dense cuBLAS vs Triton (with / without index map) vs PyTorch
semi-structured vs SparseLinear's automatic choice, for LLaMA-2-7B linear shapes.

    python scripts/bench_kernel.py                      # on a CUDA machine → scripts/results/bench_kernel.json
    python scripts/bench_kernel.py --smoke              # CPU, TRITON_INTERPRET=1, tiny shapes: checks the
                                                        # code paths only (no timings are meaningful)

Every timing is the median GPU time of one call from ``triton.testing.do_bench`` (``--warmup`` /
``--rep`` milliseconds; L2 flushed before each call; CPU launch overhead not included), on fresh
random bf16 data; correctness of every implementation is checked against the dense result first.
"""
from __future__ import annotations

import argparse
import json
import os
from functools import partial
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # [out, in]
TOKENS = [1, 16, 128, 2048]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rep", type=int, default=100, help="do_bench's repetition time per case (ms)")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench's warm-up time per case (ms)")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_kernel.json"))
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")

    import torch
    import torch.nn.functional as F

    from shuffleprune.kernels.nm_matmul import nm_gather_matmul
    from shuffleprune.masks import nm_keep_mask
    from shuffleprune.runtime import machine, versions
    from shuffleprune.deploy.format import compress
    from shuffleprune.deploy.sparse_linear import SparseLinear

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        raise SystemExit("no CUDA device: run on a GPU machine, or --smoke to check the code paths on CPU")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [(96, 64), (64, 160)] if args.smoke else SHAPES
    tokens_list = [1, 5] if args.smoke else TOKENS

    def timed(fn) -> float:
        """GPU time of one call: triton's do_bench (L2 flushed before every call, so a weight that
        fits in L2 is still read from memory), median; on the CPU smoke run, one wall-clock call."""
        if device.type != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))

    rows = []
    gen = torch.Generator(device="cpu").manual_seed(0)
    for out_f, in_f in shapes:
        w = torch.randn(out_f, in_f, generator=gen)
        w = (w * nm_keep_mask(w.abs(), 2, 4)).to(dtype)
        values, meta = compress(w, 2, 4)
        perm = torch.randperm(in_f, generator=gen)
        w_dense_p = w.to(device)
        layers = {
            "triton": SparseLinear(values, meta, in_f, 2, 4, policy="triton").to(device),
            "triton_perm": SparseLinear(values, meta, in_f, 2, 4, perm=perm, policy="triton").to(device),
            "triton_group_perm": partial(nm_gather_matmul, values=values.to(device), meta=meta.to(device), n=2, m=4,
                                         bits=2, perm=perm.to(device, torch.int32), variant="group"),
            "semi_structured": SparseLinear(values, meta, in_f, 2, 4, perm=perm, policy="semi_structured").to(device),
            "semi_cutlass": SparseLinear(values, meta, in_f, 2, 4, perm=perm, policy="semi_cutlass").to(device),
            "auto": SparseLinear(values, meta, in_f, 2, 4, perm=perm, policy="auto").to(device),
        }
        for tokens in tokens_list:
            x = torch.randn(tokens, in_f, generator=gen).to(device, dtype)
            ref = F.linear(x, w_dense_p)
            ref_p = F.linear(x[:, perm.to(device)], w_dense_p)
            results = {"dense": timed(lambda: F.linear(x, w_dense_p))}
            for impl, layer in layers.items():
                try:
                    y = layer(x)
                except (RuntimeError, NotImplementedError) as exc:  # e.g. semi-structured unsupported here
                    rows.append({"shape": [out_f, in_f], "tokens": tokens, "impl": impl, "ms": None,
                                 "error": str(exc).splitlines()[0][:200]})
                    continue
                want = ref if impl == "triton" else ref_p  # triton / triton_perm: the default variant (gather)
                err = float((y.float() - want.float()).abs().max() / want.float().abs().max())
                results[impl] = timed(lambda layer=layer: layer(x))
                extra = {"rel_err": err}
                if impl == "auto":
                    extra["choice"] = layer.choices
                rows.append({"shape": [out_f, in_f], "tokens": tokens, "impl": impl, "ms": results[impl], **extra})
            rows.append({"shape": [out_f, in_f], "tokens": tokens, "impl": "dense", "ms": results["dense"]})
            print(f"{out_f}x{in_f} t={tokens}: " + "  ".join(f"{k} {v:.4f}ms" for k, v in results.items()), flush=True)
    dev_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke: TRITON_INTERPRET=1)"
    for r in rows:
        r.update(device=dev_name, dtype=str(dtype).replace("torch.", ""))
    result = {"what": "2:4 kernels vs dense", "smoke": args.smoke, "device": dev_name, "seed": 0,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
              "versions": versions("triton"), "rows": rows}
    out = Path(args.out) if not args.smoke else Path(args.out).with_name("bench_kernel_smoke.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
