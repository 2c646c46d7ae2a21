"""The N:M decode's loops, shared by the decode kernels (:mod:`.nm_decode`, :mod:`.nm_resident`,
:mod:`.nm_experts`): a step's inputs read once through the index map (:func:`map_source`,
:func:`step_inputs`, :func:`gather_inputs`, one step ahead: :func:`_inputs_ahead`), the tensor-core
loop (:func:`dot_loop`) and the select loop (:func:`select_loop`; by 2:4 group: :func:`_select_loop_pairs`,
:func:`widen`, :func:`widen_pairs`, :func:`pick_and_add`).

Each loop runs over kept values ``k_start … k_end`` of rows ``rows`` on a weight in the word layout of
:mod:`.nm_words` and returns float32 ``[BLOCK_R, BLOCK_T]``. Per step it loads a ``[BLOCK_R, BLOCK_K]``
value tile and its position words (16-byte evict-first loads: the weight is read once; the loop is
software-pipelined, ``stages − 1`` tiles loaded ahead by asynchronous copies) and reads the step's
``BLOCK_K·M/N`` inputs once, through the index map, for all its rows. The select loop then has each
kept value *select* its input among its group's ``M`` (a tree of selects on the position bits) and
accumulate element-wise, with one reduction after the loop; the tensor-core loop expands the tile to
dense in registers and multiplies it on the tensor cores (``tl.dot``, tokens in the MMA's rows; with
``weight_a`` the weight's rows are, so Hopper's asynchronous wgmma reads the expanded tile from
registers; with ``spread`` the 2:4 tile is expanded by broadcasts, which lets the compiler read it from
shared memory straight into that operand's layout instead of moving the expanded tile there through
shared memory).

All run on the CPU under ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

if triton is not None:
    from shuffleprune.kernels.nm_words import (cslt_group_codes, cslt_positions, dense_tile, group_codes, kept_tile,
                                               mma_step, positions, tma_dense_tile)

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
