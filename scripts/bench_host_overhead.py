"""The host's share of an eager sparse-layer call: what a plain ``generate()`` (no CUDA graphs) pays per
layer on the CPU before the GPU sees a kernel. Runs anywhere; the kernels are stubbed out.

    python scripts/bench_host_overhead.py          # → scripts/results/bench_host_overhead.json
    python scripts/bench_host_overhead.py --smoke  # fewer calls → …_smoke.json

Rows, each the mean µs per call over ``--calls`` calls after a warm-up: ``decode_plan`` and
``gemm_plan`` looked up (as every launch now does) against worked out (``plan_decode``,
``plan_gemm``: what every launch did before); ``nm_decode`` on a 4096×4096 bf16 2:4 weight with an
index map at one token, its Triton launch replaced by a no-op (the rest of the wrapper: plan, checks,
output and split-K buffers, launch arguments); a mapped input's gather by ``index_select`` alone and
through ``deploy/input_gather.py`` (its measured order looked up, as on CUDA, then ``index_select``:
the difference is what the measured choice adds); a member of a stacked q/k/v group (``FusedInputs``)
and a plain ``SparseLinear``, each with ``_run`` (the kernel) stubbed. The launch itself (Triton's
launcher, the driver) is not counted: it needs a GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mean_us(fn, calls: int, warm: int = 100) -> float:
    """Mean microseconds per call of ``fn`` over ``calls`` calls, after ``warm`` calls."""
    for _ in range(warm):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return round((time.perf_counter() - start) / calls * 1e6, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_host_overhead.json"))
    args = ap.parse_args()
    calls = 50 if args.smoke else args.calls

    import torch

    from shuffleprune.deploy.format import compress
    from shuffleprune.deploy.fused_inputs import FusedInputs
    from shuffleprune.deploy.sparse_linear import SparseLinear
    from shuffleprune.kernels import nm_decode, nm_gemm
    from shuffleprune.masks import nm_keep_mask
    from shuffleprune.outdir import atomic_write
    from shuffleprune.runtime import machine, versions

    torch.manual_seed(0)
    cpu = torch.device("cpu")
    rows = []

    def row(what: str, us: float, **extra) -> None:
        rows.append({"what": what, "us_per_call": us, **extra})
        print(f"{what:55s} {us:9.2f} µs", flush=True)

    for tokens in (1, 2, 16):
        row(f"decode_plan 4096x4096 2:4, {tokens} tokens, looked up",
            mean_us(lambda: nm_decode.decode_plan(4096, 2048, tokens, 2, 4, 2, cpu), calls))
        row(f"plan_decode 4096x4096 2:4, {tokens} tokens, worked out",
            mean_us(lambda: nm_decode.plan_decode(4096, 2048, tokens, 2, 4, 2, cpu), calls))
    for tokens in (64, 512):
        row(f"gemm_plan 4096x4096 2:4, {tokens} tokens, looked up",
            mean_us(lambda: nm_gemm.gemm_plan(tokens, 4096, 4096, 2, 4, 2, cpu), calls))
        row(f"plan_gemm 4096x4096 2:4, {tokens} tokens, worked out",
            mean_us(lambda: nm_gemm.plan_gemm(tokens, 4096, 4096, 2, 4, 2, cpu), max(10, calls // 20), warm=5))

    def sparse(rows_: int, cols: int, dtype=torch.float32):
        w = torch.randn(rows_, cols)
        w = (w * nm_keep_mask(w.abs(), 2, 4)).to(dtype)
        return compress(w, 2, 4)

    class NoLaunch:   # the Triton kernel's launch replaced by nothing
        def __getitem__(self, grid):
            return lambda *a, **k: None

    values, meta = sparse(4096, 4096, torch.bfloat16)
    layer = SparseLinear(values, meta, 4096, 2, 4, perm=torch.randperm(4096))
    words, x = layer.words(), torch.randn(1, 1, 4096, dtype=torch.bfloat16)
    kernel, nm_decode._nm_decode_kernel = nm_decode._nm_decode_kernel, NoLaunch()
    try:
        row("nm_decode 4096x4096 bf16 2:4 + map, 1 token, launch stubbed",
            mean_us(lambda: nm_decode.nm_decode(x, values, words, 2, 4, 2, layer.perm), calls))
    finally:
        nm_decode._nm_decode_kernel = kernel

    # a mapped input's gather: index_select alone, and through input_gather with its measured order looked
    # up (what a mapped layer's gather on CUDA adds on the host; here the order is set, not measured)
    from shuffleprune.deploy import input_gather

    xs, perm32 = torch.randn(1, 4096, dtype=torch.bfloat16), layer.perm
    row("index_select 4096 bf16, 1 token", mean_us(lambda: xs.index_select(-1, perm32), calls))
    measured_here = input_gather.measured_here
    input_gather.measured_here = lambda x: True
    input_gather._ORDERS[(xs.device, xs.dtype, 4096, 1, layer.map_span)] = ("index_select",)
    try:
        row("gather_input 4096 bf16, 1 token, order looked up (index_select)",
            mean_us(lambda: input_gather.gather_input(xs, perm32, span=layer.map_span), calls))
    finally:
        input_gather.measured_here = measured_here
        input_gather.release_gather_choices()

    outputs: dict = {}

    def stub_run(self, impl, x):   # the kernel's output, made once per shape
        key = (self.out_features, tuple(x.shape[:-1]))
        return outputs.setdefault(key, torch.empty(*x.shape[:-1], self.out_features))

    run, SparseLinear._run = SparseLinear._run, stub_run
    try:
        x = torch.randn(1, 1, 256)
        plain = SparseLinear(*sparse(256, 256), 256, 2, 4)
        q, k, v = (SparseLinear(*sparse(r, 256), 256, 2, 4) for r in (256, 64, 64))
        group = FusedInputs([q, k, v])
        for member in (q, k, v):
            member.fused_inputs = group
        row("SparseLinear call, kernel stubbed", mean_us(lambda: plain(x), calls))
        row("stacked q/k/v member call, kernel stubbed", round(mean_us(lambda: (q(x), k(x), v(x)), calls) / 3, 2))
    finally:
        SparseLinear._run = run

    result = {"what": "host µs per call of the sparse runtime's eager path, kernels stubbed (no GPU needed)",
              "calls": calls, "seed": 0, "rows": rows, "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "machine": machine(), "versions": versions("triton")}
    out = Path(args.out)
    if args.smoke:
        out = out.with_name(out.stem + "_smoke.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: tmp.write_text(json.dumps(result, indent=1)))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
