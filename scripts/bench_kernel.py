"""Benchmark the N:M linear implementations against dense cuBLAS on a GPU (issue 24's table).

    python scripts/bench_kernel.py                 # CUDA → scripts/results/bench_kernel.json
    python scripts/bench_kernel.py --smoke         # CPU, TRITON_INTERPRET=1, tiny shapes: code paths only
    python scripts/bench_kernel.py --warm --shapes 4096x4096   # compile only (Triton's disk cache), nothing timed

``--warm`` runs every case once on one weight copy and writes nothing. ``--warm-jobs J`` first starts
such a process per shape and half of the token counts, J side by side, so Triton compiles on the
machine's cores at once and the timed run (one process, one shape after another, nothing else on
the GPU) finds every kernel in its disk cache; a warm process that fails only leaves its kernels to
be compiled by the timed run. One that ends at a kernel faulting the GPU (an illegal address: a
``DeviceFault`` naming it) is run again without that kernel, and the timed run leaves it out too
(``SHUFFLEPRUNE_SKIP_IMPLS``, its rows an error, the file's ``skipped_impls``), so one bad kernel does
not cost the table; a fault in the timed run ends it, the rows so far and the kernel in the file.
``--warm-serving`` adds a process per layer of ``bench_e2e``'s model (mapped or not, stacked, in
cuSPARSELt's buffer), so the end-to-end run that follows compiles little.

For every weight shape ``[out, in]`` and token count, bf16, a random 2:4 mask in permuted column
order and a random index map: ``dense`` (F.linear, cuBLAS), ``auto`` (what ``SparseLinear`` runs),
and each candidate (``decode``: the input gathered through the map by one small kernel, then the
decode kernel; ``decode_shallow`` (1–2 tokens): the same with its pipeline a tile shallower;
``decode_tall`` / ``decode_wide`` (one token; ``_wide`` also at two): the select loop's 32-row or
256-value tile; ``decode_mapped``: the kernel reading the map itself (``_tall``, ``_wide``: in those
tiles, one token; ``_by_value``: 1–2 tokens, its select loop per kept value, not by 2:4 group);
``auto_tiled`` (the table's default too: the layer as ``shuffleprune.load`` holds it on Hopper, one
cuSPARSELt buffer, where ``auto`` also weighs cuSPARSELt's GEMM from 17 tokens);
``decode_resident`` (1–2 tokens): the kernel that reads each chunk's inputs once, through the map, and
streams rows past them (``kernels/nm_resident.py``; ``decode_resident_nomap`` on a layer without a map,
``decode_resident+pdl`` launched as a programmatic dependent, ``decode_resident_tma`` with its weight tiles copied
by the Tensor Memory Accelerator);
``decode_nomap``: a layer
without a map on the already-permuted input — the map's cost is the others' ratio to it —,
``decode_select`` and ``decode_swap`` (2–64 tokens: the select loop, the tensor-core decode with the
weight as the MMA's A operand), ``decode_swap_narrow`` (2–16 tokens: ``decode_swap`` with half its step), ``decode_swap_sync`` (2–16 tokens: on
32 rows of 2 warps, the synchronous ``mma``), ``decode_swap_spread`` (2–64 tokens) and ``decode_swap_spread_sync`` (2–16:
``decode_swap`` and ``decode_swap_sync`` with the tile expanded by broadcasts, straight into the MMA's operand
layout), ``decode_swap_tma`` (2–64 tokens: its weight tiles copied by the
Tensor Memory Accelerator; ``decode_swap_tma_tiled`` on the cuSPARSELt buffer), ``decode_sparse_mma`` (1–64
tokens: the decode on the sparse tensor cores, ``kernels/nm_sparse_mma.cu``; ``_nomap`` and ``_tiled`` too;
``decode_sparse_mma_mapped``, 1–16 tokens: the same reading the map itself; both ``_tiled+pdl`` as well;
``decode_sparse_mma_mapped_inline`` (and ``_tiled``), 1–16 tokens: the map read by each B load, nothing staged;
``decode_sparse_mma_tall_tiled`` from 4 tokens and ``decode_sparse_mma_mapped_tall_tiled`` from one: both with the
tall plan's CTAs, the input staged in shared memory and shared by more rows), ``gemm_sparse_mma`` and
``gemm_sparse_mma_tiled`` (from 32 tokens: the prompt GEMM on the sparse tensor cores, ``kernels/nm_sparse_gemm.cu``),
``gemm_sparse_wgmma_tiled`` (from 1 token: the same GEMM on Hopper's ``wgmma.mma_async.sp``, a decode up to 64
tokens; ``gemm_sparse_wgmma`` on the export's layout when named; ``_nomap_tiled`` at one token and
``gemm_sparse_wgmma_mapped_tiled`` at 1–16, the latter reading the map itself: the map's cost to that decode),
``gemm``, ``gemm_swap``,
``gemm_swap_tall`` (from 17 tokens: ``gemm_swap`` on 128 weight rows per program), ``scratch``, ``scratch_mapped`` (from 17
tokens: the map applied to the weight written into the scratch, no gathered input), the first kernel ``gather``; only
when named in ``--impls``: the first ``group`` kernel, PyTorch's 2:4 tensors ``semi_structured`` and
``semi_cutlass`` (from 64 tokens), and cuSPARSELt called directly with its searched algorithm on a
compressed copy, ``cslt``; ``cslt_tiled``, cuSPARSELt on the layer's own buffer, is timed at every token
count, its tokens padded to a multiple of 8 as ``SparseLinear`` pads them). A ``_nomap`` suffix runs that policy on a layer without a map, on the already
permuted input (``auto_nomap``: what a layer whose map moved to its producer runs). A ``_tiled`` suffix
(``auto_tiled``, ``decode_tiled``) runs that policy on a layer holding its weight as one cuSPARSELt
buffer (``SparseLinear.use_cslt_layout``: ``auto`` then also times ``cslt`` on it). A ``+pdl`` suffix
(``decode+pdl``, ``decode_swap+pdl``, ``decode_nomap+pdl``) launches the decode, and the Triton gather
before it, as programmatic dependents (``kernels/overlap.py``, Hopper): each call's kernels start
while the previous call's end and prefetch their weight's first part into L2 (``map_cost_pdl`` in the
summary: ``decode+pdl`` over ``decode_nomap+pdl``). ``norm_rows``: the producer-side alternative for a shared map —
an RMSNorm (``rmsnorm``), the same followed by a gather (``rmsnorm+gather``), and the fused norm
writing its output through the map (``rmsnorm_mapped``, ``kernels/norm_map.py``), per input width;
beside them a mapped layer's gather alone, PyTorch's ``index_select`` (``gather``), the Triton
gather of the ``+pdl`` choices launched plainly (``gather_columns``, ``kernels/gather.py``) and the
row gather that stages whole rows in shared memory (``gather_rows``); a layer's gathers run whichever
of the three ``deploy/input_gather.py`` measured fastest for that width and token count.

Timing: every implementation runs on ``copies`` separate weight copies in turn (at least 4, and
together more than 2.5× the GPU's L2, so no call finds its weight in L2), ``calls`` calls captured
in one CUDA graph (no launch overhead), the graph replayed ``--reps`` times; the median replay
divided by ``calls`` is the time per call. The rows the targets read (``dense``, ``auto``, ``auto_nomap``,
``auto_tiled``, ``auto_blockmap``) are timed first, on every shape; then the sparse tensor-core kernels
(``decode_sparse_mma…``, ``gemm_sparse_…``), on every shape again; then the other candidates. Each shape's weights
and inputs are drawn once from a generator seeded by the shape and kept for every pass, so a run its time limit
cuts short still holds the whole target table, and then the newest kernels' rows. Each row records the bytes one
call must move (weight, positions, map, input, output) and the resulting TB/s, and the maximum error relative to a
dense bf16 matmul of the same (decompressed, permuted) weight: of one eager call (``max_rel_err``) and of the last
two timed calls as the graph replayed them (``replayed_rel_err``; there consecutive calls may overlap). A row
whose implementation does not apply to its shape, dtype or GPU (a sparse-MMA kernel where the probe found no sparse
tensor cores, ``wgmma`` off Hopper) timed its nearest that does, and names it (``ran``, from
``deploy/impl_rules.runs_as``), so such a row is not read as the kernel's own time.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
# the layers bench_e2e's LLaMA-2-7B-shaped model serves (each alone, and q/k/v and gate/up stacked as load
# stacks them), the ways it holds them and its token counts (decode, load's 16-token probe, the prompt):
# what --warm-serving compiles besides the table's shapes
SERVING_SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (12288, 4096), (22016, 4096)]
SERVING_IMPLS = ["auto", "auto_nomap", "auto_tiled", "auto_nomap_tiled"]
SERVING_TOKENS = [1, 16, 512]
SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (1024, 4096)]
TOKENS = [1, 2, 4, 8, 16, 64, 512, 2048]
NORM_CALLS = 8   # norm rows: calls per CUDA graph (until 2026-11-26 one, which counted the graph's launch in each)
# auto's candidates (SparseLinear.candidates) and the map-free decode the map's cost is read against; the
# first 'group' kernel and PyTorch's semi_structured tensors (never auto's choice) only when named in --impls
CANDIDATES = ["decode", "decode_shallow", "decode_tall", "decode_wide", "decode_mapped", "decode_mapped_tall",
              "decode_mapped_wide", "decode_mapped_by_value", "decode_resident", "decode_resident_nomap",
              "decode_resident+pdl", "decode_resident_tma",
              "decode_nomap", "decode_tall_nomap",
              "decode_wide_nomap", "decode_select", "decode_swap", "decode_swap_narrow", "decode_swap_sync",
              "decode_swap_spread", "decode_swap_spread_sync", "decode_swap_tma", "decode_swap_tma_tiled",
              "decode_sparse_mma", "decode_sparse_mma_nomap", "decode_sparse_mma_tiled", "decode_sparse_mma_mapped",
              "decode_sparse_mma_mapped_tiled", "decode_sparse_mma_tiled+pdl", "decode_sparse_mma_mapped_tiled+pdl",
              "decode_sparse_mma_tall_tiled", "decode_sparse_mma_mapped_tall_tiled", "decode_sparse_mma_mapped_inline",
              "decode_sparse_mma_mapped_inline_tiled",
              "gemm_sparse_mma", "gemm_sparse_mma_tiled", "gemm_sparse_wgmma_tiled", "gemm_sparse_wgmma_nomap_tiled",
              "gemm_sparse_wgmma_mapped_tiled",
              "cslt_tiled", "gemm",
              "gemm_swap", "gemm_swap_tall", "scratch", "scratch_mapped", "gather", "decode+pdl", "decode_swap+pdl",
              "decode_nomap+pdl"]
# the same layer under a random map within blocks of 64 columns (prune's maps are such: --perm-block 64),
# where the gather reads x nearly in order: auto (measured apart, by map span) and the in-kernel map, 1-16 tokens
BLOCKMAP_IMPLS = ["auto_blockmap", "decode_mapped_blockmap", "decode_offsets_blockmap"]   # offsets: the map as bytes
BLOCKMAP_MAX_TOKENS = 16
# the rows issue 24's targets read (scripts/gpu_targets.py), timed in a first pass over every shape
TARGET_IMPLS = ("auto", "auto_nomap", "auto_tiled", "auto_blockmap")
MAP_BLOCK = 64
# the libraries' 2:4 GEMMs, each on its own compressed copy (semi_cutlass and cslt only when named in
# --impls: gpu_run.sh sparse_tc)
from shuffleprune.deploy.impls import (  # noqa: E402  (no Triton import)
    DECODE_KERNELS, GEMM_KERNELS, LIBRARY_IMPLS as SPARSE_TC, MAPPED_DECODES, PDL_SUFFIX, SKIP_ENV, SWAP_TILES,
    SPARSE_GEMM, SPARSE_GEMM_MIN_TOKENS, SPARSE_WGMMA, SPARSE_WGMMA_MAPPED, TILE_MAX_TOKENS, advised_skip, skip_advice,
    skipped_impls)
from gpu_targets import row_ms  # noqa: E402  (scripts/, this script's folder, is on the path)


def split_impl(impl: str) -> tuple[str, str | None, bool]:
    """``(policy, map, tiled)`` of an implementation's name: ``_tiled``, ``_nomap`` and ``_blockmap``
    suffixes off (a ``+pdl`` suffix stays on the policy); ``map`` is ``"random"`` (a random map over all
    columns), ``"block"`` (``_blockmap``: a random map within blocks of 64 columns, what ``prune`` makes)
    or None (``_nomap``)."""
    base, pdl = impl.removesuffix(PDL_SUFFIX), impl.endswith(PDL_SUFFIX)
    tiled = base.endswith("_tiled")
    base = base.removesuffix("_tiled")
    kind = None if base.endswith("_nomap") else "block" if base.endswith("_blockmap") else "random"
    return base.removesuffix("_nomap").removesuffix("_blockmap") + (PDL_SUFFIX if pdl else ""), kind, tiled


def kernel_of(impl: str) -> str:
    """The implementation an implementation's name runs, without its layer's or launch's suffixes."""
    return split_impl(impl)[0].removesuffix(PDL_SUFFIX)


def bytes_moved(impl: str, rows: int, cols: int, tokens: int, elt: int = 2) -> int:
    """Bytes one call must read and write at least."""
    impl, has_map = kernel_of(impl), split_impl(impl)[1]
    io = tokens * cols * elt + tokens * rows * elt
    if impl == "dense":
        return rows * cols * elt + io
    kept = cols // 2
    weight = rows * kept * elt + rows * kept // 4           # values + 2-bit positions
    if impl in ("scratch", "scratch_mapped"):
        weight += 2 * rows * cols * elt                       # dense written to the scratch, then read
    if impl in SPARSE_TC:
        weight = rows * kept * elt + rows * kept // 4          # its own compressed form, about the same
    mapped = 0 if not has_map else cols * 4
    gathered = impl in DECODE_KERNELS and impl not in MAPPED_DECODES or \
        impl in (*GEMM_KERNELS, "scratch", *SPARSE_TC, "decode_sparse_mma", "decode_sparse_mma_tall", SPARSE_GEMM,
                 SPARSE_WGMMA)
    if has_map and gathered:
        mapped += 2 * tokens * cols * elt                     # the gathered input written, then read
    return weight + io + mapped


def runs_at(impl: str, tokens: int) -> bool:
    """Whether ``impl`` is timed at ``tokens``: the decodes to 64 tokens (select and weight-as-A from
    2, select to 16), the first kernels to 64, CUTLASS's 2:4 GEMM from 64 (semi_structured's rows at
    1–16 tokens ran 3–4× slower than dense; the first kernels 4–160× slower from 16 tokens), cuSPARSELt
    at every token count (``auto`` weighs it on a layer holding its buffer from one token)."""
    from shuffleprune.kernels.decode_tiles import decode_max_tokens

    if split_impl(impl)[1] == "block" and tokens > BLOCKMAP_MAX_TOKENS:
        return False
    has_map = split_impl(impl)[1]
    impl = kernel_of(impl)   # with or without a map, in either layout, launched either way
    if impl.startswith("decode") and tokens > decode_max_tokens(2):
        return False
    if impl in ("decode_select", "decode_swap", *SWAP_TILES, "decode_swap_tma") and \
            (tokens == 1 or tokens > 16 and impl == "decode_select"):
        return False
    if impl == "decode_shallow" and tokens > 2:   # auto weighs it on the select loop only (1-2 tokens)
        return False
    if impl.startswith("decode_sparse_mma_mapped") and tokens > 16:   # the map staged in shared memory: to 16 tokens
        return False
    if impl == "decode_sparse_mma_tall" and tokens < 4:   # where auto weighs it (through a map from one token)
        return False
    if tokens > TILE_MAX_TOKENS.get(impl, tokens):   # the select loop's other tiles: where auto weighs them
        return False
    if impl == SPARSE_GEMM and tokens < SPARSE_GEMM_MIN_TOKENS:   # where auto weighs it (the wgmma form: from 1)
        return False
    if impl == SPARSE_WGMMA_MAPPED and tokens > 16:   # where auto weighs it
        return False
    if impl == SPARSE_WGMMA and has_map is None and tokens > 1:   # the map's cost to it at one token (the 2 % target)
        return False
    if impl in ("gather", "group") and tokens > 64:
        return False
    if impl in ("scratch_mapped", "gemm_swap_tall") and tokens < 17:   # auto weighs them from GEMM_MIN_TOKENS
        return False
    return not (impl == "semi_cutlass" and tokens < 64)


def warm_in_parallel(args: argparse.Namespace) -> None:
    """Run ``--warm`` processes, ``args.warm_jobs`` at a time, and wait for all: one per shape and half
    of the token counts (and with ``--warm-serving`` one per layer ``bench_e2e`` serves)."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    base = [sys.executable, __file__, "--warm", *(["--smoke"] if args.smoke else [])]
    tokens = args.tokens or TOKENS
    halves = [tokens[: (len(tokens) + 1) // 2], tokens[(len(tokens) + 1) // 2:]]
    jobs = [[*base, "--shapes", shape, "--impls", *args.impls, "--tokens", *map(str, half)]
            for shape in args.shapes or [f"{o}x{i}" for o, i in SHAPES] for half in halves if half]
    if args.warm_serving:
        jobs += [[*base, "--shapes", f"{o}x{i}", "--impls", *SERVING_IMPLS, "--tokens", *map(str, SERVING_TOKENS)]
                 for o, i in SERVING_SHAPES]

    def run(cmd: list[str]) -> None:
        for _ in range(4):   # again without each kernel that faulted the GPU (a few at most)
            with lock:   # another thread may be adding to it
                env = {**os.environ, SKIP_ENV: ",".join(sorted(faulted))}
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
            if done.returncode == 0:
                return
            culprit = advised_skip(done.stderr)
            print(f"warm {' '.join(cmd[3:])}: exit {done.returncode}"
                  + (f", {culprit} faulted the GPU: left out from here on" if culprit else
                     f" (its kernels compile when timed): {done.stderr.strip().splitlines()[-1:]}"), flush=True)
            if not culprit or culprit in faulted:
                return
            with lock:
                faulted.add(culprit)

    faulted, lock = set(skipped_impls()), threading.Lock()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.warm_jobs) as pool:
        list(pool.map(run, jobs))
    if faulted:   # the timed run (this process) leaves them out as the warm ones did
        os.environ[SKIP_ENV] = ",".join(sorted(faulted))
    print(f"warm: {len(jobs)} processes, {args.warm_jobs} at a time, in {time.perf_counter() - t0:.0f} s", flush=True)


def main() -> None:
    # auto measures in this process, not from choices stored by earlier runs (deploy/choice_store.py), and the
    # --warm processes, timed 15 at a time against each other, store nothing for it to find
    os.environ["SHUFFLEPRUNE_AUTO_STORE"] = "0"
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--shapes", nargs="+", default=None, help="OUTxIN, e.g. 4096x4096")
    ap.add_argument("--tokens", nargs="+", type=int, default=None)
    ap.add_argument("--impls", nargs="+", default=["auto", "auto_nomap", "auto_tiled", *CANDIDATES, *BLOCKMAP_IMPLS])
    ap.add_argument("--reps", type=int, default=20, help="graph replays per case (median taken)")
    ap.add_argument("--warm", action="store_true",
                    help="compile only: one weight copy, every case called once, nothing timed or written")
    ap.add_argument("--out", default=str(ROOT / "scripts" / "results" / "bench_kernel.json"))
    ap.add_argument("--warm-jobs", type=int, default=0,
                    help="before timing, compile every shape's kernels in this many --warm processes at once "
                         "(with --warm too: only that)")
    ap.add_argument("--warm-serving", action="store_true",
                    help="with --warm-jobs: also compile the kernels bench_e2e's model runs (SERVING_SHAPES)")
    args = ap.parse_args()
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.warm_jobs:
        warm_in_parallel(args)
        if args.warm:
            return

    import torch
    import torch.nn.functional as F

    from shuffleprune.deploy import impl_rules
    from shuffleprune.deploy.format import compress
    from shuffleprune.deploy.input_gather import gather_orders, token_bucket
    from shuffleprune.deploy.auto_choice import relative_error
    from shuffleprune.deploy.sparse_linear import SparseLinear
    from shuffleprune.kernels.gpu import l2_bytes
    from shuffleprune.masks import nm_keep_mask
    from shuffleprune.outdir import atomic_write
    from shuffleprune.perm.core import random_block_perm
    from shuffleprune.runtime.facts import machine, versions
    from shuffleprune.runtime.faults import DeviceFault, candidate_errors, finish_or_fault, first_line, raise_if_fault
    from shuffleprune.runtime.timing import cuda_graph_ms, last_outputs

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device: run on a GPU machine, or --smoke to check the code paths on CPU")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    if args.smoke:   # tiny shapes whatever was asked (ragged, or cuSPARSELt's multiples of 64 rows and 32
        # columns for its layout); token counts up to 64 (the interpreter is slow)
        shapes = [(64, 64), (128, 96)] if any(i.endswith("_tiled") for i in args.impls) else [(48, 64), (40, 96)]
        tokens_list = sorted({min(t, 64) for t in args.tokens}) if args.tokens else [1, 5, 20]
    else:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
        tokens_list = args.tokens or TOKENS
    l2 = l2_bytes(device)

    def timed(calls: list, outputs: list | None = None, what: str = "a timed call", fix: str = "") -> tuple[float, str]:
        """Milliseconds per call over the rotating copies: CUDA graph replays (eager events if the
        capture fails); one wall-clock pass on the CPU smoke run. ``outputs`` receives the last calls'
        outputs as the timed runs left them; a call that never finishes is a ``DeviceFault`` naming ``what``
        and ``fix`` (``runtime.timing.cuda_graph_ms``)."""
        if not cuda:
            t = time.perf_counter()
            kept = last_outputs(calls)
            ms = (time.perf_counter() - t) * 1e3 / len(calls)
            if outputs is not None:
                outputs.extend(kept)
            return ms, "wall"
        return cuda_graph_ms(calls, args.reps, outputs=outputs, what=what, fix=fix)   # compiled in its warm-up

    rows: list[dict] = []
    norm_rows: list[dict] = []
    dev_name = torch.cuda.get_device_name() if cuda else "cpu (smoke: TRITON_INTERPRET=1)"
    out = Path(args.out) if not args.smoke else Path(args.out).with_name("bench_kernel_smoke.json")

    def ms_of(shape, tokens, impl):
        return row_ms(rows, list(shape), tokens, impl)

    def save(done: bool) -> list[dict]:
        """Write what has been measured so far (after every shape, so a run cut off by its time limit
        still leaves its rows); ``complete`` says whether every shape was reached."""
        summary = []
        for shape in shapes:
            for tokens in tokens_list:
                dense, auto = ms_of(shape, tokens, "dense"), ms_of(shape, tokens, "auto")
                mapped, nomap = ms_of(shape, tokens, "decode"), ms_of(shape, tokens, "decode_nomap")
                inkernel = ms_of(shape, tokens, "decode_mapped")
                auto_nomap, auto_block = ms_of(shape, tokens, "auto_nomap"), ms_of(shape, tokens, "auto_blockmap")
                inkernel_block = ms_of(shape, tokens, "decode_mapped_blockmap")
                offsets_block = ms_of(shape, tokens, "decode_offsets_blockmap")
                mapped_pdl, nomap_pdl = ms_of(shape, tokens, "decode+pdl"), ms_of(shape, tokens, "decode_nomap+pdl")
                resident, resident_nomap = ms_of(shape, tokens, "decode_resident"), ms_of(shape, tokens,
                                                                                            "decode_resident_nomap")
                auto_tiled = ms_of(shape, tokens, "auto_tiled")
                swap, swap_tma = ms_of(shape, tokens, "decode_swap"), ms_of(shape, tokens, "decode_swap_tma")
                resident_tma = ms_of(shape, tokens, "decode_resident_tma")
                sp_tiled, sp_nomap = ms_of(shape, tokens, "decode_sparse_mma_tiled"), ms_of(shape, tokens,
                                                                                          "decode_sparse_mma_nomap")
                sp_mapped = ms_of(shape, tokens, "decode_sparse_mma_mapped")
                sp_inline = ms_of(shape, tokens, "decode_sparse_mma_mapped_inline")
                sp_tall = ms_of(shape, tokens, "decode_sparse_mma_tall_tiled")
                sp_gemm = ms_of(shape, tokens, "gemm_sparse_mma_tiled")
                sp_wgmma = ms_of(shape, tokens, "gemm_sparse_wgmma_tiled")
                sp_wgmma_nomap = ms_of(shape, tokens, "gemm_sparse_wgmma_nomap_tiled")
                sp_wgmma_mapped = ms_of(shape, tokens, "gemm_sparse_wgmma_mapped_tiled")
                if dense is None:
                    continue
                summary.append({"shape": list(shape), "tokens": tokens,
                                "auto_speedup": round(dense / auto, 3) if dense and auto else None,
                                "map_cost": round(mapped / nomap - 1, 4) if mapped and nomap else None,
                                "map_cost_in_kernel": round(inkernel / nomap - 1, 4) if inkernel and nomap else None,
                                "map_cost_pdl": round(mapped_pdl / nomap_pdl - 1, 4) if mapped_pdl and nomap_pdl else None,
                                # the resident-input decode with the map against itself without one
                                "map_cost_resident":
                                    round(resident / resident_nomap - 1, 4) if resident and resident_nomap else None,
                                # the weight tiles by the Tensor Memory Accelerator against per-thread copies
                                # (> 1: the bulk copies are faster), both through the map
                                "tma_gain_swap": round(swap / swap_tma, 3) if swap and swap_tma else None,
                                "tma_gain_resident": round(resident / resident_tma, 3) if resident and resident_tma else None,
                                # the layer as load holds it on Hopper (one cuSPARSELt buffer)
                                "auto_speedup_tiled": round(dense / auto_tiled, 3) if dense and auto_tiled else None,
                                # under a map within blocks of 64 columns (prune's): auto's speed-up, and auto's
                                # and the in-kernel map's cost against the layer without a map
                                "auto_speedup_blockmap": round(dense / auto_block, 3) if dense and auto_block else None,
                                "map_cost_blockmap": round(auto_block / auto_nomap - 1, 4) if auto_block and auto_nomap else None,
                                "map_cost_in_kernel_blockmap":
                                    round(inkernel_block / nomap - 1, 4) if inkernel_block and nomap else None,
                                "map_cost_offsets_blockmap":
                                    round(offsets_block / nomap - 1, 4) if offsets_block and nomap else None,
                                # the sparse-tensor-core decode on the layer as load holds it on Hopper (through the
                                # gathered input), and its map read in the kernel against itself without a map
                                "sparse_mma_speedup_tiled": round(dense / sp_tiled, 3) if dense and sp_tiled else None,
                                # the same with the tall plan's CTAs (each input read shared by more rows)
                                "sparse_mma_tall_speedup_tiled": round(dense / sp_tall, 3) if dense and sp_tall else None,
                                # the prompt GEMM on the sparse tensor cores, on the layer as load holds it on Hopper
                                "sparse_gemm_speedup_tiled": round(dense / sp_gemm, 3) if dense and sp_gemm else None,
                                "sparse_wgmma_speedup_tiled": round(dense / sp_wgmma, 3) if dense and sp_wgmma else None,
                                # the map's cost to the wgmma decode: read in the kernel, and gathered first
                                "map_cost_sparse_wgmma_in_kernel":
                                    round(sp_wgmma_mapped / sp_wgmma_nomap - 1, 4) if sp_wgmma_mapped and sp_wgmma_nomap
                                    else None,
                                "map_cost_sparse_wgmma":
                                    round(sp_wgmma / sp_wgmma_nomap - 1, 4) if sp_wgmma and sp_wgmma_nomap else None,
                                "map_cost_sparse_mma": round(sp_mapped / sp_nomap - 1, 4) if sp_mapped and sp_nomap else None,
                                # the same with the map read by each B load, nothing staged
                                "map_cost_sparse_mma_inline":
                                    round(sp_inline / sp_nomap - 1, 4) if sp_inline and sp_nomap else None})
        for r in rows:
            r.update(device=dev_name, dtype="bfloat16")
        result = {"what": "2:4 linear implementations vs dense cuBLAS (rotating weight copies, CUDA graphs)",
                  "smoke": args.smoke, "complete": done, "device": dev_name, "l2_bytes": l2,
                  "seed": "per shape: out_features * 65536 + in_features (weights, maps, inputs); norm rows: 0",
                  "targets": "auto ≥1.5× dense at 1 token, ≥1.2× at 2–16, never slower; map cost ≤2 % at 1 token",
                  "skipped_impls": sorted(left_out),
                  "command": " ".join([Path(sys.executable).name, *sys.argv]), "machine": machine(),
                  "versions": versions("triton"), "summary": summary, "rows": rows, "norm_rows": norm_rows}
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, lambda tmp: tmp.write_text(json.dumps(result, indent=1)))
        return summary

    left_out = skipped_impls()   # kernels that faulted the GPU in a warm process (or named by the caller)

    def culprit(impl: str, out_f: int, in_f: int, tokens: int) -> tuple[str, str]:
        """What a ``DeviceFault`` says of ``impl`` (it faulted the GPU, or never finished), and the fix."""
        return f"{impl} ({out_f}x{in_f}, {tokens} tokens)", skip_advice(split_impl(impl)[0])

    def fault_check(exc: Exception, impl: str, out_f: int, in_f: int, tokens: int) -> None:
        """A DeviceFault naming ``impl``'s policy where ``exc`` faulted the GPU (the process then ends)."""
        raise_if_fault(exc, *culprit(impl, out_f, in_f, tokens))

    cases: dict[tuple[int, int], SimpleNamespace] = {}

    def shape_case(out_f: int, in_f: int) -> SimpleNamespace:
        """One weight shape's map, 2:4 weight copies (dense and compressed) and inputs, made once and kept for every
        pass: drawn from a generator seeded by the shape alone, so the table's numbers do not depend on which
        implementations were asked for or in what order."""
        if (out_f, in_f) not in cases:
            gen = torch.Generator().manual_seed(out_f * 65536 + in_f)
            dense_bytes = out_f * in_f * 2
            copies = 1 if not cuda or args.warm else max(4, math.ceil(2.5 * l2 / (dense_bytes * 9 / 16)))
            perm = torch.randperm(in_f, generator=gen)
            maps = {"random": perm, "block": random_block_perm(in_f, MAP_BLOCK, gen), None: None}
            weights, compressed = [], []
            for _ in range(copies):
                w = torch.randn(out_f, in_f, generator=gen).to(device)  # drawn on the CPU (seeded), masked there
                w = (w * nm_keep_mask(w.abs(), 2, 4)).to(dtype)      # 2:4 in permuted (memory) order
                weights.append(w)
                compressed.append(compress(w, 2, 4))
            xs = {tokens: torch.randn(tokens, in_f, generator=gen).to(device, dtype) for tokens in tokens_list}
            cases[(out_f, in_f)] = SimpleNamespace(copies=copies, perm=perm, maps=maps, weights=weights,
                                                   compressed=compressed, xs=xs)
        return cases[(out_f, in_f)]

    def measure_shape(out_f: int, in_f: int, impls: list[str], time_dense: bool) -> None:
        """Time (or, with --warm, compile) ``impls`` on one weight shape at every token count (:func:`shape_case`'s
        weights and inputs); the dense row too where ``time_dense``."""
        case = shape_case(out_f, in_f)
        copies, perm, maps, weights = case.copies, case.perm, case.maps, case.weights
        layers = {impl: [] for impl in impls}
        for values, meta in case.compressed:
            for impl in impls:
                policy, kind, tiled = split_impl(impl)
                layer = SparseLinear(values, meta, in_f, 2, 4, maps[kind], policy=policy).to(device)
                if tiled and not layer.use_cslt_layout():   # one cuSPARSELt buffer
                    raise SystemExit(f"{out_f}x{in_f} cannot take cuSPARSELt's layout")
                layers[impl].append(layer)
        perm_d = perm.to(device)
        # the dense model's own weight: W = W_p with the map undone (so dense and sparse compute the same y)
        originals = [torch.empty_like(w).index_copy_(1, perm_d, w) for w in weights] if time_dense else []
        for tokens in tokens_list:
            x = case.xs[tokens]
            xp = x.index_select(1, perm_d)
            ref = F.linear(xp, weights[0])                        # dense bf16 matmul of the decompressed weight
            ref_block = F.linear(x.index_select(1, maps["block"].to(device)), weights[0])   # under the block map
            if args.warm:   # compile (auto: its candidates too) and nothing else
                for impl in impls:
                    if runs_at(impl, tokens) and split_impl(impl)[0] not in left_out:
                        try:
                            y = layers[impl][0](x if split_impl(impl)[1] else xp)
                            finish_or_fault(y, *culprit(impl, out_f, in_f, tokens))   # one that never finishes
                        except candidate_errors() as exc:   # one that faults the GPU ends the process, named
                            fault_check(exc, impl, out_f, in_f, tokens)
                print(f"{out_f}x{in_f} t={tokens}: compiled", flush=True)
                continue
            if time_dense:
                dense_ms, how = timed([lambda w=w: F.linear(x, w) for w in originals])
                rows.append({"shape": [out_f, in_f], "tokens": tokens, "impl": "dense", "ms": dense_ms,
                             "timing": how, "copies": copies, "bytes": bytes_moved("dense", out_f, in_f, tokens),
                             "tb_s": bytes_moved("dense", out_f, in_f, tokens) / dense_ms / 1e9})
            dense_ms = ms_of((out_f, in_f), tokens, "dense")
            line = [f"dense {dense_ms:.4f}" if dense_ms else "dense -"]
            for impl in impls:
                if not runs_at(impl, tokens):
                    continue
                if split_impl(impl)[0] in left_out:
                    rows.append({"shape": [out_f, in_f], "tokens": tokens, "impl": impl, "ms": None,
                                 "error": f"left out ({SKIP_ENV}): it faulted the GPU"})
                    continue
                inp = x if split_impl(impl)[1] else xp
                replayed: list = []
                suspect = culprit(impl, out_f, in_f, tokens)   # what a call that never finishes is named by
                try:
                    y = layers[impl][0](inp)
                    finish_or_fault(y, *suspect)
                    ms, how = timed([lambda l=l: l(inp) for l in layers[impl]], replayed, *suspect)
                except candidate_errors() as exc:
                    fault_check(exc, impl, out_f, in_f, tokens)
                    rows.append({"shape": [out_f, in_f], "tokens": tokens, "impl": impl, "ms": None,
                                 "error": first_line(exc)[:200]})
                    continue
                want = ref_block if split_impl(impl)[1] == "block" else ref
                err = relative_error(y, want)
                nbytes = bytes_moved(impl, out_f, in_f, tokens)
                row = {"shape": [out_f, in_f], "tokens": tokens, "impl": impl, "ms": ms, "timing": how,
                       "copies": copies, "bytes": nbytes, "tb_s": nbytes / ms / 1e9, "max_rel_err": err,
                       # the last two timed calls as replayed (they may overlap there: programmatic dependents)
                       "replayed_rel_err": max((relative_error(o, want) for o in replayed), default=None),
                       "speedup_vs_dense": dense_ms / ms if dense_ms else None}
                ran = None if impl.startswith("auto") else \
                    impl_rules.runs_as(layers[impl][0], kernel_of(impl), inp)
                if ran is not None and ran != kernel_of(impl):   # it does not apply here: its nearest that does ran
                    row["ran"] = ran
                if impl.startswith("auto"):
                    row["choice"] = dict(layers[impl][0].choices)
                    if impl != "auto_nomap":   # how its input was gathered: the ways measured, fastest first
                        row["gather_order"] = gather_orders().get((in_f, token_bucket(tokens), layers[impl][0].map_span))
                rows.append(row)
                line.append(f"{impl} {ms:.4f}")
            print(f"{out_f}x{in_f} t={tokens}: " + "  ".join(line), flush=True)
        del layers, originals

    # First the rows the targets read (dense and auto's), every shape; then the sparse tensor-core kernels (the
    # ones no earlier table holds), every shape again; then the other candidates: a run cut off by its time limit
    # has lost the oldest candidates' rows, not the table the issue is judged on.
    groups = [[i for i in args.impls if i in TARGET_IMPLS]]
    groups.append([i for i in args.impls if i not in groups[0] and "sparse" in i])
    groups.append([i for i in args.impls if i not in groups[0] + groups[1]])
    passes = [args.impls] if args.warm else [g for g in groups if g]
    try:
        for n, impls in enumerate(passes):
            for out_f, in_f in shapes:
                measure_shape(out_f, in_f, impls, time_dense=n == 0)
                if not args.warm:
                    save(done=False)
                if cuda:
                    torch.cuda.empty_cache()
    except DeviceFault as exc:   # the timed run faulted the GPU: its rows so far, and the kernel it names, stay
        named = advised_skip(str(exc))
        if named and not args.warm:
            left_out = left_out | {named}
            save(done=False)
        raise

    if args.warm:
        return
    # The producer-side alternative for a shared map: the RMSNorm feeding q/k/v (or gate/up) writes its
    # output permuted (one fused kernel) and the layers run without a map. Its cost is the fused norm's
    # time over the plain norm's; the in-kernel map's is decode over decode_nomap, once per reading layer.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from shuffleprune.deploy.producer_maps import MappedOutput
    from shuffleprune.kernels.gather import gather_columns, gather_rows, rows_fit

    gen = torch.Generator().manual_seed(0)
    for width in sorted({in_f for _, in_f in shapes}):
        norm = LlamaRMSNorm(width, eps=1e-5).to(device, dtype)
        with torch.no_grad():
            norm.weight.normal_()
        perm = torch.randperm(width, generator=gen).to(device)
        mapped = MappedOutput(norm, perm, kernel=True)
        perm32 = perm.to(torch.int32)
        for tokens in tokens_list:
            x = torch.randn(tokens, width, generator=gen).to(device, dtype)
            ref = norm(x).index_select(-1, perm)
            impls = {"rmsnorm": lambda: norm(x), "rmsnorm+gather": lambda: norm(x).index_select(-1, perm),
                     "rmsnorm_mapped": lambda: mapped(x),
                     # a mapped layer's own gather alone, launched plainly: PyTorch's, and the Triton one
                     # the "+pdl" choices launch (as a dependent there)
                     "gather": lambda: x.index_select(-1, perm), "gather_columns": lambda: gather_columns(x, perm32)}
            if rows_fit(width, dtype):   # the row gather (rows staged in shared memory) that auto's gathers may pick
                impls["gather_rows"] = lambda: gather_rows(x, perm32)
            for impl, call in impls.items():   # several calls per graph: one graph launch's own latency (µs) is
                ms, how = timed([call] * NORM_CALLS)   # not the norm's (the norms run inside a model's one graph)
                row = {"width": width, "tokens": tokens, "impl": impl, "ms": ms, "timing": how,
                       "calls_per_graph": NORM_CALLS}
                if impl == "rmsnorm_mapped":
                    row["max_rel_err"] = relative_error(call(), ref)
                if impl in ("gather_columns", "gather_rows"):
                    row["max_rel_err"] = relative_error(call(), x.index_select(-1, perm))
                norm_rows.append(row)
            line = "  ".join(f"{r['impl']} {r['ms']:.4f}" for r in norm_rows[-len(impls):])
            print(f"norm {width} t={tokens}: {line}", flush=True)

    summary = save(done=True)
    print(json.dumps(summary))
    print(f"wrote {out}")

if __name__ == "__main__":
    from shuffleprune.runtime.faults import run_to_fault

    run_to_fault(main)   # a kernel that faulted or hung the GPU: the process ends at once, named
