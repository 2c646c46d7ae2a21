"""The 2:4 decode with its inputs resident (1–2 tokens): ``y = x[..., perm] @ W_pᵀ (+ b)`` where each
program reads its inputs once, through the index map, and then streams rows past them.

The select decode of :mod:`.nm_decode` owns rows and walks the kept values: every step needs new
inputs, gathered through the map and handed to the threads that read them (sm_90a, one token of
16 rows × 128 kept values per step: 232 loop instructions through a map against 183 without,
``scripts/results/kernel_compile_sm90.json``; on an H200 the map cost 9–32 % at one token,
``bench_kernel.json``). Here a program owns one *chunk* of ``BLOCK_K`` kept values (``BLOCK_K·2``
input columns) and a range of ``ROWS`` rows: it reads its chunk's inputs once before its loop and
keeps them in registers, each thread the inputs of the groups it holds; each step then loads a
``[BLOCK_R, BLOCK_K/2]`` tile of value pairs and position codes, picks each group's two inputs
(:func:`.decode_loops.pick_and_add`) and sums each row across the chunk. The map is read once per
program, so a layer with a map runs the loop of one without. What the chunks add: each row's
float32 partial sum per chunk (8 bytes per row and chunk at 256 kept values: 1.4 % of the weight's
bytes), written in the loop and added by the last program of each row range to finish
(:func:`_sum_row_range`, in chunk order; a second launch, :func:`.split_k.sum_partials`, where no counters
can be had: the same sum, bit for bit).

2:4 with 16-bit values, either position layout (the export's words or cuSPARSELt's order). Compiled
for sm_90a (4096×4096, one token of 16 rows × 256 kept values per step): 344 loop instructions under
Triton 3.9 (349 under 3.6), 10.75 per kept value with or without a map (the select decode: 14.5 with,
11.4 without), 72 registers (64). The inputs are read as 32-bit words even without a map: read in
order, Triton laid them out so that every step moved both picked inputs through shared memory (609
instructions). Not yet timed on a GPU: ``SparseLinear``'s ``auto`` times it (``decode_resident``).
Runs on the CPU under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from shuffleprune.kernels import gpu, overlap, split_k
from shuffleprune.kernels.gpu import cdiv, next_pow2
from shuffleprune.kernels.launch import BoundLaunch, fast
from shuffleprune.kernels.nm_decode import tma_descriptors, triton, word_gather
from shuffleprune.kernels.nm_words import check_pattern, check_tiled

if triton is not None:
    import triton.language as tl

    from shuffleprune.kernels.decode_loops import gather_inputs, map_source, pick_and_add, widen, widen_pairs
    from shuffleprune.kernels.nm_words import (cslt_group_codes, group_codes, kept_tile, prefetch_positions,
                                               tma_kept_pairs)
    from shuffleprune.kernels.overlap import prefetch_rows, release_next, wait_for_inputs
    from shuffleprune.kernels.split_k import last_to_arrive, reset_counter

    @triton.jit
    def _row_sums(pair, code, x_one, x_two, DTYPE: tl.constexpr, G: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_T: tl.constexpr):
        """Each row's sum over the tile's groups, per token (``[BLOCK_R]`` twice; the second zeros at one
        token): value ``pair``s (int32, two 16-bit values of ``DTYPE``) times the inputs their ``code``
        picks among each group's four."""
        first, second = widen_pairs(pair, DTYPE)
        zero = tl.zeros((BLOCK_R, G), dtype=tl.float32)
        one = tl.sum(pick_and_add(zero, first, second, code, x_one, G), axis=1)
        if BLOCK_T == 2:
            two = tl.sum(pick_and_add(zero, first, second, code, x_two, G), axis=1)
        else:
            two = tl.zeros((BLOCK_R,), dtype=tl.float32)
        return one, two

    @triton.jit
    def _store_rows(s, tok, rows, row_ok, bias_ptr, y_ptr, part_ptr, pid_s, T, R, stride_yt,
                    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
        """Token ``tok``'s sums of ``rows`` to ``y`` (+ bias) when unsplit, else to chunk ``pid_s``'s partials."""
        ok = row_ok & (rows * 0 + tok < T)
        if SPLIT == 1:
            if HAS_BIAS:
                s += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + tok * stride_yt + rows, s.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(part_ptr + (pid_s * T + tok) * R + rows, s, mask=ok)

    @triton.jit
    def _sum_row_range(bias_ptr, y_ptr, part_ptr, count_ptr, row0, T, R, stride_yt, HAS_BIAS: tl.constexpr,
                       SPLIT: tl.constexpr, ROWS: tl.constexpr, SUM_R: tl.constexpr, BLOCK_T: tl.constexpr):
        """The chunks of row range ``program_id(1)`` count their arrivals in ``count_ptr``
        (:func:`.split_k.last_to_arrive`, as split-K's tiles do); the last adds the ``SPLIT`` partial sums of its
        ``ROWS`` rows in chunk order (the same sum, bit for bit, as :func:`.split_k.sum_partials`), ``SUM_R``
        rows at a time with the chunks unrolled, so all their loads are issued before the adds wait (a loop
        over the chunks would wait on each load in turn), adds the bias, writes ``y`` and sets its counter
        back to 0."""
        if last_to_arrive(count_ptr, tl.program_id(1), SPLIT):
            for r in tl.static_range(0, ROWS, SUM_R):
                rows = row0 + r + tl.arange(0, SUM_R)
                row_ok = rows < R
                for t in tl.static_range(BLOCK_T):
                    t_ok = row_ok & (rows * 0 + t < T)
                    total = tl.zeros((SUM_R,), dtype=tl.float32)
                    for s in tl.static_range(SPLIT):
                        total += tl.load(part_ptr + (s * T + t) * R + rows, mask=t_ok, other=0.0, cache_modifier=".cg")
                    if HAS_BIAS:
                        total += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
                    tl.store(y_ptr + t * stride_yt + rows, total.to(y_ptr.dtype.element_ty), mask=t_ok)
            reset_counter(count_ptr, tl.program_id(1))

    @triton.jit
    def _nm_resident_kernel(x_ptr, val_ptr, word_ptr, perm_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
                            T, R, K, C, WORDS, stride_xt, stride_yt,
                            BITS: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                            SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, ROWS: tl.constexpr, SUM_R: tl.constexpr,
                            STAGES: tl.constexpr, TILED: tl.constexpr, X_WORDS: tl.constexpr,
                            SUM_HERE: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
                            PREFETCH_WORDS: tl.constexpr = 0, LINE: tl.constexpr = 64, TMA: tl.constexpr = False):
        """Chunk ``program_id(0)`` (kept values ``BLOCK_K·pid …``) of rows ``ROWS·program_id(1) …``, every
        token: its inputs read once, through the map (:func:`.decode_loops.map_source`, then
        :func:`.decode_loops.gather_inputs`; ``X_WORDS``: as 32-bit words, see :func:`.decode_loops.step_inputs`),
        then ``[BLOCK_R, BLOCK_K/2]`` value pairs per step (16-byte
        evict-first loads, ``STAGES`` tiles in the software pipeline), each row's sum stored per step.
        First the chunk of its first ``PREFETCH`` rows and their ``PREFETCH_WORDS`` position words are
        requested into L2: the inputs' gather (the map, then the inputs it names, then their exchange
        through shared memory) comes before the pipeline's first weight copies in the compiled program,
        and the weight's first bytes would otherwise be asked for only after two memory round trips.
        ``PDL`` (a programmatic dependent, :mod:`.overlap`): that prefetch and the read of the chunk's map
        run while the kernel before still runs, so only the inputs' own load waits for it; nothing is read
        of the input, nor written, before that kernel has ended. ``TMA``:
        ``val_ptr`` (and without ``TILED`` ``word_ptr``) are tensor descriptors whose tiles the Tensor
        Memory Accelerator copies (:func:`.nm_words.tma_kept_pairs`; no head prefetch)."""
        G: tl.constexpr = BLOCK_K // 2
        DTYPE: tl.constexpr = x_ptr.dtype.element_ty if TMA else val_ptr.dtype.element_ty   # (tma: the same)
        pid_s = tl.program_id(0)
        toks = tl.arange(0, BLOCK_T)
        k0 = pid_s * BLOCK_K
        row0 = tl.program_id(1) * ROWS
        if PREFETCH > 0:
            first = row0 + tl.arange(0, PREFETCH)
            prefetch_rows(val_ptr, first, first < R, K, k0, k0 + BLOCK_K, BLOCK_K, LINE)
            if PREFETCH_WORDS > 0:
                prefetch_positions(word_ptr, first, first < R, k0, k0 + BLOCK_K, WORDS, BITS, PREFETCH,
                                   PREFETCH_WORDS, TILED)
        cols = (k0 // 2) * 4 + tl.arange(0, G * 4)   # the chunk's input columns, in permuted order
        col_ok = cols < C
        src = map_source(perm_ptr, cols, col_ok, HAS_PERM, 0)   # the map: no kernel writes it, so read before the wait
        wait_for_inputs(PDL)
        release_next(PDL)
        xs = widen(gather_inputs(x_ptr, src, (toks < T)[:, None] & col_ok[None, :], toks, stride_xt, X_WORDS),
                   x_ptr.dtype.element_ty)                                     # [BLOCK_T, G·4] float32
        if BLOCK_T == 1:
            x_one = tl.reshape(xs, (G * 4,))
            x_two = x_one
        else:
            x_one, x_two = tl.split(tl.trans(xs))
        for r in tl.range(row0, tl.minimum(row0 + ROWS, R), BLOCK_R, num_stages=STAGES):
            rows = r + tl.arange(0, BLOCK_R)
            row_ok = rows < R
            if TMA:
                pair, words = tma_kept_pairs(val_ptr, word_ptr, r, rows, row_ok, k0, WORDS, BITS, BLOCK_R, BLOCK_K,
                                             TILED)
            else:
                pair, words = kept_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS, 2, BITS, BLOCK_R, BLOCK_K,
                                        "evict_first", TILED, True)
            if TILED:
                code = cslt_group_codes(words, rows, BLOCK_R, BLOCK_K)
            else:
                code = group_codes(words, 2, BITS, BLOCK_R, BLOCK_K)
            one, two = _row_sums(pair, code, x_one, x_two, DTYPE, G, BLOCK_R, BLOCK_T)
            _store_rows(one, 0, rows, row_ok, bias_ptr, y_ptr, part_ptr, pid_s, T, R, stride_yt, HAS_BIAS, SPLIT)
            if BLOCK_T == 2:
                _store_rows(two, 1, rows, row_ok, bias_ptr, y_ptr, part_ptr, pid_s, T, R, stride_yt, HAS_BIAS, SPLIT)
        if SPLIT > 1 and SUM_HERE:
            _sum_row_range(bias_ptr, y_ptr, part_ptr, count_ptr, row0, T, R, stride_yt, HAS_BIAS, SPLIT, ROWS,
                           SUM_R, BLOCK_T)


RESIDENT_MAX_TOKENS = 2      # built for 4 tokens: 28-31 loop instructions per kept value, as many as the select loop's
RESIDENT_BLOCK_R = 16        # rows per step: 4 warps, 16 rows × 128 value pairs (Triton's 16-byte loads)
RESIDENT_BLOCK_K = 256       # kept values per chunk (512 input columns): the partial sums are 1.4 % of the weight
RESIDENT_PER_SM = 4          # programs per SM the row ranges are sized for (7-8 reside, as compiled for sm_90a)
RESIDENT_MAX_ROWS = 1024     # the longest row range (the last program's sum reads ROWS rows of every chunk)
SUM_ELEMENTS = 4096          # partial sums the last program of a row range loads at once (32 per thread)


def resident_applies(tokens: int, n: int, m: int, values: torch.Tensor) -> bool:
    """Whether :func:`nm_decode_resident` takes this call: 1–2 tokens of a 2:4 weight with 16-bit values."""
    return 1 <= tokens <= RESIDENT_MAX_TOKENS and (n, m) == (2, 4) and values.element_size() == 2


def resident_plan(rows: int, kept: int, tokens: int, sms: int, block_r: int = RESIDENT_BLOCK_R,
                  block_k: int | None = None, per_sm: int = RESIDENT_PER_SM, rows_per: int | None = None,
                  stages: int = 4) -> dict:
    """Chunks and row ranges for :func:`nm_decode_resident`: chunks of ``block_k`` kept values (at most
    :data:`RESIDENT_BLOCK_K`, fewer for narrow layers) and row ranges of a power of two rows such that the
    programs fill ``per_sm`` per SM, each at least ``stages`` steps of ``block_r`` rows where the layer has
    them (a program of fewer steps than its pipeline holds tiles runs no loop: 1024×4096 would take 512
    programs of one step each) and at most :data:`RESIDENT_MAX_ROWS` (``rows_per``: that many rows per
    range instead)."""
    block_k = block_k or max(16, min(RESIDENT_BLOCK_K, next_pow2(kept)))
    if block_r < 16 or block_r & (block_r - 1) or block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"the resident decode takes powers of two block_r ≥ 16 and block_k ≥ 16 (got {block_r}, "
                         f"{block_k})")
    split = cdiv(kept, block_k)
    ranges = max(1, min(cdiv(rows, block_r), cdiv(per_sm * sms, split)))
    least = min(block_r * stages, max(block_r, next_pow2(rows)))
    rows_per = rows_per or min(RESIDENT_MAX_ROWS, max(least, next_pow2(cdiv(rows, ranges))))
    if rows_per % block_r or rows_per & (rows_per - 1):
        raise ValueError(f"a row range is a power of two rows, a multiple of block_r {block_r} (got {rows_per})")
    return dict(block_r=block_r, block_k=block_k, block_t=next_pow2(tokens), split=split, rows=rows_per,
                ranges=cdiv(rows, rows_per), sum_r=min(rows_per, max(16, SUM_ELEMENTS // next_pow2(split))))


class ResidentLaunch(NamedTuple):
    """What a resident decode's shapes, dtypes and options fix: all but the tensors and split counters."""

    grid: tuple[int, int]
    split: int
    plain: BoundLaunch
    summed: BoundLaunch
    block_r: int
    block_k: int


_LAUNCHES: dict[tuple, ResidentLaunch] = {}
RESIDENT_ARGS = 15   # the kernel's positional (runtime) arguments


def nm_decode_resident(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int,
                       perm: torch.Tensor | None = None, bias: torch.Tensor | None = None, tiled: bool = False,
                       sum_in_kernel: bool | None = None, pdl: bool = False, head_prefetch: bool = True,
                       stages: int = 4, num_warps: int = 4, tma: bool = False, **plan_overrides) -> torch.Tensor:
    """``x`` ``[..., C]`` with 1–2 tokens → ``x[..., perm] @ W_pᵀ + bias`` ``[..., R]`` for a 2:4 weight with
    16-bit ``values`` in the word layout (``tiled``: cuSPARSELt's order, as :func:`.nm_decode.nm_decode`),
    by the resident-input kernel. ``sum_in_kernel`` and ``pdl`` as :func:`.nm_decode.nm_decode`;
    ``head_prefetch``: each program first requests the tiles its pipeline loads first into L2
    (:func:`prefetch_plan`; compiled for an NVIDIA GPU only); ``tma``: the weight's tiles copied by the Tensor
    Memory Accelerator instead (:func:`.nm_decode.tma_descriptors`: at least 64 kept values per chunk);
    ``plan_overrides``: :func:`resident_plan`'s ``block_r``, ``block_k``, ``per_sm`` and ``rows_per``."""
    check_pattern(n, m, bits)
    lead, cols = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, cols).contiguous()
    tokens = x2.shape[0]
    rows, kept = values.shape
    if not resident_applies(tokens, n, m, values):
        raise ValueError(f"the resident decode takes 1-{RESIDENT_MAX_TOKENS} tokens of a 2:4 weight with 16-bit values "
                         f"(got {tokens} tokens, {n}:{m}, {values.dtype})")
    device = x.device
    pdl = pdl and overlap.enabled(x)
    head_prefetch = head_prefetch and gpu.native(x) and not tma   # an L2 prefetch is PTX: not interpreted, not on ROCm
    key = (rows, kept, tokens, cols, bits, x2.dtype, values.dtype, device, gpu.sm_count(device), tiled,
           perm is None, bias is None, word_gather(x2), pdl, head_prefetch, stages, num_warps, tma,
           tuple(plan_overrides.items()))
    launch = _LAUNCHES.get(key)
    if launch is None:
        launch = _LAUNCHES[key] = _resident_launch(x2, values, bits, perm, bias, tiled, pdl, head_prefetch, stages,
                                                   num_warps, tma, plan_overrides)
    y = torch.empty(tokens, rows, dtype=x.dtype, device=device)
    part = split_k.partials(launch.split, y)
    counts = split_k.summing(launch.split, launch.grid[1], device, sum_in_kernel)
    dummy, n_words = values, words.shape[1]
    if tma:   # a descriptor holds its tensor: made per call
        values, words = tma_descriptors(x2, values, words, n, m, bits, tiled, launch.block_r, launch.block_k)
    args = (x2, values, words, perm if perm is not None else dummy, bias if bias is not None else dummy, y, part,
            counts if counts is not None else dummy, tokens, rows, kept, cols, n_words, x2.stride(0),
            y.stride(0))
    (launch.summed if counts is not None else launch.plain)(launch.grid, *args)
    if launch.split > 1 and counts is None:
        y = split_k.sum_partials(part, bias, y)
    return y.reshape(*lead, rows)


def _resident_launch(x2: torch.Tensor, values: torch.Tensor, bits: int, perm: torch.Tensor | None,
                     bias: torch.Tensor | None, tiled: bool, pdl: bool, head_prefetch: bool, stages: int,
                     num_warps: int, tma: bool, plan_overrides: dict) -> ResidentLaunch:
    """:func:`nm_decode_resident`'s plan, grid and keyword arguments, worked out once per kind of call."""
    tokens, cols = x2.shape
    rows, kept = values.shape
    p = resident_plan(rows, kept, tokens, gpu.sm_count(x2.device), stages=stages, **plan_overrides)
    check_tiled(tiled, p["block_r"])
    grid = (p["split"], p["ranges"])   # a row range's chunks launch side by side and end about together
    common = dict(BITS=bits, HAS_PERM=perm is not None, HAS_BIAS=bias is not None, SPLIT=p["split"],
                  BLOCK_R=p["block_r"], BLOCK_K=p["block_k"], BLOCK_T=p["block_t"],
                  ROWS=p["rows"], SUM_R=p["sum_r"], STAGES=stages, TILED=tiled,
                  X_WORDS=word_gather(x2), num_warps=num_warps, **({"TMA": True} if tma else {}))
    if not tma:   # the prefetch reads the weight's addresses, which a descriptor does not give
        common.update(prefetch_plan(p, tokens, values.element_size(), bits, tiled, stages if head_prefetch else 0,
                                    pdl))
    if pdl:
        common.update(PDL=True, **overlap.launch_options(True))
    kernel = fast(_nm_resident_kernel)
    return ResidentLaunch(grid, p["split"], kernel.bind(RESIDENT_ARGS, {**common, "SUM_HERE": False}),
                          kernel.bind(RESIDENT_ARGS, {**common, "SUM_HERE": True}), p["block_r"], p["block_k"])


def prefetch_plan(p: dict, tokens: int, element_bytes: int, bits: int, tiled: bool, stages: int = 0,
                  pdl: bool = False) -> dict:
    """What a program of plan ``p`` requests into L2 before anything else: its chunk of the first ``PREFETCH``
    rows of its range (a power of two, 16 or more in cuSPARSELt's order, which is prefetched by 16-row
    slices) and their position words. The rows its pipeline of ``stages`` loads first (none: 0), and a
    dependent launch (``pdl``) as many as the decode's budget allows (:func:`.overlap.decode_prefetch_bytes`:
    none at one token) if more; nothing where a chunk is shorter than a cache line."""
    chunk = p["block_k"] * element_bytes
    budget = overlap.decode_prefetch_bytes(tokens) if pdl else 0
    rows = max((stages - 1) * p["block_r"] if stages else 0, budget // max(1, p["split"] * p["ranges"] * chunk))
    rows = min(p["rows"], rows) if chunk >= overlap.LINE_BYTES else 0
    rows = 1 << (rows.bit_length() - 1) if rows else 0
    if tiled and rows < 16:
        rows = 0
    words = overlap.position_words_per_row(p["block_k"], bits, tiled) if rows else 0
    return dict(PREFETCH=rows, PREFETCH_WORDS=words, LINE=overlap.LINE_BYTES // element_bytes)
