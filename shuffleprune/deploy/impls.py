"""The implementations a :class:`~shuffleprune.deploy.sparse_linear.SparseLinear` can run, by name
(``IMPLS``, a layer's ``policy``), and each one's kernel options: the tables the layer dispatches on,
:mod:`.auto_choice` weighs and the benchmarks and compile checks time by name.

- ``decode`` (CUDA, 1–64 tokens; float32 1–16): the bandwidth kernel of ``kernels/nm_decode.py``
  (position words, split-K) over the gathered input (one gather, shared by a group's layers; every
  implementation but ``decode_mapped``, ``gather`` and ``group`` reads its input so, gathered the way
  ``deploy/input_gather.py`` measured fastest for its width and token count);
- ``decode_mapped``: the same kernel reading the index map itself (no gather launch; on an H100 its
  gather, a synchronous load inside the loop, cost 6–34 % at one token and far more on the tensor
  cores). It now reads the gather as 32-bit words the pipeline copies ahead, in the select loop (1–2
  tokens) and above that, to 16 tokens (``MAPPED_MAX_TOKENS``), in the weight-as-A tensor-core
  decode (``decode_swap``'s kernel, the one whose word gather compiles without spilling); not yet
  timed;
- ``decode_offsets`` (a map within aligned blocks of at most 256 columns, as ``prune`` writes them):
  ``decode_mapped`` reading the map as 1-byte offsets within its blocks (``block_map``), a quarter of
  the int32 map's bytes per step; built after the H100 put the in-kernel map's cost at one token at
  1–9 % under a 64-column block map (``bench_kernel.json``, 2026-11-27). Timed on the H100 the same
  day it ran 5–14 % slower than ``decode_mapped`` at 1–2 tokens, so ``auto`` no longer weighs it
  (``NOT_WEIGHED``); it runs when named;
- ``decode_shallow`` (1–2 tokens): ``decode`` with its software pipeline one tile shallower (3 tiles
  in flight, not 4). An H100 sweep of the select loop at one token (``tune_decode_select.json``) had
  it fastest on 11008×4096 (23.1 against 24.5 µs) and slower on 4096×4096 and 4096×11008 (2–4 %),
  so ``auto`` times both rather than a rule choosing by shape (on the H100 on 2026-11-27 it was
  ``auto``'s pick in 3 of its 18 one-token rows, on 11008×4096 and 14336×4096);
- ``decode_tall`` (one token), ``decode_wide`` (1–2 tokens), ``decode_mapped_tall`` and
  ``decode_mapped_wide`` (one token; 16-bit inputs, any N:M but 4:8): ``decode`` and ``decode_mapped`` with
  the select loop's other tiles, 32 rows per program or 256 kept values per step
  (``DECODE_KERNELS_TILE``). An H100 sweep had them 2–6 % faster than the default tile on a tall or
  a wide shape and not on the square one (``tune_gather.json``), so ``auto`` times them. Timed as
  candidates on the H100 (2026-11-27), the three others were ``auto``'s picks in 15 of its 36 one- and
  two-token rows (11 of 18 at one token), ``decode_tall`` in none, so ``auto`` no longer weighs it
  (``NOT_WEIGHED``);
- ``decode_mapped_by_value`` (2:4, 16-bit, 1–2 tokens): ``decode_mapped`` with the select loop of
  before 2026-11-28, each kept value selecting its input in a 4-D tile, instead of the loop by 2:4
  group (``decode_loops.select_loop``). Compiled for sm_90a the group loop is the shorter under Triton
  3.9 and 3.6 alike (one token through the map: 232 and 231 instructions per step against 283 and
  276, ``kernel_compile_sm90*.json``), but only the per-value loop has ever been timed on a GPU, so
  ``auto`` times both through the map and a GPU run of ``bench_kernel`` compares them;
- ``decode_resident`` (2:4, 16-bit, 1–2 tokens; with a map or without): ``kernels/nm_resident.py``, where a
  program owns a chunk of 256 kept values and a range of rows, reads its chunk's inputs once (through
  the map) before its loop and streams the rows past them, each row's partial sum per chunk added by
  the last program of its range. Built so a map costs what no map costs: compiled for sm_90a its loop
  has 10.75 instructions per kept value through the map and without (the select decode: 14.5 and
  11.4), ``kernel_compile_sm90.json``. Not yet timed on a GPU, so ``auto`` times it. Named as a policy,
  it runs ``decode_mapped`` where it does not apply (more tokens, another pattern, 32-bit values);
- ``decode_resident_tma`` (as ``decode_resident``): the resident decode with its weight's tiles copied by the
  Tensor Memory Accelerator (as ``decode_swap_tma``, below; no head prefetch). Not yet timed on a GPU;
  ``auto`` weighs it where the descriptors can read the weight, and named elsewhere it runs
  ``decode_resident``;
- ``decode_select`` (3–16 tokens): the decode forced onto the select-and-add loop of 1–2 tokens
  instead of the tensor cores (on an H100 the tensor-core decode ran at about dense speed from 2
  tokens on, the select loop 1.5× faster than dense at one token and 1.2–1.35× at two);
- ``decode_swap`` (2–64 tokens): the tensor-core decode with the weight tile as the MMA's A operand
  (rows in the MMA's M: Hopper's asynchronous wgmma from registers), built after the tensor-core
  decode measured at about dense speed, latency-bound;
- ``decode_swap_narrow`` (2:4, 2–16 tokens): ``decode_swap`` with half its step (64 kept values, 128
  dense columns) and 3 tiles in flight. An H200 sweep (``tune_bw_swap.json``, 2026-11-28) had it fastest
  on 11008×4096 (24.7–25.7 µs at 2–16 tokens against the default tile's 28.2–29.0 and cuBLAS's
  25.5–26.8) and slower on 4096×4096 and 4096×14336; on the H100 the same step had been slower on
  all three (``tune_swap_decode.json``), so ``auto`` times it rather than a rule;
- ``decode_swap_sync`` (2:4, 2–16 tokens): ``decode_swap`` on 32 rows of 2 warps and 64 kept values
  per step, which Triton compiles to the warp-synchronous ``mma`` instead of the warpgroup's
  asynchronous ``wgmma`` (the H100 and H200 sweeps covered only 64 and 128 rows, all wgmma). The wgmma
  decode ran at 1.8 TB/s on the H200 where its loop's instructions alone would allow about 6: bound
  by latency, with at most one wgmma group in flight per warpgroup (``WARPGROUP.DEPBAR.LE gsb0, 0x1``
  in its sm_90a loop) and 2 programs per SM. As compiled for sm_90a
  (``scripts/results/kernel_compile_sm90.json``), 6 such programs (12 warps) reside per SM where the
  default tile has 2 (8 warps), with about the same instruction ceiling (5.1–5.5 against 5.9–6.4 TB/s).
  Not yet timed on a GPU; ``auto`` weighs it;
- ``decode_swap_spread`` (2:4, 16-bit, 2–64 tokens) and ``decode_swap_spread_sync`` (2–16): ``decode_swap`` and
  ``decode_swap_sync`` with the tile expanded by broadcasts (``kernels/nm_words.py``'s ``_dense_2of4_pairs``,
  ``SPREAD``), so the compiler reads the value pairs from shared memory straight into the MMA's operand
  layout: compiled for sm_90a the expanded tile no longer makes a trip through shared memory and a barrier
  per step to change layout (the default tile's loop moves 18.9 KB of shared memory where it moved 30.2,
  the 32-row one 13.6 where 19.2; 8 of the 32-row programs reside per SM where 6 did), for 14–38 % more
  loop instructions under Triton 3.9. Under Triton 3.6 (PyTorch 2.11's, the GPU machine's) the 32-row tile's
  loop is shorter too (325 instructions against 388 at 16 tokens on 4096×4096, 11.5 KB of shared memory
  against 19.2, 88 registers against 102). Not yet timed on a GPU; ``auto`` weighs them;
- ``decode_swap_tma`` (2:4, 16-bit, 2–64 tokens): ``decode_swap`` (3 tiles in flight) with its weight's tiles
  copied by Hopper's Tensor Memory Accelerator (tensor descriptors), not by every thread's 16-byte
  asynchronous copies. At 2–16 tokens the 2:4 decodes took the H100's time on the H200 (4096×14336, 2
  tokens: 34.6 against 34.7 µs) where cuBLAS, whose loads are bulk copies, sped up with the H200's 1.4×
  bandwidth (32.7 against 46.1): what the threads' copies keep in flight per SM may be what binds them.
  Compiled for sm_90a no thread holds the copies' addresses: 126 registers against 200 and 3 programs
  per SM against 2, with the same loop (665 instructions against 669 at 16 tokens,
  ``kernel_compile_sm90.json``). At 32–64 tokens a step copies 64 kept values per row (the descriptors'
  16 bytes of position words), twice ``decode_swap``'s step there (``decode_tiles.DOT_TILES_SWAP_TMA``). Not yet
  timed on a GPU; ``auto`` weighs it where the descriptors can read the weight (rows of a multiple of 16
  bytes, values of the inputs' dtype), and named elsewhere it runs ``decode_swap``;
- ``decode_sparse_mma`` (2:4, 16-bit, 1–64 tokens, columns a multiple of 128; an NVIDIA GPU of compute
  capability 8.0 or more): ``kernels/nm_sparse_mma.cu``, the decode on the sparse tensor cores (``mma.sp``),
  CUDA C++ compiled by NVRTC at its first call, over the gathered input. Triton has no sparse MMA, so every
  Triton decode above expands its tile to dense before ``tl.dot``, and from 2 tokens on that expansion, not
  the weight's bytes, bounds them (on the H200, 4096×4096 at 16–64 tokens: 1.0–1.5 TB/s where cuBLAS moved
  2.5–2.8);
  ``mma.sp`` multiplies the kept values as they lie, with the position codes as its metadata, from the
  layer's one buffer in either layout. Checked on the CPU by running its text under an emulator of CUDA's
  threads and of the sparse MMA as the PTX ISA defines it (``tests/sparse_mma_emulator.hpp``), and compiled
  for sm_90 and sm_80 by NVRTC (``sparse_mma_compile.json``: 62 variants, two spilling 16 bytes or less on
  sm_90); not yet run on a GPU, so
  ``auto`` checks and times it (its launch goes through ctypes: timed eagerly too, ``EAGER_CHECKED``);
  ``decode_sparse_mma_mapped`` (1–16 tokens): the same kernel reading the index map itself, each CTA gathering
  its columns of every token through the map into shared memory once, its first step's weight loads in
  flight and its further kept values asked into L2 meanwhile (no gather launch; the map's cost is one gather
  per CTA);
  ``decode_sparse_mma_mapped_inline`` (1–16 tokens): the map read by each B load itself, a step ahead with the
  weight, nothing staged: no gather and no barrier before the first MMA (at one token the map and the input are a
  few KB, in L1);
  ``decode_sparse_mma_tall`` and ``decode_sparse_mma_mapped_tall``: the two with ``sparse_mma_tiles.tall_plan``'s
  CTAs, which stage the input in shared memory and share it among up to 4 warps of 16 rows. The default CTA
  reads B from global memory once per 16 rows, each 32-bit load touching 8 token rows: by count 35 MB of input
  reads and partial sums at 16 tokens on 4096×4096 against the weight's 19 MB, 140 MB at 64
  (``sparse_mma_tiles.side_traffic``). The tall plan's CTAs of 64 rows copy each round of their columns (128 per
  K group, every token) into a ring of two rounds by asynchronous 8-byte copies two rounds ahead, and read B
  from there in swizzled rows with no bank conflicts (through a map: its staging, swizzled the same way):
  13 and 46 MB there, and no split forced by shared memory. CTAs of 8 warps compiled to 80 registers with
  spills, or to 150 and more under a one-CTA launch bound, so 4 at most. ``auto`` weighs them where the
  default's reads are a quarter of the weight's bytes or more (from about 4 tokens; through a map, whose
  gathers each cost a sector, from one: ``sparse_mma_tiles.tall_worth_weighing``);
- ``gemm_sparse_mma`` (2:4, 16-bit, rows in 64s, columns in 64s; from 32 tokens; the GPUs the decode above runs on):
  ``kernels/nm_sparse_gemm.cu``, a GEMM on the sparse tensor cores for prompts, over the gathered input. From a few
  hundred tokens a dense layer is bound by its MMAs, and every other path here but cuSPARSELt does the dense MMAs
  after expanding the weight; ``mma.sp`` does half of them. CTAs of up to 256 rows × 128 tokens copy 64 columns of
  kept values, position words and input a stage into shared memory (``cp.async``, 3 stages in flight), and each
  fragment read there (``ldmatrix``, swizzled rows: no bank conflicts) serves a warp's other tiles; K split over CTAs
  where the tiles alone leave SMs idle (the last CTA of a tile adds the splits in order). Checked under the
  same emulator (ragged tokens, both layouts, bias, fp16/bf16), compiled for sm_90 and sm_80
  (``sparse_mma_compile.json``); not yet run on a GPU;
- ``gemm_sparse_wgmma`` (the same layers, from one token, Hopper only): that GEMM with Hopper's own asynchronous
  ``wgmma.mma_async.sp`` (``sm_90a``) in place of ``mma.sp``, which on Hopper cannot reach cuBLAS's dense rate
  (``scripts/mma_ceiling.py`` measures the two): each warpgroup's 64 rows of kept values and the stage's input read
  by the tensor cores from shared memory through descriptors (the stage already in ``wgmma``'s 64- and 128-byte
  swizzles), each step's wgmmas running on through the next step's barrier and copies. Checked under the
  emulator, which reads a ``wgmma``'s operands at its issue and requires them unchanged, with no copy issued into
  them, until it retires (a slot reused early, read before it landed, or metadata written while one runs is an
  error there). Up to 64 tokens it runs as a decode (``sparse_gemm_tiles.WGMMA_DECODE_TILES``): CTAs of 64 rows × the
  fewest of 8–64 tokens that hold the input, K split until 4 CTAs an SM stream the weight through shared memory
  straight to the tensor cores. Compiled for ``sm_90a``; not yet run on a GPU, so ``auto`` checks its output first;
  ``gemm_sparse_wgmma_mapped`` (a mapped layer, 1–16 tokens): that decode reading the map itself, each CTA gathering
  its split's columns of its tokens through the map into shared memory once (``x[t][perm[c]]``, 8 columns a 16-byte
  store, in the stages' swizzled input layout) while its first stages of weight stream in: no gather launch;
- ``gemm`` (CUDA, more than 16 tokens): the tiled Triton GEMM that decompresses weight tiles in
  registers, over the gathered input; ``gemm_swap``: the same with the weight as the A operand, so
  the tensor-core call overlaps the next tile's expansion; ``gemm_swap_tall`` (16-bit inputs): that on
  128 weight rows per program, so each input tile read from L2 serves twice the rows
  (``nm_gemm.GEMM_TILES_SWAP_TALL`` says why);
- ``scratch`` (any device): ``W_p`` decompressed into one scratch buffer shared by every layer of
  that device and dtype, then a dense matmul (cuBLAS on the GPU);
- ``scratch_mapped`` (CUDA, a mapped layer, from 17 tokens): the weight decompressed into that scratch
  in the input's *original* order (``kernels/nm_gemm.py``'s ``nm_decompress_mapped_into``), then a
  dense matmul of the input as it is: no gathered copy of a prompt's activation is made or read;
- ``gather`` / ``group``: the first Triton kernels (``kernels/nm_matmul.py``); ``auto`` weighs ``gather`` only
  where no decode applies (M not a power of two): elsewhere no GPU table ever had it picked;
- ``semi_structured`` / ``semi_cutlass``: PyTorch's 2:4 tensors; ``cslt``: cuSPARSELt called directly
  (Hopper's sparse tensor cores), its algorithm and split-K searched once per token count and the
  output's transpose fused. On a layer in the export's layout they hold their own compressed copy,
  so only an explicit ``policy`` runs them (benchmarks). After :meth:`SparseLinear.use_cslt_layout`
  the layer's one buffer *is* cuSPARSELt's (``deploy/cslt_layout.py``): the decode kernels read it
  and ``auto`` times ``cslt`` on it at every token count (its tokens padded to a multiple of
  ``CSLT_TOKEN_MULTIPLE``; at 1–16 tokens it reads the same 2:4 bytes the decodes read, on Hopper's
  sparse tensor cores: not yet timed there).
"""
from __future__ import annotations

import os
import re

from shuffleprune.errors import UserError

# the sparse-tensor-core decodes (kernels/nm_sparse_mma.cu): on the gathered input, reading the map, and each with
# the tall plan's CTAs
SPARSE_MMA_DECODES = ("decode_sparse_mma", "decode_sparse_mma_tall", "decode_sparse_mma_mapped",
                      "decode_sparse_mma_mapped_tall", "decode_sparse_mma_mapped_inline")
# the prompt GEMM on the sparse tensor cores (kernels/nm_sparse_gemm.cu), on the gathered input, weighed from this many
# tokens (below, the decodes hold the weight in registers once and need no shared-memory trip)
SPARSE_GEMM = "gemm_sparse_mma"
SPARSE_WGMMA = "gemm_sparse_wgmma"   # the same on Hopper's wgmma.mma_async.sp
SPARSE_WGMMA_MAPPED = "gemm_sparse_wgmma_mapped"   # its decode reading the map itself (up to 16 tokens)
SPARSE_GEMM_MIN_TOKENS = 32
LIBRARY_IMPLS = ("semi_structured", "semi_cutlass", "cslt")   # CUDA libraries' 2:4 GEMMs, each on its own copy
# nm_gemm's options per prompt policy (on the gathered input): the weight as the MMA's B operand, as its A
# operand, and as A over 128 rows per program
GEMM_KERNELS = {"gemm": {}, "gemm_swap": {"weight_a": True}, "gemm_swap_tall": {"weight_a": True, "tall": True}}
IMPLS = ("decode", "decode_shallow", "decode_tall", "decode_wide", "decode_mapped", "decode_mapped_tall",
         "decode_mapped_wide", "decode_mapped_by_value", "decode_offsets", "decode_resident", "decode_resident_tma",
         "decode_select", "decode_swap", "decode_swap_narrow", "decode_swap_sync", "decode_swap_spread",
         "decode_swap_spread_sync", "decode_swap_tma", *SPARSE_MMA_DECODES, *GEMM_KERNELS, SPARSE_GEMM,
         SPARSE_WGMMA, SPARSE_WGMMA_MAPPED, "scratch", "scratch_mapped", "gather", "group", *LIBRARY_IMPLS)
# candidates timed eagerly as well when a CUDA graph's timing picks them (plain or ``+pdl``): their eager calls
# cost the host more than their replays. cuSPARSELt builds its plan per call (PyTorch before its 2026 fix); the
# TMA decodes make two tensor descriptors per call (fast_launch.json, this project's 2-core CPU: 39.6 against
# the plain decode's 24.8 µs of host time per 16-token call, the launch recorded, not run) and the launcher
# encodes them at each launch; the sparse-MMA decode's launch builds its arguments through ctypes
EAGER_CHECKED = ("cslt", "decode_swap_tma", "decode_resident_tma", *SPARSE_MMA_DECODES, SPARSE_GEMM, SPARSE_WGMMA,
                 SPARSE_WGMMA_MAPPED)
GEMM_MIN_TOKENS = 17   # below this the decode kernel's split-K tiles always win
CSLT_TOKEN_MULTIPLE = 8   # cuSPARSELt's dense operand takes tokens padded to this (PyTorch's semi-structured tensors
                          # pad 16-bit inputs to 8 rows for it: torch/sparse/semi_structured.py, dense_min_rows)
GATHER_MAX_TOKENS = 16
# decode_mapped is timed up to this many tokens: above it the word gather holds the weight-as-A tiles to
# fewer programs per SM than decode_plan sizes split-K for (2 where DOT_TILES_SWAP says 4 at 64 tokens, as
# compiled), and on an H100 the in-kernel map ran 5.6–7.5× slower than the gathered input at 64 tokens
MAPPED_MAX_TOKENS = 16
# the select loop's other tiles (``_tall``: 32 rows per program; ``_wide``: 256 kept values per step), each
# on the gathered input and reading the map itself, which auto weighs up to these token counts (the module
# docstring says why)
DECODE_KERNELS_TILE = {"tall": {"block_r": 32}, "wide": {"block_k": 256}}
# policies auto no longer weighs (still run when named): on an H100 (2026-11-27, bench_kernel.json, 126 auto rows)
# neither was ever picked; decode_offsets ran 5–14 % slower than decode_mapped under the same block map at 1–2
# tokens on all six shapes and within 1.6 % either way at 4–16, decode_tall within 1 % of the default tile at best
NOT_WEIGHED = ("decode_tall", "decode_offsets")
# the most tokens auto weighs these at (and bench_kernel times them at; decode_resident: nm_resident's own limit)
TILE_MAX_TOKENS = {"decode_tall": 1, "decode_wide": 2, "decode_mapped_tall": 1, "decode_mapped_wide": 1,
                   "decode_mapped_by_value": 2, "decode_resident": 2, "decode_resident_tma": 2,
                   "decode_swap_narrow": 16, "decode_swap_sync": 16, "decode_swap_spread": 64,
                   "decode_swap_spread_sync": 16, "decode_swap_tma": 64}
# decode_swap's other tiles and expansions: 2:4, 16-bit, from 2 tokens to their TILE_MAX_TOKENS
SWAP_TILES = ("decode_swap_narrow", "decode_swap_sync", "decode_swap_spread", "decode_swap_spread_sync")
# nm_decode's kernel choice per decode policy: all but the MAPPED_DECODES run on the gathered input;
# decode_mapped reads the map itself, above the select loop's tokens in the weight-as-A kernel (the
# tensor-core form whose gather the pipeline copies ahead)
DECODE_KERNELS = {"decode": {}, "decode_shallow": {"stages": 3}, "decode_mapped": {"weight_a": True},
                  "decode_mapped_by_value": {"weight_a": True, "by_group": False},
                  "decode_offsets": {"weight_a": True},
                  "decode_select": {"use_dot": False},
                  "decode_swap": {"use_dot": True, "weight_a": True},
                  "decode_swap_narrow": {"use_dot": True, "weight_a": True, "block_k": 64, "stages": 3},
                  "decode_swap_sync": {"use_dot": True, "weight_a": True, "block_r": 32, "num_warps": 2, "block_k": 64},
                  "decode_swap_spread": {"use_dot": True, "weight_a": True, "spread": True},
                  "decode_swap_spread_sync": {"use_dot": True, "weight_a": True, "block_r": 32, "num_warps": 2,
                                              "block_k": 64, "spread": True},
                  "decode_swap_tma": {"use_dot": True, "weight_a": True, "stages": 3, "tma": True},
                  **{f"{name}_{shape}": {**DECODE_KERNELS_TILE[shape], **kw}
                     for name, kw in (("decode", {}), ("decode_mapped", {"weight_a": True}))
                     for shape in ("tall", "wide")}}
# the decodes that read the index map themselves (the others read the gathered input)
MAPPED_DECODES = (*(name for name in DECODE_KERNELS if name.startswith("decode_mapped")), "decode_offsets")
# the name of one of these (the Triton kernels of the word layout, and the sparse-MMA decode) with this suffix
# launches it as a programmatic dependent (its gather too): on Hopper it starts while the kernel before it ends,
# prefetching its weight (kernels/overlap.py; the sparse-MMA decode loads its first steps' weight into registers)
PDL_KERNELS = (*DECODE_KERNELS, "decode_resident", *SPARSE_MMA_DECODES, *GEMM_KERNELS)
PDL_SUFFIX = "+pdl"


def split_pdl(impl: str) -> tuple[str, bool]:
    """``(implementation, launched as a programmatic dependent)`` of an implementation's name."""
    return impl.removesuffix(PDL_SUFFIX), impl.endswith(PDL_SUFFIX)


def known_policy(policy: str) -> bool:
    """Whether ``policy`` names something a layer can run: ``auto``, one of ``IMPLS``, or one of
    ``PDL_KERNELS`` ending in ``PDL_SUFFIX``."""
    return policy == "auto" or policy in IMPLS or split_pdl(policy)[0] in PDL_KERNELS


SKIP_ENV = "SHUFFLEPRUNE_SKIP_IMPLS"   # implementations auto never weighs in this process (skipped_impls)


def skipped_impls() -> frozenset[str]:
    """The implementations ``auto`` leaves out here: ``SHUFFLEPRUNE_SKIP_IMPLS``, names separated by commas or
    spaces, for a kernel that fails on this GPU or driver (:class:`~shuffleprune.runtime.faults.DeviceFault` names
    it); a name ending in ``PDL_SUFFIX`` leaves out only that launch of it."""
    names = frozenset(name for name in re.split(r"[,\s]+", os.environ.get(SKIP_ENV, "")) if name)
    unknown = sorted(name for name in names if name == "auto" or not known_policy(name))
    if unknown:
        raise UserError(f"{SKIP_ENV} names {', '.join(map(repr, unknown))}, which is no implementation; use names "
                        f"of shuffleprune.deploy.impls.IMPLS (decode_swap_tma, or decode{PDL_SUFFIX} for that launch alone)")
    return names


def skip_advice(impl: str) -> str:
    """What a :class:`~shuffleprune.runtime.faults.DeviceFault` advises for a faulting ``impl`` (:func:`advised_skip`
    reads the name back)."""
    return f"leave it out with {SKIP_ENV}={impl}"


def advised_skip(text: str) -> str | None:
    """The implementation the last :func:`skip_advice` in ``text`` (a failed process's output) names, or None."""
    found = re.findall(rf"{SKIP_ENV}=([\w+]+)", text)
    return found[-1] if found else None


def default_choice(candidates: list[str]) -> str:
    """What ``auto`` runs where it cannot measure: the decode kernel where it applies, else the
    shared scratch (the fastest on an H100: ``scripts/results/bench_kernel.json``)."""
    return "decode" if "decode" in candidates else "scratch"
