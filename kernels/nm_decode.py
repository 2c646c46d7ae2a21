"""The N:M decode kernels (1–64 tokens): ``y = x[..., perm] @ W_pᵀ (+ b)``, bandwidth-bound, on a
weight in the word layout of :mod:`.nm_words`.

A program owns ``BLOCK_R`` rows and one split of the kept values; per step it loads a ``[BLOCK_R,
BLOCK_K]`` value tile and its position words (16-byte evict-first loads: the weight is read once; the
loop is software-pipelined, ``stages − 1`` tiles loaded ahead by asynchronous copies) and reads the
step's ``BLOCK_K·M/N`` inputs once, through the index map, for all its rows. At one and two tokens
each kept value then *selects* its input among its group's ``M`` (a tree of selects on the position
bits) and accumulates element-wise, with one reduction after the loop (:func:`select_loop`; 2:4 with
16-bit values goes by group, each group's two values one 32-bit word and its positions one 4-bit code:
:func:`_select_loop_pairs`); from
three tokens (4:8: from one) the tile is expanded to dense in registers and multiplied on the tensor
cores (:func:`dot_loop`: ``tl.dot``, tokens in the MMA's rows; with ``weight_a`` the weight's rows
are, so Hopper's asynchronous wgmma reads the expanded tile from registers; with ``spread`` the 2:4 tile
is expanded by broadcasts, which lets the compiler read it from shared memory straight into that
operand's layout instead of moving the expanded tile there through shared memory). Where the row count is
too small to fill the GPU, the kept values are split (:mod:`.split_k`). :func:`decode_plan` picks the
kernel, tile and split; the loops are shared with the MoE experts kernel (:mod:`.nm_experts`).

All run on the CPU under ``TRITON_INTERPRET=1`` (how CI checks them against float64 references).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - a Triton before host-side tensor descriptors (3.4)
    TensorDescriptor = None

from shuffleprune.kernels import gpu, overlap, split_k
from shuffleprune.kernels.gpu import cdiv, next_pow2
from shuffleprune.kernels.launch import BoundLaunch, fast
from shuffleprune.kernels.nm_words import check_pattern, check_tiled

if triton is not None:
    from shuffleprune.kernels.nm_words import (cslt_group_codes, cslt_positions, dense_tile, group_codes, kept_tile,
                                               mma_step, positions, prefetch_positions, tma_dense_tile)
    from shuffleprune.kernels.overlap import prefetch_rows, release_next, wait_for_inputs
    from shuffleprune.kernels.split_k import write_output

    @triton.jit
    def map_source(perm_ptr, cols, col_ok, HAS_PERM: tl.constexpr, MAP_SPAN: tl.constexpr):
        """The input column each permuted column ``cols`` reads: the map's entry, or with ``MAP_SPAN``
        (``perm_ptr`` holding :func:`block_map_offsets`) its offset within its aligned block, taken from
        the 32-bit word holding it (a 1-byte load stays synchronous inside the loop; a 4-byte one the
        pipeline copies ahead)."""
        if HAS_PERM:
            if MAP_SPAN > 0:
                word = tl.load(perm_ptr.to(tl.pointer_type(tl.int32)) + cols // 4, mask=col_ok, other=0)
                src = (cols // MAP_SPAN) * MAP_SPAN + ((word >> ((cols & 3) * 8)) & 0xFF)
            else:
                src = tl.load(perm_ptr + cols, mask=col_ok, other=0)
        else:
            src = cols
        return src

    @triton.jit
    def step_inputs(x_ptr, perm_ptr, k0, C, toks, tok_ok, stride_xt, N: tl.constexpr, M: tl.constexpr,
                    G: tl.constexpr, HAS_PERM: tl.constexpr, X_WORDS: tl.constexpr = False,
                    MAP_SPAN: tl.constexpr = 0):
        """The inputs of the ``G`` groups starting at kept value ``k0``, in permuted column order and
        read once through the index map: ``[BLOCK_T, G·M]`` in ``x``'s dtype. ``X_WORDS`` (16-bit
        ``x`` at a 4-byte aligned address, even row stride): each input is taken from the 32-bit word
        that holds it, so the gather is a 4-byte load — one the software pipeline turns into an
        asynchronous copy issued stages ahead, behind the map's own (a 2-byte gather stays a
        synchronous load inside the loop, and the step's weight copies wait behind it). ``MAP_SPAN``:
        the map is read as 1-byte offsets within aligned blocks of that many columns
        (:func:`map_source`), a quarter of the int32 map's bytes per step."""
        cols = (k0 // N) * M + tl.arange(0, G * M)
        col_ok = cols < C
        ok = tok_ok[:, None] & col_ok[None, :]
        return gather_inputs(x_ptr, map_source(perm_ptr, cols, col_ok, HAS_PERM, MAP_SPAN), ok, toks, stride_xt,
                             X_WORDS)

    @triton.jit
    def gather_inputs(x_ptr, src, ok, toks, stride_xt, X_WORDS: tl.constexpr = False):
        """The inputs at columns ``src`` (:func:`map_source`'s) of tokens ``toks`` where ``ok`` (``[BLOCK_T,
        len(src)]``, tokens and columns in range): ``[BLOCK_T, len(src)]`` in ``x``'s dtype (``X_WORDS``: as
        in :func:`step_inputs`)."""
        if X_WORDS:
            word = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + toks[:, None] * (stride_xt // 2) + (src // 2)[None, :],
                           mask=ok, other=0)
            half = ((word >> ((src & 1) * 16)[None, :]) & 0xFFFF).to(tl.int16)
            return half.to(x_ptr.dtype.element_ty, bitcast=True)
        return tl.load(x_ptr + toks[:, None] * stride_xt + src[None, :], mask=ok, other=0.0)

    @triton.jit
    def _inputs_ahead(x_ahead, x_ptr, perm_ptr, k0, C, toks, tok_ok, stride_xt, N: tl.constexpr, M: tl.constexpr,
                      G: tl.constexpr, BLOCK_K: tl.constexpr, HAS_PERM: tl.constexpr, AHEAD: tl.constexpr,
                      X_WORDS: tl.constexpr = False, MAP_SPAN: tl.constexpr = 0):
        """The step's inputs (:func:`step_inputs`) and the carried tile for the next step. ``AHEAD``
        (with a map read by 2-byte loads, not ``X_WORDS``): the inputs were read one step earlier, and
        the next step's are read now — such a gather depends on a load (the map's), which the
        compiler's pipeline leaves synchronous inside the loop, so each step would wait for it.
        Otherwise they are read for this step (in order, the pipeline's asynchronous copies already
        load them ahead) and the carried tile is passed on unused."""
        if AHEAD and HAS_PERM and not X_WORDS:
            xs = x_ahead
            x_ahead = step_inputs(x_ptr, perm_ptr, k0 + BLOCK_K, C, toks, tok_ok, stride_xt, N, M, G, HAS_PERM,
                                  False, MAP_SPAN)
        else:
            xs = step_inputs(x_ptr, perm_ptr, k0, C, toks, tok_ok, stride_xt, N, M, G, HAS_PERM, X_WORDS, MAP_SPAN)
        return xs, x_ahead


    @triton.jit
    def _decode_ids(R, T, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
        """A decode program's split index, its rows and the tokens (with their in-range masks)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        toks = tl.arange(0, BLOCK_T)
        return tl.program_id(1), rows, rows < R, toks, toks < T


    @triton.jit
    def _store_decode(acc, rows, row_ok, toks, tok_ok, bias_ptr, y_ptr, part_ptr, count_ptr, pid_s, T, R, stride_yt,
                      HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SUM_HERE: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_T: tl.constexpr):
        """``acc`` ``[BLOCK_R, BLOCK_T]`` (float32) to ``y`` (+ bias), or to split ``pid_s``'s partial sums
        (:func:`write_output`)."""
        write_output(acc, toks[None, :] * stride_yt + rows[:, None], toks[None, :] * R + rows[:, None],
                     row_ok[:, None] & tok_ok[None, :], rows[:, None], row_ok[:, None], bias_ptr, y_ptr, part_ptr,
                     count_ptr, pid_s, tl.program_id(0) * BLOCK_R, 0, T, R, stride_yt, HAS_BIAS, SPLIT, SUM_HERE,
                     BLOCK_R, BLOCK_T)

    @triton.jit
    def _nm_decode_kernel(x_ptr, val_ptr, word_ptr, perm_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
                          T, R, K, C, WORDS, stride_xt, stride_yt, K_PER_SPLIT,
                          N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr,
                          HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                          USE_DOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_T: tl.constexpr, STAGES: tl.constexpr, PREC: tl.constexpr = "tf32",
                          UPCAST: tl.constexpr = False, WEIGHT_A: tl.constexpr = False,
                          TILED: tl.constexpr = False, X_WORDS: tl.constexpr = False,
                          SUM_HERE: tl.constexpr = False, NATIVE: tl.constexpr = True,
                          PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0, LINE: tl.constexpr = 64,
                          PREFETCH_WORDS: tl.constexpr = 0, MAP_SPAN: tl.constexpr = 0, BY_GROUP: tl.constexpr = True,
                          TMA: tl.constexpr = False, SPREAD: tl.constexpr = False):
        """Rows ``program_id(0)``, kept values of split ``program_id(1)``, every token: the select loop
        (:func:`select_loop`: few tokens, no tensor cores, no dense tile) or, with ``USE_DOT``, the
        tensor-core loop (:func:`dot_loop`; ``PREC``, ``UPCAST``, ``WEIGHT_A`` and ``NATIVE`` are its
        own). A map's gather is read as 32-bit words the pipeline copies (``X_WORDS``, see
        :func:`step_inputs`), else a step ahead in registers (:func:`_inputs_ahead`); a map within
        aligned blocks of ``MAP_SPAN`` columns as 1-byte offsets; ``BY_GROUP``: the select loop's own;
        ``TMA``: the tensor-core loop's, ``val_ptr`` and ``word_ptr`` then tensor descriptors; ``SPREAD``: its
        expansion's (:func:`.nm_words.dense_tile`).
        ``PDL``
        (launched as a programmatic dependent, :mod:`.overlap`): the first ``PREFETCH`` kept values of
        each row and their ``PREFETCH_WORDS`` position words go to L2 while the kernel before still
        runs; nothing is read of the input, nor written, before that kernel has ended."""
        pid_s, rows, row_ok, toks, tok_ok = _decode_ids(R, T, BLOCK_R, BLOCK_T)
        k_start = pid_s * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        if PREFETCH > 0:
            prefetch_rows(val_ptr, rows, row_ok, K, k_start, k_end, PREFETCH, LINE)
        if PREFETCH_WORDS > 0:
            prefetch_positions(word_ptr, rows, row_ok, k_start, k_end, WORDS, BITS, BLOCK_R, PREFETCH_WORDS, TILED)
        wait_for_inputs(PDL)
        release_next(PDL)
        if USE_DOT:
            acc = dot_loop(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start, k_end, K, C, WORDS,
                           stride_xt, N, M, BITS, HAS_PERM, PREC, UPCAST, BLOCK_R, BLOCK_K, BLOCK_T, STAGES, WEIGHT_A,
                           TILED, X_WORDS, NATIVE, MAP_SPAN, TMA, SPREAD)
        else:
            acc = select_loop(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start, k_end, K, C,
                              WORDS, stride_xt, N, M, BITS, HAS_PERM, BLOCK_R, BLOCK_K, BLOCK_T, STAGES, TILED, X_WORDS,
                              MAP_SPAN, BY_GROUP)
        _store_decode(acc, rows, row_ok, toks, tok_ok, bias_ptr, y_ptr, part_ptr, count_ptr, pid_s, T, R, stride_yt,
                      HAS_BIAS, SPLIT, SUM_HERE, BLOCK_R, BLOCK_T)

    @triton.jit
    def dot_loop(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start, k_end, K, C, WORDS,
                 stride_xt, N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
                 PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_T: tl.constexpr, STAGES: tl.constexpr, WEIGHT_A: tl.constexpr, TILED: tl.constexpr,
                 X_WORDS: tl.constexpr, NATIVE: tl.constexpr, MAP_SPAN: tl.constexpr = 0, TMA: tl.constexpr = False,
                 SPREAD: tl.constexpr = False):
        """The tensor-core decode's loop over kept values ``k_start … k_end`` of rows ``rows`` for the input
        rows ``toks`` of ``x`` (any rows: the MoE kernel passes the tokens routed to one expert): float32
        ``[BLOCK_R, BLOCK_T]``. ``TMA``: ``val_ptr`` (and without ``TILED`` ``word_ptr``) are tensor descriptors of
        a 16-bit 2:4 weight (:func:`.nm_words.tma_dense_tile`), ``rows`` consecutive; ``SPREAD``: the other
        form of its expansion (:func:`.nm_words.dense_tile`)."""
        G: tl.constexpr = BLOCK_K // N
        if WEIGHT_A:
            acc = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        x_ahead = step_inputs(x_ptr, perm_ptr, k_start, C, toks, tok_ok, stride_xt, N, M, G, HAS_PERM, X_WORDS,
                              MAP_SPAN)
        row0 = tl.min(rows, axis=0) if TMA else 0
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            if TMA:
                dense = tma_dense_tile(val_ptr, word_ptr, row0, rows, row_ok, k0, WORDS, BITS, BLOCK_R, BLOCK_K,
                                       x_ptr.dtype.element_ty, TILED, NATIVE)
            else:
                # the byte-permute expansion but for 32 tokens in the MMA's rows (sm_90a: 1361 loop
                # instructions and 182 registers against the selects' 1267 and 150)
                dense = dense_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS, N, M, BITS, BLOCK_R, BLOCK_K,
                                   "evict_first", TILED, NATIVE, WEIGHT_A or BLOCK_T != 32, SPREAD)
            # a step ahead up to 16 tokens (at 32 the carried tile spills the 2:4 tile)
            xs, x_ahead = _inputs_ahead(x_ahead, x_ptr, perm_ptr, k0, C, toks, tok_ok, stride_xt, N, M, G, BLOCK_K,
                                        HAS_PERM, BLOCK_T <= 16, X_WORDS, MAP_SPAN)
            acc = mma_step(acc, dense, xs, WEIGHT_A, UPCAST, PREC)
        if not WEIGHT_A:
            acc = tl.trans(acc)
        return acc

    @triton.jit
    def select_loop(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start, k_end, K, C, WORDS,
                    stride_xt, N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr,
                    TILED: tl.constexpr, X_WORDS: tl.constexpr, MAP_SPAN: tl.constexpr = 0,
                    BY_GROUP: tl.constexpr = True):
        """The select decode's loop over kept values ``k_start … k_end`` of rows ``rows`` for the input rows
        ``toks`` of ``x`` (any rows, as :func:`dot_loop`): float32 ``[BLOCK_R, BLOCK_T]``. ``BY_GROUP``
        (2:4, 16-bit values, 1–2 tokens): :func:`_select_loop_pairs`; otherwise, and
        without it, each kept value selects its input in a ``[BLOCK_R, groups, N, BLOCK_T]`` tile."""
        G: tl.constexpr = BLOCK_K // N
        if BY_GROUP and BLOCK_T <= 2 and N == 2 and M == 4 and val_ptr.dtype.element_ty.primitive_bitwidth == 16:
            return _select_loop_pairs(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start, k_end,
                                      K, C, WORDS, stride_xt, N, M, BITS, HAS_PERM, BLOCK_R, BLOCK_K, BLOCK_T, STAGES,
                                      TILED, X_WORDS, MAP_SPAN)
        acc = tl.zeros((BLOCK_R, G, N, BLOCK_T), dtype=tl.float32)
        # with a map the inputs are read one step ahead (_inputs_ahead) unless the pipeline copies them (X_WORDS)
        x_ahead = step_inputs(x_ptr, perm_ptr, k_start, C, toks, tok_ok, stride_xt, N, M, G, HAS_PERM, X_WORDS,
                              MAP_SPAN)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            v, words = kept_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS, N, BITS, BLOCK_R, BLOCK_K,
                                 "evict_first", TILED)
            if TILED:
                pos = cslt_positions(words, rows, N, BLOCK_R, BLOCK_K)[:, :, :, None]
            else:
                pos = positions(words, N, BITS, BLOCK_R, BLOCK_K)[:, :, :, None]
            if M == 4:  # 2:4 and 1:4: the group's inputs read once, then a tree of 3 selects on the position's bits
                x_step, x_ahead = _inputs_ahead(x_ahead, x_ptr, perm_ptr, k0, C, toks, tok_ok, stride_xt, N, M, G,
                                                BLOCK_K, HAS_PERM, True, X_WORDS, MAP_SPAN)
                xs = tl.trans(x_step.to(tl.float32))
                even, odd = tl.split(tl.permute(tl.reshape(xs, (G, 2, 2, BLOCK_T)), (0, 3, 1, 2)))
                x0, x2 = tl.split(even)                                    # [G, BLOCK_T] each: slots 0 and 2
                x1, x3 = tl.split(odd)
                low = (pos & 1) != 0
                lo = tl.where(low, x1[None, :, None, :], x0[None, :, None, :])
                hi = tl.where(low, x3[None, :, None, :], x2[None, :, None, :])
                picked = tl.where((pos & 2) != 0, hi, lo)
            else:
                first = (k0 // N + tl.arange(0, G)) * M                   # first permuted column of each group
                picked = tl.zeros((BLOCK_R, G, N, BLOCK_T), dtype=tl.float32)
                for j in tl.static_range(M):
                    col_ok = first + j < C
                    src = map_source(perm_ptr, first + j, col_ok, HAS_PERM, MAP_SPAN)
                    xj = tl.load(x_ptr + toks[None, :] * stride_xt + src[:, None],
                                 mask=col_ok[:, None] & tok_ok[None, :], other=0.0).to(tl.float32)  # slot j of each group
                    picked = tl.where(pos == j, xj[None, :, None, :], picked)
            acc += v.to(tl.float32)[:, :, :, None] * picked
        return tl.sum(tl.reshape(acc, (BLOCK_R, BLOCK_K, BLOCK_T)), axis=1)

    @triton.jit
    def widen(v, DTYPE: tl.constexpr):
        """16-bit floats (or float32) of ``DTYPE`` to float32; bfloat16 by a shift (its bits are a float32's top half)."""
        if DTYPE == tl.bfloat16:
            return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        return v.to(tl.float32)

    @triton.jit
    def widen_pairs(pair, DTYPE: tl.constexpr):
        """int32 words each holding a 2:4 group's two 16-bit values of ``DTYPE`` → the first and the second
        as float32 (bfloat16 by a shift and a mask)."""
        if DTYPE == tl.bfloat16:
            return (pair << 16).to(tl.float32, bitcast=True), (pair & -65536).to(tl.float32, bitcast=True)
        return ((pair & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32),
                (pair >> 16).to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32))

    @triton.jit
    def pick_and_add(acc, first, second, code, xs, G: tl.constexpr):
        """``acc`` ``[BLOCK_R, G]`` plus each group's two values times the inputs their 4-bit ``code``
        picks among the group's four in ``xs`` ``[G·4]`` (float32): a tree of selects per value."""
        even, odd = tl.split(tl.reshape(xs, (G, 2, 2)))              # [G, 2] each: slots 0, 2 and 1, 3
        x0, x2 = tl.split(even)                                      # [G] each
        x1, x3 = tl.split(odd)
        x0, x1, x2, x3 = x0[None, :], x1[None, :], x2[None, :], x3[None, :]
        a = tl.where((code & 2) != 0, tl.where((code & 1) != 0, x3, x2), tl.where((code & 1) != 0, x1, x0))
        b = tl.where((code & 8) != 0, tl.where((code & 4) != 0, x3, x2), tl.where((code & 4) != 0, x1, x0))
        acc = acc + first * a      # two fused multiply-adds, not a product, a fma and an add
        return acc + second * b

    @triton.jit
    def _select_loop_pairs(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start, k_end, K, C,
                           WORDS, stride_xt, N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr,
                           HAS_PERM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                           STAGES: tl.constexpr, TILED: tl.constexpr, X_WORDS: tl.constexpr, MAP_SPAN: tl.constexpr):
        """:func:`select_loop` at one or two tokens of 2:4 with 16-bit values, by group, every tensor
        ``[BLOCK_R, groups]``: each group's two values read as one 32-bit word and widened by a shift and
        a mask (bfloat16), their positions taken from the group's 4-bit code (:func:`pick_and_add`).
        Against the 4-D select of :func:`select_loop`, its sm_90a loop at one token of 16 rows × 128
        kept values has 183 instructions instead of 217 (232 instead of 283 through an index map) under
        Triton 3.9, and 186 instead of 218 (231 instead of 276) under 3.6; never timed on a GPU, so
        ``auto`` times the per-value form through the map too (``decode_mapped_by_value``)."""
        G: tl.constexpr = BLOCK_K // N
        acc = tl.zeros((BLOCK_R, G), dtype=tl.float32)
        acc_second = tl.zeros((BLOCK_R, G), dtype=tl.float32)   # the second token's (BLOCK_T == 2)
        x_ahead = step_inputs(x_ptr, perm_ptr, k_start, C, toks, tok_ok, stride_xt, N, M, G, HAS_PERM, X_WORDS,
                              MAP_SPAN)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            pair, words = kept_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS, N, BITS, BLOCK_R, BLOCK_K,
                                    "evict_first", TILED, True)
            if TILED:
                code = cslt_group_codes(words, rows, BLOCK_R, BLOCK_K)
            else:
                code = group_codes(words, N, BITS, BLOCK_R, BLOCK_K)
            first, second = widen_pairs(pair, val_ptr.dtype.element_ty)
            x_step, x_ahead = _inputs_ahead(x_ahead, x_ptr, perm_ptr, k0, C, toks, tok_ok, stride_xt, N, M, G,
                                            BLOCK_K, HAS_PERM, True, X_WORDS, MAP_SPAN)
            xs = widen(x_step, x_ptr.dtype.element_ty)   # bfloat16 by a shift too (3.9: 183 not 198 instructions)
            # each token's inputs through a sum over a length-1 axis: Triton 3.6 then widens each input once and
            # hands it to the threads that read it, rather than widening it again in each of them (sm_90a, one
            # token through the map: 231 loop instructions, not 335; Triton 3.9 does so either way). Not for one
            # token in order at 256 kept values per step, where both compilers gave 533-542 instead of 314-316
            if BLOCK_T == 1 and not HAS_PERM and BLOCK_K > 128:
                acc = pick_and_add(acc, first, second, code, tl.reshape(xs, (G * M,)), G)
            elif BLOCK_T == 1:
                acc = pick_and_add(acc, first, second, code, tl.sum(xs, axis=0), G)
            else:
                x_one, x_two = tl.split(tl.trans(xs))
                x_one, x_two = tl.sum(x_one[None, :], axis=0), tl.sum(x_two[None, :], axis=0)
                acc = pick_and_add(acc, first, second, code, x_one, G)
                acc_second = pick_and_add(acc_second, first, second, code, x_two, G)
        if BLOCK_T == 1:
            out = tl.sum(acc, axis=1)[:, None]
        else:
            out = tl.join(tl.sum(acc, axis=1), tl.sum(acc_second, axis=1))
        return out


# tensor-core decode tiles by token tile (block_t): (block_r, dense columns per step, warps, the
# programs an SM holds by their registers as compiled for sm_90a), for the split-and-select
# expansions of 2:4 and 4:8 and the generic one of other N:M; float32 (no tensor cores, and
# spilling beyond 16 tokens) decodes at most 16 tokens on one tile
DOT_TILES = {
    (2, 4): {16: (64, 256, 4, 2), 32: (64, 256, 4, 2), 64: (64, 128, 8, 1)},
    (4, 8): {16: (64, 128, 4, 4), 32: (64, 128, 4, 2), 64: (64, 64, 8, 2)},
}
DOT_TILES_OTHER = {16: (16, 256, 4, 4), 32: (32, 256, 4, 4), 64: (64, 128, 8, 1)}
# the same kernel with the weight as the MMA's A operand (``weight_a``, "swap AB": 64 rows per warpgroup
# in the MMA's M, tokens in its N, so Hopper's asynchronous wgmma takes the expanded tile from
# registers and up to 16 stay in flight, where tokens in M (at least 64 for wgmma) fall back to
# synchronous mma with 2–32 tokens). At 2–16 tokens the tile an H100 sweep found fastest
# (tune_swap_decode.json: 64 rows × 256 columns, 2 programs per SM as compiled, 1.04–1.12× cuBLAS on
# 4096×4096 and 11008×4096 unmapped; the narrower 64-column step, 7 per SM, was slower); at 32 and 64
# narrower steps than DOT_TILES (5 — 6 with triton 3.6 — and 4 programs of 2:4 per SM against 2
# and 1: the tensor-core decode was latency-bound at 12.5 % occupancy, ncu_decode.txt). 4:8 at 2–16 tokens:
# 4 per SM (116 registers) until the split-K sum moved into the kernel, 3 since (162, no spill; 128 spills).
DOT_TILES_SWAP = {
    (2, 4): {16: (64, 256, 4, 2), 32: (64, 64, 4, 5), 64: (64, 64, 4, 4)},
    (4, 8): {16: (64, 128, 4, 3), 32: (64, 128, 4, 3), 64: (64, 128, 4, 2)},
}
# the weight-as-A tiles SparseLinear also times (its ``decode_swap_sync``: 32 rows of 2 warps, 128 dense columns
# per step, the synchronous mma) by (block_r, dense columns, warps): the programs an SM holds as compiled for
# sm_90a at 2-16 tokens of 2:4 (shared memory allows 6, registers 9)
DOT_RESIDENT_SWAP = {(32, 128, 2): 6}
# the same with the tile expanded by broadcasts (``spread``, SparseLinear's ``decode_swap_spread_sync``): no
# layout change through shared memory, so 26 KB of pipeline buffers and 88 registers (Triton 3.6; 3.9: 96),
# 8 per SM
DOT_RESIDENT_SWAP_SPREAD = {(32, 128, 2): 8}
# the same with the weight's tiles copied by the Tensor Memory Accelerator (SparseLinear's ``decode_swap_tma``,
# 2:4 on 16-bit inputs, 3 stages), by tokens: (block_r, dense columns, warps, programs per SM as compiled for
# sm_90a). No thread holds the copies' addresses, so at 16 tokens the 64 × 256 tile compiles to 126 registers,
# not 200 (Triton 3.6: 124, not 166), and 3 programs reside per SM (by shared memory), not 2. A step copies at
# least 16 bytes of position words per row (64 kept values), so at 32 and 64 tokens the step is 128 dense
# columns, twice decode_swap's: 114 and 132 registers, 4 and 3 programs per SM (by registers and by shared
# memory: 64 tokens' three take 222 of the SM's 228 KiB), 382 and 404 loop instructions per 64 × 64 kept
# values against decode_swap's 236 and 248 per 64 × 32 (issue ceilings 5.6 and 5.3 TB/s against 4.5 and 4.3)
DOT_TILES_SWAP_TMA = {16: (64, 256, 4, 3), 32: (64, 128, 4, 4), 64: (64, 128, 4, 3)}
DOT_TILE_FP32 = (16, 128, 8, 1)
DECODE_MAX_TOKENS, DECODE_MAX_TOKENS_FP32 = 64, 16
# up to this many tokens the select kernel is the default: on an H100 at 2 tokens it took 12.5–29.7 µs on
# 4096×4096, 4096×11008 and 11008×4096 (tune_select_tokens.json, 1.20–1.35× cuBLAS) where the tensor-core
# decode took 18.2–39.3 (bench_kernel.json); at 4 tokens it is below cuBLAS (19.9 µs against 17.0 on 4096×4096)
SELECT_MAX_TOKENS = 2
SELECT_LIMIT_TOKENS = 16  # the most tokens the select kernel takes (its per-token accumulators grow with them)


def selects(tokens: int, n: int, m: int) -> bool:
    """Whether :func:`plan_decode` puts ``tokens`` of an N:M weight on the select loop by default (1–2
    tokens, any N:M but 4:8, whose select chains 8 slots) rather than on the tensor cores."""
    return tokens <= SELECT_MAX_TOKENS and (n, m) != (4, 8)


def decode_max_tokens(element_bytes: int) -> int:
    """The most tokens :func:`nm_decode` takes for inputs of this element size."""
    return DECODE_MAX_TOKENS_FP32 if element_bytes >= 4 else DECODE_MAX_TOKENS


DECODE_STAGES = 4   # the decode's software pipeline: tiles in flight (fewer where a GPU's shared memory is short)
_PLANS: dict[tuple, dict] = {}   # decode_plan's answers by its arguments and the device facts it reads


def decode_plan(rows: int, kept: int, tokens: int, n: int, m: int, bits: int, device: torch.device,
                block_r: int | None = None, block_k: int | None = None, split: int | None = None,
                stages: int = DECODE_STAGES, num_warps: int | None = None, use_dot: bool | None = None,
                element_bytes: int = 2, weight_a: bool = False, by_group: bool = True, tma: bool = False,
                spread: bool = False) -> dict:
    """:func:`plan_decode`, worked out once per shape, token count, options and device facts (SM count,
    shared memory per SM) and then looked up: the host runs it at every decode launch, and working
    it out took 13–19 µs on a 2-core CPU (``scripts/results/bench_host_overhead.json``), longer than an
    H100's one-token decode of a 4096×4096 layer."""
    key = (rows, kept, tokens, n, m, bits, block_r, block_k, split, stages, num_warps, use_dot, element_bytes,
           weight_a, by_group, tma, spread, gpu.sm_count(device), gpu.smem_per_sm(device))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = plan_decode(rows, kept, tokens, n, m, bits, device, block_r, block_k, split, stages,
                                         num_warps, use_dot, element_bytes, weight_a, by_group, tma, spread)
    return dict(plan)


def plan_decode(rows: int, kept: int, tokens: int, n: int, m: int, bits: int, device: torch.device,
                block_r: int | None = None, block_k: int | None = None, split: int | None = None,
                stages: int = DECODE_STAGES, num_warps: int | None = None, use_dot: bool | None = None,
                element_bytes: int = 2, weight_a: bool = False, by_group: bool = True, tma: bool = False,
                spread: bool = False) -> dict:
    """Kernel, tile, warps, split-K and pipeline depth for :func:`nm_decode`.

    Up to :data:`SELECT_MAX_TOKENS` tokens take the select kernel (but 4:8), more the tensor-core one
    (``use_dot`` forces either; select takes at most 16). ``weight_a``: the tensor-core kernel
    multiplies with the weight tile as the MMA's A operand (:data:`DOT_TILES_SWAP`), not the inputs;
    ``by_group=False``: the select loop selects per kept value, not by 2:4 group (:func:`select_loop`);
    ``spread``: the tensor-core kernel expands 16-bit 2:4 tiles by broadcasts (:func:`.nm_words.dense_tile`). The
    tiles are the ones whose compiled loop leaves the most room under an H100's issue rate without
    spilling (``scripts/check_kernels_compile.py``): the select kernel's 16 rows × 128 kept values on 4
    warps lets one token stream at up to 5.8 TB/s of instruction issue (4.6 through an index map; Triton
    3.9, by group); the
    tensor-core kernel's 64 rows × 256 dense columns on 4 warps up to 4.2 TB/s at 3–16 tokens on 2:4
    (6.2–6.4 with ``weight_a``) and 3.4 at 32 (4:8: 64 × 128, 3.4 and 2.8 TB/s), 64 × 128 on 8 warps 3.0
    at 64 tokens (2:4 with the byte-permute expansion, :func:`_dense_2of4_pairs`). Other N:M and
    float32 take smaller tiles: larger ones spill. Split-K makes enough programs to fill every SM: one
    per SM for select (an H100's timing: fewer, longer programs beat split-K there), and for the
    tensor-core kernel as many as its pipeline buffers let reside in the SM's shared memory (2 for the
    2:4 tiles; ``tma``, the weight's tiles copied by the Tensor Memory Accelerator: its own tiles,
    :data:`DOT_TILES_SWAP_TMA`). ``stages`` tiles are in the software pipeline. Timed on an H100
    (``scripts/gpu_run.sh tune_decode`` → ``scripts/results/tune_decode_*.json``): at one token these tiles
    unsplit were within 5 % of the best of 32; the tensor-core tiles are within 3 % of the best swept, but
    at about dense speed."""
    fields = 32 // bits
    limit = decode_max_tokens(element_bytes)
    if tokens > limit:
        raise ValueError(f"nm_decode takes at most {limit} tokens of {element_bytes}-byte elements (got {tokens}); "
                         "use nm_gemm")
    if use_dot is None:  # 4:8's select chains 8 slots (2.2 TB/s at one token), its expansion does not (3.6)
        use_dot = not selects(tokens, n, m)
    if tma and not (use_dot and weight_a and (n, m) == (2, 4) and element_bytes == 2):
        raise ValueError("tma takes the weight-as-A tensor-core decode (use_dot, weight_a) of 2:4 on 16-bit inputs")
    if spread and (tma or not (use_dot and (n, m) == (2, 4) and element_bytes == 2)):
        raise ValueError("spread takes the tensor-core decode (use_dot, no tma) of 2:4 on 16-bit inputs")
    if not use_dot and tokens > SELECT_LIMIT_TOKENS:
        raise ValueError(f"the select decode takes at most {SELECT_LIMIT_TOKENS} tokens (got {tokens})")
    block_t = max(16, next_pow2(tokens)) if use_dot else next_pow2(tokens)  # tl.dot: ≥ 16
    if use_dot:
        table = DOT_TILES_SWAP if weight_a else DOT_TILES
        tile = DOT_TILE_FP32 if element_bytes >= 4 else DOT_TILES_SWAP_TMA[block_t] if tma else \
            table.get((n, m), DOT_TILES_OTHER)[block_t]
        block_r = block_r or tile[0]
        block_k = block_k or max(fields, n, tile[1] * n // m)
        num_warps = num_warps or tile[2]
        if block_r < 16 or block_k // n * m < 16:
            raise ValueError(f"the tensor-core decode needs block_r ≥ 16 and block_k·M/N ≥ 16 (got {block_r}, {block_k})")
        if tma and block_k * bits < 128:
            raise ValueError(f"tma copies at least 16 bytes of position words per row: at least {128 // bits} kept "
                             f"values per step (got {block_k})")
    else:
        block_r = block_r or 16
        block_k = block_k or max(fields, n, 128)
        num_warps = num_warps or (8 if tokens > 2 else 4)
    row_programs = cdiv(rows, block_r)
    steps = cdiv(kept, block_k)
    per_sm = 1   # select: split only when the rows leave SMs idle (an H100 timed split-K's partial sums
                 # and their reduction as slower than one program per SM streaming more rows)
    if use_dot:  # as many as the registers (the tile's compile) and the pipeline's buffers let reside
        buffers = max(1, stages - 1) * (block_r * block_k * element_bytes + block_r * block_k * bits // 8
                                        + block_t * block_k * m // n * element_bytes)   # stages − 1 loads ahead
        if (block_r, num_warps) == (tile[0], tile[2]):
            by_registers = tile[3]
        else:   # another tile SparseLinear times, or one being tuned: up to 4
            resident = DOT_RESIDENT_SWAP_SPREAD if spread else DOT_RESIDENT_SWAP
            by_registers = resident.get((block_r, block_k * m // n, num_warps), 4) if weight_a else 4
        per_sm = max(1, min(by_registers, gpu.smem_per_sm(device) // buffers))
    if split is None:
        slots = per_sm * gpu.sm_count(device)
        split = max(1, min(steps, cdiv(slots, row_programs)))
        if use_dot:  # the split with the fewest waves per unit of work (ties: fewer partial sums)
            split = min(range(1, min(steps, 2 * split) + 1),
                        key=lambda s: (cdiv(row_programs * s, slots) / s, s))
    per_split = cdiv(steps, split) * block_k
    split = cdiv(kept, per_split)
    return dict(block_r=block_r, block_k=block_k, block_t=block_t, split=split, per_split=per_split, stages=stages,
                num_warps=num_warps, use_dot=use_dot, per_sm=per_sm, weight_a=weight_a and use_dot,
                by_group=by_group or use_dot, tma=tma, spread=spread)


def word_gather(x2: torch.Tensor) -> bool:
    """Whether the decode kernels can read ``x2`` ``[T, C]`` through an index map as 32-bit words
    (``X_WORDS``): 16-bit elements, a 4-byte aligned start and an even row stride."""
    return x2.element_size() == 2 and x2.data_ptr() % 4 == 0 and x2.stride(0) % 2 == 0


def nm_decode(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int,
              perm: torch.Tensor | None = None, bias: torch.Tensor | None = None, tiled: bool = False,
              async_gather: bool | None = None, sum_in_kernel: bool | None = None, pdl: bool = False,
              block_map: tuple[torch.Tensor, int] | None = None, **plan_overrides) -> torch.Tensor:
    """``x`` ``[..., C]`` with at most :func:`decode_max_tokens` tokens (64; float32: 16) →
    ``x[..., perm] @ W_pᵀ + bias`` ``[..., R]``. ``tiled``: ``words`` ``[R, C/32]`` hold 2:4
    positions in cuSPARSELt's order (:func:`shuffleprune.deploy.cslt_layout.cslt_words`), not row
    by row; the same holds for :func:`nm_gemm` and :func:`nm_decompress_into`. ``async_gather``:
    the select kernel and the weight-as-A tensor-core kernel read the map's gather as 32-bit words
    the pipeline copies ahead (default: wherever :func:`word_gather` allows; the other tensor-core
    kernel would spill with them), ``False`` one step ahead in registers (to 16 tokens).
    ``sum_in_kernel``: split-K's last program of each row tile adds the partial sums (default, see
    :func:`.split_k.split_counters`); ``False``: a second launch does (:func:`.split_k.sum_partials`).
    ``pdl``: launch as a programmatic dependent that prefetches its weight's first part into L2 while
    the kernel before it ends (:mod:`.overlap`; where :func:`.overlap.enabled`, else an ordinary
    launch: the same result either way). ``block_map``: ``perm`` again as ``(offsets, span)``
    (:func:`block_map_offsets`, a map within aligned blocks of ``span`` columns): the kernel reads the
    map as those 1-byte offsets, a quarter of the int32 map's bytes. ``tma=True`` (with ``use_dot`` and
    ``weight_a``): the weight's tiles are copied by the Tensor Memory Accelerator, where
    :func:`tma_applies`."""
    lead, cols = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, cols).contiguous()
    tokens = x2.shape[0]
    rows, kept = values.shape
    if tokens == 0:   # nothing to launch (a tile of no tokens does not compile)
        check_pattern(n, m, bits)
        return x.new_empty(*lead, rows)
    device = x.device
    pdl = pdl and overlap.enabled(x)
    span = block_span(block_map, perm, cols)
    key = (rows, kept, tokens, cols, n, m, bits, x2.dtype, values.dtype, device, gpu.sm_count(device),
           gpu.smem_per_sm(device), tiled, perm is None, bias is None, perm is not None and word_gather(x2),
           async_gather, pdl, span, tuple(plan_overrides.items()))
    launch = _LAUNCHES.get(key)
    if span:
        perm = block_map[0]
    if launch is None or launch.plain.fast_kernel.kernel is not _nm_decode_kernel:   # (a kernel swapped in)
        def first(stages: int) -> tuple[DecodeLaunch, torch.Tensor]:   # the launch at this pipeline depth, run
            fitted = _decode_launch(x2, values, n, m, bits, perm, bias, tiled, async_gather, pdl, span,
                                    {**plan_overrides, "stages": stages})
            return fitted, _run_decode(fitted, x2, values, words, perm, bias, sum_in_kernel, tokens, rows, kept, cols,
                                       device)

        # the plan's depth, or on a GPU with less shared memory than Hopper's the deepest that fits
        launch, y = gpu.with_fewer_stages(first, plan_overrides.get("stages", DECODE_STAGES))[1]
        _LAUNCHES[key] = launch
    else:
        y = _run_decode(launch, x2, values, words, perm, bias, sum_in_kernel, tokens, rows, kept, cols, device)
    return y.reshape(*lead, rows)


def _run_decode(launch: DecodeLaunch, x2: torch.Tensor, values: torch.Tensor, words: torch.Tensor,
                perm: torch.Tensor | None, bias: torch.Tensor | None, sum_in_kernel: bool | None, tokens: int,
                rows: int, kept: int, cols: int, device: torch.device) -> torch.Tensor:
    """One :func:`nm_decode` launch (and split-K's separate sum where the kernel does not add its partial
    sums) of ``x2`` ``[tokens, cols]`` on ``values`` ``[rows, kept]``: ``y`` ``[tokens, rows]``."""
    y = torch.empty(tokens, rows, dtype=x2.dtype, device=device)
    split = launch.split
    part = split_k.partials(split, y)
    counts = split_k.summing(split, launch.grid[0], device, sum_in_kernel)
    dummy, n_words = values, words.shape[1]
    if launch.tma is not None:   # a descriptor holds its tensor: made per call
        values, words = tma_descriptors(x2, values, words, *launch.tma)
    args = (x2, values, words, perm if perm is not None else dummy, bias if bias is not None else dummy, y, part,
            counts if counts is not None else dummy, tokens, rows, kept, cols, n_words, x2.stride(0),
            y.stride(0), launch.per_split)
    (launch.summed if counts is not None else launch.plain)(launch.grid, *args)
    if split > 1 and counts is None:
        y = split_k.sum_partials(part, bias, y)
    return y


class DecodeLaunch(NamedTuple):
    """What a decode launch's shapes, dtypes and options fix (:func:`_decode_launch`): everything but
    the tensors' addresses and split-K's arrival counters, which change from call to call."""

    grid: tuple[int, int]
    split: int
    per_split: int
    plain: BoundLaunch    # the kernel with its keyword arguments (compile-time constants, warps, launch options)
    summed: BoundLaunch   # the same for a split-K launch that adds its partial sums in the kernel
    tma: tuple | None = None   # tma_descriptors' arguments after the tensors: N, M, bits, tiled and the tile


_LAUNCHES: dict[tuple, DecodeLaunch] = {}   # nm_decode's launches by everything that fixes them
DECODE_ARGS = 16   # the decode kernel's positional (runtime) arguments, as nm_decode passes them


def _decode_launch(x2: torch.Tensor, values: torch.Tensor, n: int, m: int, bits: int, perm: torch.Tensor | None,
                   bias: torch.Tensor | None, tiled: bool, async_gather: bool | None, pdl: bool, span: int,
                   plan_overrides: dict) -> DecodeLaunch:
    """:func:`nm_decode`'s plan, grid and keyword arguments for ``x2`` ``[T, C]`` on ``values``, worked
    out once per kind of call and then looked up (:data:`_LAUNCHES`): an eager decode step launches
    several per decoder layer, and the host's work per launch is what a plain ``generate()`` waits
    on (``scripts/bench_host_overhead.py``)."""
    check_pattern(n, m, bits)
    tokens, cols = x2.shape
    rows, kept = values.shape
    p = decode_plan(rows, kept, tokens, n, m, bits, x2.device, element_bytes=x2.element_size(), **plan_overrides)
    check_tiled(tiled, p["block_r"])
    can_words = perm is not None and word_gather(x2) and (not p["use_dot"] or p["weight_a"])
    if async_gather and perm is not None and not can_words:
        raise ValueError("async_gather needs the select kernel or weight_a, and 16-bit inputs at a 4-byte aligned "
                         "address with an even row stride")
    grid = (cdiv(rows, p["block_r"]), p["split"])
    common = dict(N=n, M=m, BITS=bits, HAS_PERM=perm is not None, HAS_BIAS=bias is not None, SPLIT=p["split"],
                  BLOCK_R=p["block_r"], BLOCK_K=p["block_k"], BLOCK_T=p["block_t"], STAGES=p["stages"],
                  TILED=tiled, X_WORDS=can_words and async_gather is not False, num_warps=p["num_warps"],
                  **({"MAP_SPAN": span} if span else {}), **({} if p["by_group"] else {"BY_GROUP": False}))
    if p["tma"]:   # what the descriptors can read is checked where they are made (tma_descriptors)
        common["TMA"] = True
    if p["spread"]:
        common["SPREAD"] = True
    if pdl and not p["tma"]:   # each program prefetches its rows' first kept values of its split, and their positions
        share = overlap.prefetch_per_row(grid[0] * grid[1], p["block_r"], p["per_split"], values.element_size(),
                                         overlap.decode_prefetch_bytes(tokens))
        common.update(PDL=True, LINE=overlap.LINE_BYTES // values.element_size(), PREFETCH=share,
                      PREFETCH_WORDS=overlap.position_words_per_row(share, bits, tiled))
    dot = dict(PREC=gpu.precision(x2), UPCAST=gpu.upcast(x2), WEIGHT_A=p["weight_a"], NATIVE=gpu.native(x2))
    plain = dict(USE_DOT=p["use_dot"], **(dot if p["use_dot"] else {}), **common, SUM_HERE=False,
                 **overlap.launch_options(pdl))
    kernel = fast(_nm_decode_kernel)
    return DecodeLaunch(grid, p["split"], p["per_split"], kernel.bind(DECODE_ARGS, plain),
                        kernel.bind(DECODE_ARGS, {**plain, "SUM_HERE": True}),
                        (n, m, bits, tiled, p["block_r"], p["block_k"]) if p["tma"] else None)


def tma_applies(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, n: int, m: int, tiled: bool) -> bool:
    """Whether :func:`nm_decode` may read this weight by tensor descriptors (``tma=True``): 2:4 values of
    ``x``'s 16-bit dtype and (in the export's layout; cuSPARSELt's order is read as without) the int32
    position words, each contiguous at a 16-byte aligned address with rows a multiple of 16 bytes (the
    Tensor Memory Accelerator's terms), on a device that has one (:func:`.gpu.tma`) and a Triton with
    tensor descriptors."""
    described = (values,) if tiled else (values, words)
    return (TensorDescriptor is not None and (n, m) == (2, 4) and gpu.tma(x) and values.dtype == x.dtype
            and values.element_size() == 2 and (tiled or words.dtype == torch.int32)
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 and t.shape[1] * t.element_size() % 16 == 0
                    for t in described))


def tma_descriptors(x2: torch.Tensor, values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int,
                    tiled: bool, block_r: int, block_k: int) -> tuple:
    """The ``TMA`` weight arguments of a decode of ``x2``: a tensor descriptor of the 16-bit 2:4 value pairs
    as int32 ``[R, K/2]`` in blocks ``[block_r, block_k/2]``, and one of the position words in blocks
    ``[block_r, block_k·bits/32]`` (``tiled``: the words as they are). Made per call: a descriptor holds
    its tensor. Refuses what :func:`tma_applies` refuses, and steps of under 16 bytes of words per row."""
    if not tma_applies(x2, values, words, n, m, tiled) or block_k * bits < 128:
        raise ValueError("tma needs 2:4 values of the inputs' 16-bit dtype and int32 position words, contiguous, "
                         "16-byte aligned, rows a multiple of 16 bytes, at least 64 kept values per step, on "
                         "sm_90 or later")
    pairs = TensorDescriptor.from_tensor(values.view(torch.int32), [block_r, block_k // 2])
    return pairs, words if tiled else TensorDescriptor.from_tensor(words, [block_r, block_k * bits // 32])


MAX_BLOCK_SPAN = 256   # the widest block whose offsets fit one byte


def block_map_offsets(perm: torch.Tensor, span: int) -> torch.Tensor:
    """An index map within aligned blocks of ``span`` columns (``perm[c] // span == c // span``, as
    :func:`shuffleprune.deploy.input_gather.map_span` finds; the last block may be cut short) as each
    column's offset within its block, one byte each (``uint8 [C]``): what the decode kernels read
    instead of the int32 map."""
    if not 0 < span <= MAX_BLOCK_SPAN or span & (span - 1):
        raise ValueError(f"a block map's span is a power of two up to {MAX_BLOCK_SPAN}, not {span}")
    base = torch.arange(perm.numel(), device=perm.device) // span * span
    offsets = perm.long() - base
    if bool(((offsets < 0) | (offsets >= span)).any()):
        raise ValueError(f"this map leaves its blocks of {span} columns: use its map_span")
    return offsets.to(torch.uint8)


def block_span(block_map: tuple[torch.Tensor, int] | None, perm: torch.Tensor | None, cols: int) -> int:
    """The span :func:`nm_decode` reads ``block_map`` with: its own where there is a map and the offsets
    cover the input's ``cols`` columns, a multiple of 4, from a 4-byte aligned address (the kernels
    read them as 32-bit words); else 0 (the int32 map is read)."""
    if block_map is None or perm is None or block_map[0].numel() != cols or cols % 4 or \
            block_map[0].data_ptr() % 4:   # read as 32-bit words
        return 0
    return block_map[1]
