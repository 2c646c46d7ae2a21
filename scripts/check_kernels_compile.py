"""Compile every Triton kernel path of the 2:4 runtime for an H100 (sm_90a) on a machine without a GPU.

    python scripts/check_kernels_compile.py           # issue 24's shapes → scripts/results/kernel_compile_sm90.json
    python scripts/check_kernels_compile.py --quick   # one shape: what the tests check
    python scripts/check_kernels_compile.py --jobs 2  # the same table, compiled in two processes
    python scripts/check_kernels_compile.py --gpu l40s   # for an L40S (sm_89, 99 KB of shared memory a
                                                         # program) → kernel_compile_sm89.json; --gpu a100: sm_80

On another GPU than Hopper the Tensor Memory Accelerator's kernels are left out (the runtime offers them
only on sm_90), and a launch whose kernel needs more shared memory than the GPU gives a program is
refused as Triton's loader refuses it there: the host functions then launch it with a shallower
pipeline (``kernels/gpu.py``'s ``with_fewer_stages``), and the row shows the depth that fits.

Runs the host functions SparseLinear calls (``nm_decode`` for 1–64 tokens with and without an index
map, at one token also with its pipeline a stage shallower (``decode_shallow``) and in the select loop's 32-row and 256-value tiles (``decode_tall``, ``decode_wide``, ``decode_mapped_tall``, ``decode_mapped_wide``; the gathered 256-value one at two tokens too), the select loop by kept value instead of by 2:4 group through the map at 1–2 tokens (``decode_mapped_by_value``), the resident-input decode (``decode_resident``, 1–2 tokens through the map, one token without; ``decode_resident_tma``: its weight tiles copied by the Tensor Memory Accelerator), the weight-as-A decode on the gathered input and reading the map itself (and with its weight tiles copied by the Tensor Memory Accelerator, ``decode_swap_tma``) (and a 64-column block map as 1-byte offsets), ``nm_gemm`` for prompts, each of its ``GEMM_TILES`` (2:4, 4:8) at 2048 tokens, ``nm_decompress_into`` for the shared scratch and ``nm_decompress_mapped_into`` for it in the input's order, the first kernels
``gather`` / ``group``, the producer-side ``rmsnorm_mapped``, the row gather ``gather_rows``, and ``…_pdl``: the gather kernel and the
decode or GEMM launched as programmatic dependents, as ``SparseLinear``'s ``+pdl`` choices run them) on bf16
(plus fp16/fp32 and 4:8 on one shape) with every launch compiled by Triton and ``ptxas`` for sm_90a instead of run
(``kernels/compile_check.py``). Each row: registers, spills, shared memory, programs per SM, waves,
the widest global load, the grid dependency instructions (``grid_dependency``: wait, release, L2
prefetches and the loads before the wait; ``launch_pdl``), whether the weight is loaded evict-first and whether ``tl.dot`` became
tensor-core instructions, the machine instructions of the main loop and its synchronous global
loads (``LDG``: what the pipeline left for the loop to wait on), and for decode the weight
traffic (TB/s) at which those instructions alone would fill every issue slot of an H100: below the
3.35 TB/s of HBM3 the kernel is instruction-bound whatever its loads do; for the GEMM the share of
the tensor cores' peak that ``nm_gemm.gemm_cycles`` expects from those instructions, and the TB/s of
input and weight tiles L2 would have to hand out at that pace (``l2_operand_tbs``). No timing: that needs the
GPU (``scripts/gpu_run.sh``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from shuffleprune.deploy.impls import (  # noqa: E402  (no Triton import)
    GEMM_KERNELS, MAPPED_DECODES, SWAP_TILES, TILE_MAX_TOKENS)

TILE_IMPLS = tuple(impl for impl in TILE_MAX_TOKENS   # the select loop's other tiles
                   if impl not in (*SWAP_TILES, "decode_swap_tma", "decode_resident", "decode_resident_tma"))
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (1024, 4096)]
DECODE_TOKENS = [1, 2, 4, 8, 16, 32, 64]
GEMM_TOKENS = [64, 512, 2048]
EXPERTS = 8   # the grouped MoE kernel's rows: a Mixtral-like layer (8 experts, top 2) of each shape


def cases(quick: bool) -> list[dict]:
    """What to compile: issue 24's shapes and token counts in bf16 with a random index map, and the
    other dtypes, 4:8 and the first kernels on the first shape."""
    shapes = SHAPES[:1] if quick else SHAPES
    out = []
    for rows, cols in shapes:
        for t in DECODE_TOKENS:
            out.append(dict(impl="decode", shape=(rows, cols), tokens=t))
        out.append(dict(impl="decode_nomap", shape=(rows, cols), tokens=1))
        out.append(dict(impl="decode_shallow", shape=(rows, cols), tokens=1))   # the select loop, 3 tiles in flight
        for impl in TILE_IMPLS:   # the select loop's 32-row and 256-value tiles, gathered input or map in the kernel
            out += [dict(impl=impl, shape=(rows, cols), tokens=t) for t in (1, 2)[:TILE_MAX_TOKENS[impl]]]
        for t in (16, 64) if quick else DECODE_TOKENS[1:]:
            out.append(dict(impl="decode_swap", shape=(rows, cols), tokens=t))
        for t in (1, 2):   # the resident-input decode, reading the map itself as SparseLinear runs it (and
            out.append(dict(impl="decode_resident", shape=(rows, cols), tokens=t))   # with TMA-copied tiles)
            out.append(dict(impl="decode_resident_tma", shape=(rows, cols), tokens=t))
        out.append(dict(impl="decode_resident_nomap", shape=(rows, cols), tokens=1))   # and a layer without a map
        for t in (2, 16):   # the half step and the 32-row synchronous-mma tile auto also times, 2:4 at 2–16 tokens
            out += [dict(impl=impl, shape=(rows, cols), tokens=t) for impl in (*SWAP_TILES, "decode_swap_tma")]
        for t in (32, 64):   # the TMA-fed decode's 128-column step and the broadcast expansion (SparseLinear weighs
            out.append(dict(impl="decode_swap_tma", shape=(rows, cols), tokens=t))   # both to 64 tokens)
            out.append(dict(impl="decode_swap_spread", shape=(rows, cols), tokens=t))
        for t in (4, 16) if quick else DECODE_TOKENS[2:5]:   # SparseLinear times it to 16 tokens
            out.append(dict(impl="decode_mapped", shape=(rows, cols), tokens=t))
        for t in (1, 16) if quick else DECODE_TOKENS[:5]:     # prune's 64-column block map read as offsets
            out.append(dict(impl="decode_blockmap", shape=(rows, cols), tokens=t))
        for t in GEMM_TOKENS[:1] if quick else GEMM_TOKENS:
            out += [dict(impl=impl, shape=(rows, cols), tokens=t) for impl in GEMM_KERNELS]
        out.append(dict(impl="scratch", shape=(rows, cols), tokens=0))
        out.append(dict(impl="scratch_mapped", shape=(rows, cols), tokens=0))
    from shuffleprune.kernels.nm_gemm import gemm_tiles

    rows, cols = SHAPES[0]
    for kernel, options in GEMM_KERNELS.items():   # each tile of each GEMM's table: "gemm_tile", "gemm_swap_tile", ...
        for pattern, tiles in gemm_tiles(**options).items():
            for index in range(len(tiles)):
                out.append(dict(impl=f"{kernel}_tile", shape=(rows, cols), tokens=2048, tile=index, pattern=pattern))
    for dtype in ("float16", "float32"):
        for t in (1, 16) if dtype == "float32" else (1, 16, 64):
            out.append(dict(impl="decode", shape=(rows, cols), tokens=t, dtype=dtype))
        out.append(dict(impl="gemm", shape=(rows, cols), tokens=64, dtype=dtype))
    for t in (1, 16, 32, 64):
        out.append(dict(impl="decode", shape=(rows, cols), tokens=t, pattern=(4, 8)))
    for t in (16, 32, 64):
        out.append(dict(impl="decode_swap", shape=(rows, cols), tokens=t, pattern=(4, 8)))
    out.append(dict(impl="gemm", shape=(rows, cols), tokens=64, pattern=(4, 8)))
    if not quick:
        for impl in ("gather", "group"):
            for t in (1, 16):
                out.append(dict(impl=impl, shape=(rows, cols), tokens=t))
    for t in (1, 2, 16, 64):   # positions in cuSPARSELt's order (SparseLinear.use_cslt_layout): "…_tiled" rows
        out.append(dict(impl="decode", shape=(rows, cols), tokens=t, tiled=True))
    for impl in ("decode_swap", "decode_swap_sync", "decode_swap_spread", "decode_swap_spread_sync"):   # joined and
        # by broadcasts
        out.append(dict(impl=impl, shape=(rows, cols), tokens=16, tiled=True))
    out.append(dict(impl="scratch", shape=(rows, cols), tokens=0, tiled=True))
    for t in (1, 16, 64):   # a MoE layer's 8 experts (top 2) in one grouped launch: 2, 32, 128 pairs
        for impl in ("experts", "experts_mapped"):
            out.append(dict(impl=impl, shape=(rows, cols), tokens=t))
    for t, experts, top_k in ((1, 8, 2), (32, 8, 2), (8, 512, 8)):   # the routing alone, one launch: 2–64 pairs
        out.append(dict(impl="route_blocks", shape=(experts, top_k), tokens=t))
    for width in ([4096] if quick else [4096, 11008, 14336]):
        out.append(dict(impl="rmsnorm_mapped", shape=(0, width), tokens=1))
        for t in (16, 2048):   # the row gather (whole rows staged in shared memory), as a dependent
            out.append(dict(impl="gather_rows", shape=(0, width), tokens=t))
    out.append(dict(impl="gather_rows", shape=(0, 28672), tokens=2048))   # its widest 16-bit row: 32768 padded
    out.append(dict(impl="gather_rows", shape=(0, 8192), tokens=2048, dtype="float32"))
    for t in (1, 16):   # launched as programmatic dependents (SparseLinear's "+pdl" choices): gather, then decode
        out.append(dict(impl="decode_pdl", shape=(rows, cols), tokens=t))
    out.append(dict(impl="decode_swap_pdl", shape=(rows, cols), tokens=16))
    for t in (1, 4):   # the in-kernel map (select loop, then the weight-as-A kernel)
        out.append(dict(impl="decode_mapped_pdl", shape=(rows, cols), tokens=t))
    for t in (1, 2):   # the resident-input decode: its map read before the wait, its inputs after; its first rows prefetched
        out.append(dict(impl="decode_resident_pdl", shape=(rows, cols), tokens=t))
    for t in (1, 16):   # in cuSPARSELt's buffer (load's default on Hopper): its position words prefetched by slices
        out.append(dict(impl="decode_pdl", shape=(rows, cols), tokens=t, tiled=True))
    for impl in ("gemm_pdl", "gemm_swap_pdl"):   # the GEMMs as dependents at 64 tokens: gather, then GEMM
        out.append(dict(impl=impl, shape=(rows, cols), tokens=GEMM_TOKENS[0]))
    return out


def offered(case: dict, arch: int) -> bool:
    """Whether the runtime launches ``case``'s kernel on a GPU of architecture ``arch``: the kernels
    whose weight tiles the Tensor Memory Accelerator copies need Hopper (sm_90); ``SparseLinear``
    offers them nowhere else. (A ``…_pdl`` case runs there as a plain launch.)"""
    return arch >= 90 or not case["impl"].endswith("_tma")


def run_case(case: dict) -> None:
    """Call the host function of ``case`` once (its launch is compiled, not run)."""
    import torch

    from shuffleprune.deploy.format import meta_bits
    from shuffleprune.deploy.impls import DECODE_KERNELS
    from shuffleprune.kernels import nm_decode, nm_gemm, nm_matmul, nm_words, norm_map

    rows, cols = case["shape"]
    dtype = getattr(torch, case.get("dtype", "bfloat16"))
    n, m = case.get("pattern", (2, 4))
    bits = meta_bits(m)
    perm = torch.randperm(cols, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    impl, tokens, tiled = case["impl"], max(1, case["tokens"]), case.get("tiled", False)
    if impl == "rmsnorm_mapped":
        norm_map.rmsnorm_mapped(torch.zeros(tokens, cols, dtype=dtype), torch.ones(cols), perm, 1e-6)
        return
    if impl == "gather_rows":
        from shuffleprune.kernels.gather import gather_rows

        gather_rows(torch.zeros(tokens, cols, dtype=dtype), perm, pdl=True)
        return
    if impl == "route_blocks":   # shape: (experts, top_k); each token's top_k experts in turn
        from shuffleprune.kernels.nm_experts import experts_block_t, route_blocks

        experts, top_k = case["shape"]
        ids = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
        route_blocks(ids, experts, experts_block_t(ids.numel(), experts), kernel=True)
        return
    kept = cols // m * n
    if impl.startswith("experts"):   # 8 experts stacked, each token routed to 2 of them
        from shuffleprune.kernels.nm_experts import nm_experts

        values = torch.zeros(EXPERTS, rows, kept, dtype=dtype)
        words = torch.zeros(EXPERTS, rows, -(-kept * bits // 32), dtype=torch.int32)
        ids = torch.arange(tokens * 2).remainder(EXPERTS).view(tokens, 2)
        maps = perm.expand(EXPERTS, cols).contiguous() if impl == "experts_mapped" else None
        nm_experts(torch.zeros(tokens, cols, dtype=dtype), values, words, n, m, bits, ids, 2, maps)
        return
    values = torch.zeros(rows, kept, dtype=dtype)
    meta = torch.zeros(rows, -(-kept * bits // 8), dtype=torch.uint8)
    words = nm_words.position_words(meta)
    x = torch.zeros(tokens, cols, dtype=dtype)
    if impl.endswith("_pdl"):   # as SparseLinear runs "decode+pdl", "gemm+pdl": the gather kernel, then the kernel
        from shuffleprune.kernels.gather import gather_columns

        kernel = impl.removesuffix("_pdl")
        if kernel in GEMM_KERNELS:
            nm_gemm.nm_gemm(gather_columns(x, perm, pdl=True), values, words, n, m, bits, pdl=True,
                            **GEMM_KERNELS[kernel])
        elif kernel == "decode_resident":
            from shuffleprune.kernels.nm_resident import nm_decode_resident

            nm_decode_resident(x, values, words, n, m, bits, perm, pdl=True, tiled=tiled)
        elif kernel == "decode_mapped":   # no gather: the decode reads the map itself, after its wait
            nm_decode.nm_decode(x, values, words, n, m, bits, perm, pdl=True, tiled=tiled, **DECODE_KERNELS[kernel])
        else:
            nm_decode.nm_decode(gather_columns(x, perm, pdl=True), values, words, n, m, bits, pdl=True, tiled=tiled,
                                **DECODE_KERNELS[kernel])
    elif impl in ("decode_resident", "decode_resident_nomap", "decode_resident_tma"):
        from shuffleprune.kernels.nm_resident import nm_decode_resident

        nm_decode_resident(x, values, words, n, m, bits, perm if impl != "decode_resident_nomap" else None, tiled=tiled,
                           tma=impl == "decode_resident_tma")
    elif impl == "decode_blockmap":   # the map within 64-column blocks as 1-byte offsets, read in the kernel
        from shuffleprune.perm.core import random_block_perm

        block = random_block_perm(cols, 64, torch.Generator().manual_seed(0)).to(torch.int32)
        nm_decode.nm_decode(x, values, words, n, m, bits, perm=block, tiled=tiled,
                            block_map=(nm_decode.block_map_offsets(block, 64), 64), **DECODE_KERNELS["decode_mapped"])
    elif impl in ("decode", "decode_nomap", "decode_shallow"):
        nm_decode.nm_decode(x, values, words, n, m, bits, perm=perm if impl != "decode_nomap" else None, tiled=tiled,
                            **DECODE_KERNELS.get(impl, {}))
    elif impl in TILE_IMPLS:   # as SparseLinear runs them: the gathered input, or (MAPPED_DECODES) the map read
        nm_decode.nm_decode(x, values, words, n, m, bits, perm=perm if impl in MAPPED_DECODES else None,
                            tiled=tiled, **DECODE_KERNELS[impl])
    elif impl in ("decode_swap", *SWAP_TILES, "decode_swap_tma", "decode_mapped"):   # as SparseLinear runs them (the
        # mapped one reading the map)
        nm_decode.nm_decode(x, values, words, n, m, bits, perm=perm if impl == "decode_mapped" else None, tiled=tiled,
                          **DECODE_KERNELS[impl])
    elif impl in GEMM_KERNELS:
        nm_gemm.nm_gemm(x, values, words, n, m, bits, **GEMM_KERNELS[impl])
    elif is_tile_case(impl):   # one tile of the GEMM's table, unsplit
        options = GEMM_KERNELS[impl.removesuffix("_tile")]
        nm_gemm.nm_gemm(x, values, words, n, m, bits, tile=nm_gemm.gemm_tiles(**options)[(n, m)][case["tile"]][0],
                        weight_a=options.get("weight_a", False))
    elif impl == "scratch_mapped":   # the weight written in the input's order (the map's inverse applied)
        nm_gemm.nm_decompress_mapped_into(values, words, n, m, bits, cols, perm, torch.empty(rows * cols, dtype=dtype))
    elif impl == "scratch":
        nm_gemm.nm_decompress_into(values, words, n, m, bits, cols, torch.empty(rows * cols, dtype=dtype), tiled=tiled)
    else:
        nm_matmul.nm_gather_matmul(x, values, meta, n, m, bits, perm=perm, variant=impl)


def decode_ceilings(row: dict, case: dict, spec) -> tuple[float | None, float | None]:
    """TB/s of weight traffic at which decode's loop would use every issue slot of ``spec``'s GPU
    (``compile_check.issue_ceiling_tbs``), and all of its shared-memory bandwidth
    (``compile_check.shared_ceiling_tbs``): per iteration a program reads ``BLOCK_R × BLOCK_K`` kept
    values and their position bits."""
    import torch

    from shuffleprune.deploy.format import meta_bits
    from shuffleprune.kernels.compile_check import issue_ceiling_tbs, shared_ceiling_tbs

    c = row["constexprs"]
    per_value = getattr(torch, case.get("dtype", "bfloat16")).itemsize + meta_bits(case.get("pattern", (2, 4))[1]) / 8
    weight = c["BLOCK_R"] * c["BLOCK_K"] * per_value
    issue = issue_ceiling_tbs(weight, row["loop_instructions"], row["num_warps"], spec)
    shared = shared_ceiling_tbs(weight, row["loop_shared_bytes"], row["num_warps"], spec)
    return tuple(None if ceiling is None else round(ceiling, 2) for ceiling in (issue, shared))


def decode_plan_per_sm(case: dict, spec, stages: int | None = None) -> int:
    """The programs per SM ``decode_plan`` sized its split-K for on ``spec``'s GPU at the launch's pipeline
    depth ``stages`` (at most what the compile gives)."""
    import torch

    from shuffleprune.deploy.format import meta_bits
    from shuffleprune.deploy.impls import DECODE_KERNELS
    from shuffleprune.kernels import decode_tiles
    from shuffleprune.kernels.compile_check import compile_only

    (rows, cols), (n, m) = case["shape"], case.get("pattern", (2, 4))
    if case["impl"].startswith("decode_resident"):   # its chunks × row ranges over the SMs
        from shuffleprune.kernels.gpu import cdiv
        from shuffleprune.kernels.nm_resident import resident_plan

        plan = resident_plan(rows, cols // m * n, case["tokens"], spec.sms)
        return cdiv(plan["split"] * plan["ranges"], spec.sms)
    kernel = dict(DECODE_KERNELS.get(case["impl"].removesuffix("_pdl"), {}))   # decode, decode_nomap: the plan's own
    if stages is not None:
        kernel["stages"] = stages
    with compile_only(spec):   # planned with that GPU's SM count and shared memory
        plan = decode_tiles.decode_plan(rows, cols // m * n, case["tokens"], n, m, meta_bits(m), torch.device("cpu"),
                                     element_bytes=getattr(torch, case.get("dtype", "bfloat16")).itemsize, **kernel)
    return plan["per_sm"]


def is_tile_case(impl: str) -> bool:
    """Whether ``impl`` names a case that compiles one tile of a GEMM's table (``gemm_swap_tile``, ...)."""
    return impl.endswith("_tile") and impl.removesuffix("_tile") in GEMM_KERNELS


def gemm_share_and_l2_rate(row: dict, spec) -> tuple[float, float]:
    """The share of the tensor cores' peak that :func:`nm_gemm.gemm_cycles` expects of this GEMM
    launch on ``spec``'s GPU (its cost model's tensor-core rate is Hopper's), from its compiled loop and residency, and the TB/s of operands
    (:func:`nm_gemm.operand_bytes`) L2 would hand out at that pace: above the 5.9–6.5 TB/s the 64-row
    weight-as-A tiles drew at 2048 tokens, L2 binds first."""
    import torch

    from shuffleprune.deploy.format import meta_bits
    from shuffleprune.kernels import nm_gemm

    c = row["constexprs"]
    tile = (c["BLOCK_T"], c["BLOCK_R"], c["BLOCK_C"], row["num_warps"], row["num_stages"])
    (rows, cols), tokens = row["shape"], row["tokens"]
    cycles = nm_gemm.gemm_cycles(tokens, rows, cols, tile, row["loop_instructions"], row["programs_per_sm"], spec.sms,
                                 c["SPLIT"], overlap=bool(c.get("WEIGHT_A")))
    ideal = 2 * tokens * rows * cols / nm_gemm.TENSOR_FLOP_PER_CYCLE / spec.sms
    n, m = (int(v) for v in row["pattern"].split(":"))
    operands = nm_gemm.operand_bytes(tokens, rows, cols, tile, c["SPLIT"], n, m, meta_bits(m),
                                     getattr(torch, row["dtype"]).itemsize)
    return round(ideal / cycles, 2), round(operands / (cycles / (spec.clock_ghz * 1e9)) / 1e12, 2)


def compile_cases(indexed: list[tuple[int, dict]], gpu: str = "h100") -> list[tuple[int, dict]]:
    """Compile each ``(index, case)`` for the GPU ``gpu`` names (``compile_check.SPECS``) and report its
    launches: ``(index, row)`` pairs, a case that fails to compile one row with its error."""
    from shuffleprune.kernels.compile_check import SPECS, compile_only, report
    from shuffleprune.kernels.nm_gemm import gemm_tiles

    spec = SPECS[gpu]
    rows: list[tuple[int, dict]] = []
    for index, case in indexed:
        label = {"impl": case["impl"] + ("_tiled" if case.get("tiled") else ""), "shape": list(case["shape"]),
                 "tokens": case["tokens"], "dtype": case.get("dtype", "bfloat16"),
                 "pattern": "{}:{}".format(*case.get("pattern", (2, 4)))}
        try:
            with compile_only(spec) as launches:
                run_case(case)
            for launch in launches:
                if launch.kernel == "_sum_partials_kernel":  # split-K's elementwise sum: compiled, not reported
                    continue
                row = {**label, **report(launch, spec)}
                if launch.kernel == "_gather_columns_kernel":   # a "_pdl" case's gather before its decode
                    rows.append((index, {**row, "impl": "gather_columns_pdl"}))
                    continue
                if launch.kernel == "_gather_pairs_kernel":   # mapped experts: the pairs' gather before the kernel
                    rows.append((index, {**row, "impl": "gather_pairs"}))
                    continue
                if case["impl"].startswith(("decode", "experts")):
                    row["issue_ceiling_tbs"], row["shared_ceiling_tbs"] = decode_ceilings(row, case, spec)
                if case["impl"].startswith("decode"):
                    row["plan_per_sm"] = decode_plan_per_sm(case, spec, row["constexprs"].get("STAGES"))
                if case["impl"].startswith("gemm") and row["loop_instructions"] and row["dtype"] != "float32":
                    row["tensor_share"], row["l2_operand_tbs"] = gemm_share_and_l2_rate(row, spec)
                if is_tile_case(case["impl"]):
                    table = gemm_tiles(**GEMM_KERNELS[case["impl"].removesuffix("_tile")])
                    row["table_loop"], row["table_per_sm"] = table[case["pattern"]][case["tile"]][1:]
                rows.append((index, row))
        except Exception as exc:  # noqa: BLE001 - a kernel that does not compile is a result, recorded
            rows.append((index, {**label, "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"}))
        r = rows[-1][1]
        print(f"{r['impl']:>14} {r['dtype']:>8} {r['pattern']} {str(tuple(r['shape'])):>14} t={r['tokens']:<5}"
              + (f" ERROR {r['error']}" if "error" in r else
                 f" regs {r['registers']:3d} spill {r['spill_bytes']:4d} smem {r['shared_bytes']:6d} "
                 f"progs/SM {r['programs_per_sm']:2d} waves {r['waves']:6.2f} load {r['widest_load_bytes']:2d}B "
                 f"evict_first {r['evict_first']} async {r['async_copies']} tc {r['tensor_core']} "
                 f"loop {r['loop_instructions']} (LDG {r['loop_sync_loads']}) ceiling {r.get('issue_ceiling_tbs')} "
                 f"shared {r.get('shared_ceiling_tbs')} tensor {r.get('tensor_share')} "
                 f"L2 {r.get('l2_operand_tbs')}"), flush=True)
    return rows


def compile_in_processes(indexed: list[tuple[int, dict]], jobs: int, gpu: str) -> list[tuple[int, dict]]:
    """:func:`compile_cases` in ``jobs`` processes (each compiling every ``jobs``-th case), their
    ``(index, row)`` pairs together."""
    import functools
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        shards = pool.map(functools.partial(compile_cases, gpu=gpu), [indexed[shard::jobs] for shard in range(jobs)])
        return [pair for shard in shards for pair in shard]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the first shape only (what the tests check)")
    ap.add_argument("--gpu", choices=("h100", "a100", "l40s"), default="h100",
                    help="the GPU to compile for: h100 (sm_90a), a100 (sm_80) or l40s (sm_89)")
    ap.add_argument("--out", help="the table (default: scripts/results/kernel_compile_sm<arch>.json)")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many processes (the table is the same)")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")

    from shuffleprune.kernels.compile_check import SPECS
    from shuffleprune.outdir import atomic_write
    from shuffleprune.runtime.facts import machine, versions

    spec = SPECS[args.gpu]
    out = Path(args.out or ROOT / "scripts" / "results" / f"kernel_compile_sm{spec.arch}.json")
    t0 = time.time()
    indexed = list(enumerate(case for case in cases(args.quick) if offered(case, spec.arch)))
    pairs = compile_in_processes(indexed, args.jobs, args.gpu) if args.jobs > 1 else compile_cases(indexed, args.gpu)
    rows = [row for _, row in sorted(pairs, key=lambda pair: pair[0])]   # case order (stable within a case)
    failed = sum("error" in r for r in rows)
    summary = {
        "compiled": sum("error" not in r for r in rows), "failed": failed,
        "with_spills": sum(r.get("spill_bytes", 0) > 0 for r in rows),
        "not_fitting": sum(r.get("fits") is False for r in rows),
    }
    result = {
        "what": f"Triton kernels of the 2:4 runtime compiled for {spec.name} without a GPU (no timing)",
        "target": spec.name, "machine": machine(), "versions": versions("triton"),
        "command": "python " + " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "seconds": round(time.time() - t0, 1), "summary": summary, "rows": rows,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda tmp: tmp.write_text(json.dumps(result, indent=1) + "\n"))
    print(json.dumps(summary))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
