"""Compile the sparse-tensor-core kernels a GPU run will ask for before it asks: every variant of the sparse-MMA
decode (``kernels/nm_sparse_mma.cu``) and of the prompt GEMM in both its forms (``kernels/nm_sparse_gemm.cu``: mma.sp,
and Hopper's wgmma with its decode tiles) that issue 24's shapes, ``bench_e2e``'s layers and the tuning steps launch,
in both position layouts, by NVRTC in parallel processes into the cubin cache (``cuda_rtc.cached_cubin``). A step that
then asks for one loads it instead of compiling it (about a second each, one after another, inside the step's time
limit). It makes no CUDA context: the target is GPU 0's, asked of the driver, or named.

    python scripts/compile_ahead.py --jobs 12                    # GPU 0's, asked of the driver (no context made):
                                                                 # gpu_run.sh starts it beside its first step
    python scripts/compile_ahead.py --capability 9.0 --list      # the variants counted, nothing compiled

A variant the steps never ask for costs a worker a second; one they ask for that is not here is compiled by the step
as before. The sources are the ones the runtime builds (``kernel_defines`` → ``variant_source``), so a cubin kept here
is found under the same name (source, kernel, target and NVRTC version hashed).
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shuffleprune.kernels.cuda_rtc import CudaSource

ROOT = Path(__file__).resolve().parents[1]
# the sparse_mma step's shapes first (the first kernels asked for), then the rest of bench_kernel's, then bench_e2e's
# stacked layers (q/k/v, gate/up)
SHAPES = [(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096), (11008, 4096), (4096, 11008), (12288, 4096),
          (22016, 4096)]
TOKENS = [1, 2, 4, 8, 16, 32, 64]
GEMM_STAGES = (3, 4)          # gpu_run.sh: sparse_gemm --stages 3, tune_sparse_gemm --stages 4
WGMMA_STAGES = (3, 4, 5)      # sparse_gemm --wgmma-stages 4, tune_sparse_gemm 3 5


def decode_sources(sms: int, hopper: bool) -> list[CudaSource]:
    """The decode's variants: the plans of :func:`kernel_cases.sparse_mma_variants` (programmatic dependents too on
    Hopper), and those reading a map also without their L2 prefetch (``tune_sparse_mma --prefetch 0``)."""
    import torch
    from kernel_cases import sparse_mma_variants

    from shuffleprune.kernels import nm_sparse_mma as sm, sparse_mma_tiles as tiles

    ordered = sm.ordered_metadata()
    out = []
    for v in sparse_mma_variants(SHAPES, TOKENS, sms, TOKENS if hopper else ()):
        plans = [v["plan"]]
        if v["mapped"] and not v["tall"] and not v["inline"]:
            plans.append(tiles.sparse_mma_plan(v["tokens"], *v["shape"], sms=sms, mapped=True, prefetch=False))
        for plan, tiled in itertools.product(plans, (True, False)):
            defines = sm.kernel_defines(plan, torch.bfloat16, tiled, False, ordered, v["mapped"], v["pdl"])
            out.append(sm.variant_source(defines))
    return out


def gemm_sources(hopper: bool) -> list[CudaSource]:
    """The prompt GEMM's variants: every mma.sp tile with :data:`GEMM_STAGES`; on Hopper every wgmma tile, its decode
    tiles and the mapped decode's with :data:`WGMMA_STAGES`."""
    import torch
    from kernel_cases import wgmma_gemm_forms

    from shuffleprune.kernels import nm_sparse_gemm as sg, sparse_gemm_tiles as gemm_tiles
    from shuffleprune.kernels.nm_sparse_mma import ordered_metadata

    forms = [(tile, stages, False, False) for tile in gemm_tiles.GEMM_TILES for stages in GEMM_STAGES]
    if hopper:
        forms += [(tile, stages, True, mapped) for tile, mapped in wgmma_gemm_forms() for stages in WGMMA_STAGES]
    out = []
    for (tile, stages, wgmma, mapped), tiled in itertools.product(forms, (True, False)):
        plan = gemm_tiles.SparseGemmPlan(*tile, stages=stages, wgmma=wgmma, mapped=mapped)
        out.append(sg.variant_source(sg.kernel_defines(plan, torch.bfloat16, tiled, False, ordered_metadata())))
    return out


def ahead_sources(capability: tuple[int, int], sms: int) -> list[CudaSource]:
    """Every variant to compile for a GPU of ``capability``, each once, in the order the steps first ask for them."""
    if capability < (8, 0):   # no sparse tensor cores: nothing of these runs
        return []
    hopper = capability[0] == 9
    return list(dict.fromkeys([*decode_sources(sms, hopper), *gemm_sources(hopper)]))


def driver_gpu(index: int = 0) -> tuple[tuple[int, int], int]:
    """``((major, minor), SMs)`` of GPU ``index`` asked of the CUDA driver (``cuInit`` makes no context and takes
    no GPU memory, so the steps beside this process are untouched); a SystemExit where no driver answers."""
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise SystemExit("no CUDA driver here: give --capability (and --sms) to compile for a GPU elsewhere") from None
    device, values = ctypes.c_int(), []
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), index):
        raise SystemExit(f"the CUDA driver has no GPU {index}: give --capability (and --sms)")
    for attribute in (75, 76, 16):   # compute capability major, minor; multiprocessors (cuda.h's CUdevice_attribute)
        value = ctypes.c_int()
        cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, device)
        values.append(value.value)
    return (values[0], values[1]), values[2]


_NVRTC = None


def _compile(job: tuple) -> tuple[str, float, str]:
    """One variant into the cubin cache: ``("kept" | "compiled" | "failed", seconds, error)``."""
    from shuffleprune.kernels import cuda_rtc

    global _NVRTC
    source, arch = job
    t0 = time.perf_counter()
    try:
        _NVRTC = _NVRTC or cuda_rtc.own_nvrtc()
        compiled = cuda_rtc.cached_cubin(source.text, source.name, arch, _NVRTC)[1]
        return ("compiled", time.perf_counter() - t0, "") if compiled else ("kept", 0.0, "")
    except Exception as exc:  # noqa: BLE001 - one variant that NVRTC refuses: the step that asks says why
        return "failed", time.perf_counter() - t0, str(exc).splitlines()[0][:200]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capability", help="the GPU's compute capability, e.g. 9.0 (default: GPU 0's, asked of the "
                                         "CUDA driver)")
    ap.add_argument("--sms", type=int, help="its SMs (default: GPU 0's, or with --capability 132: an H100 SXM's and "
                                            "an H200's)")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 4))
    ap.add_argument("--list", action="store_true", help="count the variants, compile nothing")
    args = ap.parse_args()
    if args.capability is None:
        capability, sms = driver_gpu()
    else:
        try:
            capability, sms = tuple(int(p) for p in args.capability.split("."))[:2], 132
        except ValueError:
            raise SystemExit(f"--capability {args.capability!r}: give major.minor, e.g. 9.0") from None
    sms = args.sms or sms
    sys.path.insert(0, str(ROOT / "scripts"))
    from shuffleprune.kernels.cuda_rtc import gpu_arch

    sources = ahead_sources(capability, sms)
    jobs = [(s, gpu_arch(capability, s.arch_specific)) for s in sources]
    targets = sorted({arch for _, arch in jobs})
    if args.list or not jobs:
        print(f"compile_ahead: {len(jobs)} variants for {', '.join(targets) or 'no target'}, {sms} SMs (listed, none "
              "compiled)")
        return
    t0 = time.perf_counter()
    # forked workers: they start with this process's imports (no second torch import each) and touch no GPU
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_compile, jobs))
    counts = {k: sum(r[0] == k for r in results) for k in ("compiled", "kept", "failed")}
    busy = sum(r[1] for r in results)
    print(f"compile_ahead: {len(jobs)} variants for {', '.join(targets)}, {sms} SMs: {counts['compiled']} compiled "
          f"({busy:.0f} s of NVRTC), {counts['kept']} kept already, {counts['failed']} failed, in "
          f"{time.perf_counter() - t0:.0f} s on {args.jobs} processes")
    for (source, arch), (kind, _, error) in zip(jobs, results):
        if kind == "failed":
            print(f"  {source.name} ({arch}): {error}")


if __name__ == "__main__":
    main()
