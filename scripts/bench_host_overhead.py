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
and a plain ``SparseLinear``, each with ``run`` (the kernel) stubbed. The launch itself (Triton's
launcher, the driver) is not counted: it needs a GPU.

    python scripts/bench_host_overhead.py --gpu   # → scripts/results/bench_host_overhead_cuda.json

On a GPU (``--gpu``) the same pieces run for real, launches included, on shapes small enough
that the GPU keeps up (1024 columns, one token): each row is the host's µs per call, ``--calls``
calls queued without a synchronisation (median of 5 rounds), so what an eager ``generate()`` pays
per layer shows apart from the kernels' time: ``nn.Linear`` (cuBLAS) and transformers' RMSNorm
against a bare Triton launch (the gather), ``nm_decode`` called directly (plain and as a dependent
launch; ``nm_sparse_mma``, the sparse-tensor-core decode, by its ``cuLaunchKernel``), a ``SparseLinear`` with
and without a map and a stacked group's member as ``auto`` runs
them eagerly, and the fused norm with a map (``MappedOutput``); the gather, ``nm_decode`` and the
two ``SparseLinear`` again with fast launches off (``kernels/launch.py``: each launch through
Triton's own dispatch), so the rows show what skipping that dispatch saves.
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
    ap.add_argument("--gpu", action="store_true",
                    help="the real calls on CUDA, launches included (with --smoke: their CPU paths)")
    ap.add_argument("--out", default=None, help="default: scripts/results/bench_host_overhead[_cuda].json")
    args = ap.parse_args()
    calls = 50 if args.smoke else args.calls
    args.out = args.out or str(ROOT / "scripts" / "results"
                               / f"bench_host_overhead{'_cuda' if args.gpu else ''}.json")
    if args.gpu:
        return gpu_main(args, calls)

    import torch

    from shuffleprune.deploy.format import compress
    from shuffleprune.deploy.fused_inputs import FusedInputs
    from shuffleprune.deploy.sparse_linear import SparseLinear
    from shuffleprune.kernels import decode_tiles, nm_decode, nm_gemm
    from shuffleprune.masks import nm_keep_mask

    torch.manual_seed(0)
    cpu = torch.device("cpu")
    rows = []

    def row(what: str, us: float, **extra) -> None:
        rows.append({"what": what, "us_per_call": us, **extra})
        print(f"{what:55s} {us:9.2f} µs", flush=True)

    for tokens in (1, 2, 16):
        row(f"decode_plan 4096x4096 2:4, {tokens} tokens, looked up",
            mean_us(lambda: decode_tiles.decode_plan(4096, 2048, tokens, 2, 4, 2, cpu), calls))
        row(f"plan_decode 4096x4096 2:4, {tokens} tokens, worked out",
            mean_us(lambda: decode_tiles.plan_decode(4096, 2048, tokens, 2, 4, 2, cpu), calls))
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

    # the sparse-MMA decode's wrapper (checks, plan and launch looked up, output and split-K buffers, the
    # argument block written), its cuLaunchKernel replaced by a no-op
    from shuffleprune.kernels import nm_sparse_mma as sp
    from shuffleprune.kernels.sparse_mma_tiles import sparse_mma_plan
    from shuffleprune.kernels.cuda_rtc import KernelLaunch

    class NoDriver:
        def cuLaunchKernel(self, *args):
            return 0

    plan = sparse_mma_plan(1, 4096, 4096, 132, mapped=True)
    bound = KernelLaunch(type("Compiled", (), {"func": None})(), plan.grid(4096), (32 * plan.warps, 1, 1),
                         plan.staged_bytes(1), NoDriver(), sp.ARG_POINTERS, sp.ARG_INTS)
    saved = sp._launch, sp.device_index, sp.stream_handle
    sp._launch = lambda *a: (None, plan, bound)
    sp.device_index, sp.stream_handle = (lambda device: 0), (lambda device: 0)
    try:
        row("nm_sparse_mma 4096x4096 bf16 2:4 + map read in the kernel, 1 token, launch stubbed",
            mean_us(lambda: sp.nm_sparse_mma(x, values, words, perm=layer.perm), calls))
    finally:
        sp._launch, sp.device_index, sp.stream_handle = saved

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

    run, SparseLinear.run = SparseLinear.run, stub_run
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
        SparseLinear.run = run

    write_result(args, {"what": "host µs per call of the sparse runtime's eager path, kernels stubbed (no GPU needed)",
                        "calls": calls, "seed": 0, "rows": rows})


def write_result(args, result: dict) -> None:
    """``result`` with the command, machine and versions to ``--out`` (``…_smoke.json`` under ``--smoke``)."""
    from shuffleprune.outdir import atomic_write
    from shuffleprune.runtime.facts import machine, versions

    result.update(command=" ".join([Path(sys.executable).name, *sys.argv]), machine=machine(), versions=versions("triton"))
    out = Path(args.out)
    if args.smoke:
        out = out.with_name(out.stem + "_smoke.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: tmp.write_text(json.dumps(result, indent=1)))
    print(f"wrote {out}")


def host_us(call, sync, calls: int, rounds: int = 5) -> float:
    """Median over ``rounds`` rounds of the host's µs per ``call()``, ``calls`` calls queued between
    ``sync()``s (after 20 warm-up calls)."""
    import statistics

    for _ in range(20):
        call()
    sync()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return round(statistics.median(times), 2)


def gpu_main(args, calls: int) -> None:
    """The real eager calls' host time per call on a CUDA device (module docstring)."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from shuffleprune.deploy.format import compress
    from shuffleprune.deploy.fused_inputs import FusedInputs
    from shuffleprune.deploy.producer_maps import MappedOutput
    from shuffleprune.deploy.sparse_linear import SparseLinear
    from shuffleprune.kernels import launch
    from shuffleprune.masks import nm_keep_mask
    from shuffleprune.perm.core import random_block_perm

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run on a GPU machine, or --smoke on CPU")
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch.manual_seed(0)
    width, rows = 1024, []

    def row(what: str, fn, per: int = 1) -> None:
        """``fn``'s host time, divided among the ``per`` calls it makes."""
        us = round(host_us(fn, sync, calls) / per, 2)
        rows.append({"what": what, "host_us_per_call": us})
        print(f"{what:60s} {us:9.2f} µs", flush=True)

    def sparse_layer(out: int, perm=None) -> SparseLinear:
        w = torch.randn(out, width)
        w = w * nm_keep_mask(w.abs(), 2, 4)
        values, meta = compress(w.to(dtype), 2, 4)
        return SparseLinear(values, meta, width, 2, 4, perm).to(device)

    x = torch.randn(1, 1, width, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    perm = random_block_perm(width, 64, gen)
    dense = torch.nn.Linear(width, width, bias=False, device=device, dtype=dtype)
    norm = LlamaRMSNorm(width).to(device, dtype)
    mapped_norm = MappedOutput(LlamaRMSNorm(width).to(device, dtype), perm.to(device))
    with torch.no_grad():
        row(f"nn.Linear {width}x{width}, 1 token (cuBLAS)", lambda: dense(x))
        row(f"LlamaRMSNorm {width}, 1 token (transformers, eager)", lambda: norm(x))
        row(f"MappedOutput(LlamaRMSNorm) {width}, 1 token (fused norm + map)", lambda: mapped_norm(x))
        if cuda:
            from shuffleprune.kernels.gather import gather_columns
            from shuffleprune.kernels.nm_decode import nm_decode

            p32 = perm.to(device=device, dtype=torch.int32)
            row(f"gather_columns {width}, 1 token (a bare Triton launch)", lambda: gather_columns(x, p32))
            with launch.enabled(False):
                row(f"gather_columns {width}, 1 token, Triton's dispatch (fast launches off)",
                    lambda: gather_columns(x, p32))
            plain = sparse_layer(width)
            words = plain.words()
            row(f"nm_decode {width}x{width}, 1 token, called directly",
                lambda: nm_decode(x, plain.values, words, 2, 4, plain.bits))
            row(f"nm_decode {width}x{width}, 1 token, as a dependent launch",
                lambda: nm_decode(x, plain.values, words, 2, 4, plain.bits, pdl=True))
            with launch.enabled(False):
                row(f"nm_decode {width}x{width}, 1 token, called directly, Triton's dispatch (fast launches off)",
                    lambda: nm_decode(x, plain.values, words, 2, 4, plain.bits))
            from shuffleprune.kernels.nm_sparse_mma import nm_sparse_mma, sparse_mma_available

            if sparse_mma_available(device):   # CUDA C++ through NVRTC: its launch by cuLaunchKernel, ctypes
                try:
                    row(f"nm_sparse_mma {width}x{width}, 1 token, called directly (cuLaunchKernel)",
                        lambda: nm_sparse_mma(x, plain.values, words))
                    row(f"nm_sparse_mma {width}x{width}, 1 token, reading the map, as a dependent launch",
                        lambda: nm_sparse_mma(x, plain.values, words, perm=p32, pdl=True))
                except RuntimeError as exc:   # it did not compile or launch here: the row says so
                    rows.append({"what": f"nm_sparse_mma {width}x{width}", "error": str(exc).splitlines()[0][:200]})
        else:
            plain = sparse_layer(width)
        row(f"SparseLinear {width}x{width}, no map, 1 token (auto, eager)", lambda: plain(x))
        mapped = sparse_layer(width, perm)
        row(f"SparseLinear {width}x{width}, 64-column block map, 1 token (auto, eager)", lambda: mapped(x))
        with launch.enabled(False):
            row(f"SparseLinear {width}x{width}, no map, 1 token (auto, eager), fast launches off", lambda: plain(x))
            row(f"SparseLinear {width}x{width}, 64-column block map, 1 token (auto, eager), fast launches off",
                lambda: mapped(x))
        q, k, v = (sparse_layer(r) for r in (width, width // 4, width // 4))
        group = FusedInputs([q, k, v])
        for member in (q, k, v):
            member.fused_inputs = group
        row("stacked q/k/v member call, 1 token (per member)", lambda: (q(x), k(x), v(x)), per=3)
        if cuda:
            choices = {"plain": plain.eager_choices, "mapped": mapped.eager_choices,
                       "stacked": group.stacked.eager_choices if group.stacked is not None else None}
        else:
            choices = None
    write_result(args, {"what": "host µs per eager call, real launches (queued, no synchronisation per call)",
                        "device": torch.cuda.get_device_name() if cuda else "cpu (smoke)", "dtype": str(dtype),
                        "width": width, "tokens": 1, "calls": calls, "seed": 0, "rows": rows,
                        "eager_choices": choices})


if __name__ == "__main__":
    main()
