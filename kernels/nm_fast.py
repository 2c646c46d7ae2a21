"""Triton kernels for a compressed N:M weight in the *word* layout (see :func:`position_words`):
``values`` ``[R, K]`` (``K = C·N/M`` kept values per row, model dtype) and ``words`` int32
``[R, W]``: the in-group positions as ``BITS``-bit fields, ``32 / BITS`` per 32-bit word (value
``k`` of a row in bits ``BITS·(k mod F)…`` of word ``k // F``, ``F = 32 / BITS``) — the same bits as
the export's byte layout, read four bytes at a time.

- :func:`nm_decode` (1–64 tokens): ``y = x[..., perm] @ W_pᵀ (+ b)``, bandwidth-bound. A program
  owns ``BLOCK_R`` rows and one split of the kept values; per step it loads a ``[BLOCK_R,
  BLOCK_K]`` value tile and its position words (16-byte evict-first loads: the weight is read once;
  the loop is software-pipelined, ``stages − 1`` tiles loaded ahead by asynchronous copies) and
  reads the step's ``BLOCK_K·M/N`` inputs once, through the index map, for all its rows. At one
  and two tokens each kept value then *selects* its input among its group's ``M`` (a tree of
  selects on the position bits) and accumulates element-wise, with one reduction after the loop;
  from three tokens (4:8: from one) the tile is expanded to dense in registers and multiplied on the tensor cores
  (``tl.dot``, tokens in the MMA's rows; with ``weight_a`` the weight's rows are, so Hopper's
  asynchronous wgmma reads the expanded tile from registers). 2:4 and 4:8 tiles expand by splitting each group's values
  apart and giving every dense slot a select per value it can hold (:func:`_dense_2of4`,
  :func:`_dense_4of8`); other N:M sum ``M`` masked copies. Which costs fewer instructions per byte
  was read off the compiled sm_90a loops (``kernels/compile_check.py``). Where the row count is too small to fill
  the GPU, split-K's float32 partial sums are added, with the bias, by the split that finishes last
  (:func:`split_counters`; a second, small kernel where it cannot).
- :func:`nm_gemm` (prefill, from 17 tokens): a tiled GEMM ``y = x_p @ W_pᵀ`` over already-permuted
  inputs whose weight tiles are decompressed in registers (the same expansion) for ``tl.dot``; its
  tile and split-K come from a cost model (:func:`gemm_plan`) over tiles compiled for sm_90a;
  ``weight_a`` again puts the weight in the MMA's A operand.
- :func:`nm_decompress_into`: the dense ``W_p`` written into a caller's buffer (the shared scratch
  a dense matmul reads; no layer keeps a dense copy).

All run on the CPU under ``TRITON_INTERPRET=1`` (how CI checks them against float64 references).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None


def position_words(meta: torch.Tensor) -> torch.Tensor:
    """The export's ``uint8`` positions ``[R, B]`` as int32 words ``[R, ⌈B/4⌉]`` (a view when every row
    is a whole number of words, else one padded copy made at load)."""
    rows, nbytes = meta.shape
    if nbytes % 4:
        meta = torch.nn.functional.pad(meta, (0, -nbytes % 4))
    meta = meta.contiguous()
    return meta.view(torch.int32)


if triton is not None:
    @triton.jit
    def _kept_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS,
                   N: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                   EVICT: tl.constexpr, TILED: tl.constexpr, PAIRS: tl.constexpr = False):
        """Rows ``rows`` × kept values ``k0 … k0+BLOCK_K``: values ``[BLOCK_R, BLOCK_K/N, N]`` (``PAIRS``:
        each 2:4 group's two 16-bit values as one int32 word, ``[BLOCK_R, BLOCK_K/2]``) and their
        position words ``[BLOCK_R, BLOCK_K·BITS/32]`` (read them with :func:`_positions` or
        :func:`_group_codes`). ``EVICT``: the loads' eviction policy (``"evict_first"`` where the
        weight is read once, ``""`` where tiles are reused). ``TILED``: ``word_ptr`` holds 2:4
        positions in cuSPARSELt's order (:mod:`shuffleprune.deploy.cslt_layout`): with 2, read by
        16-row slices and turned into the same words (``BLOCK_R % 16 == 0``); with 1, the raw 64-bit
        pair of each row and word, for :func:`_cslt_positions` (the select loop)."""
        F: tl.constexpr = 32 // BITS
        WPB: tl.constexpr = BLOCK_K // F
        if not PAIRS:   # the pairs are read after the words: read before them, the GEMM's loop took 5 % more
            ks = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(val_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0,
                        eviction_policy=EVICT)
            v = tl.reshape(v, (BLOCK_R, BLOCK_K // N, N))
        wi = k0 // F + tl.arange(0, WPB)
        w_ok = row_ok[:, None] & (wi < WORDS)[None, :]
        if TILED == 1:
            words = tl.load(word_ptr.to(tl.pointer_type(tl.int64)) + _cslt_pair(rows, wi, WORDS), mask=w_ok,
                            other=0, eviction_policy=EVICT)
        elif TILED == 2:
            words = _cslt_words_slices(word_ptr, rows, wi, row_ok, WORDS, EVICT, BLOCK_R, WPB)
        else:
            words = tl.load(word_ptr + rows[:, None] * WORDS + wi[None, :], mask=w_ok, other=0, eviction_policy=EVICT)
        if PAIRS:
            gs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            v = tl.load(val_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 2) + gs[None, :],
                        mask=row_ok[:, None] & (gs < K // 2)[None, :], other=0, eviction_policy=EVICT)
        return v, words

    @triton.jit
    def _cslt_pair(rows, wi, WORDS):
        """Index (in 64-bit pairs) of the metadata pair holding word ``wi`` of row ``rows`` in cuSPARSELt's
        order: a 64-row band takes ``32·WORDS`` pairs, an 8-group tile 32 of them, and row ``16a + 8b
        + c`` of the band lies in the tile's pair ``8a + c`` (:mod:`shuffleprune.deploy.cslt_layout`)."""
        t = rows % 64
        return ((rows // 64) * (32 * WORDS) + (t // 16) * 8 + t % 8)[:, None] + wi[None, :] * 32

    @triton.jit
    def _cslt_words_slices(meta_ptr, rows, wi, row_ok, WORDS, EVICT: tl.constexpr, BLOCK_R: tl.constexpr,
                           WPB: tl.constexpr):
        """Words ``wi`` (8 groups each) of rows ``rows`` (``BLOCK_R`` from a multiple of 16) from
        cuSPARSELt's 2:4 metadata (``meta_ptr``, int32): a 64-row band takes ``64·WORDS`` words, each
        8-group tile 64 of them; row ``16a + 8b + c`` of a tile lies in its 64-bit pair ``8a + c``, in
        the low (``b = 0``) or high nibbles, groups in the order 0 4 1 5 | 2 6 3 7 (learned on an
        H100, ``scripts/results/sparse_tc_layout.json``). Each 16-row slice's 8 pairs per tile (64
        contiguous bytes) are read as such and regrouped into rows in registers: the tensor-core
        kernels' read (on an H100 at 2–16 tokens as fast as the export's words; one pair per row
        was 1.2–1.3× slower there, ``scripts/results/bench_kernel_cslt*.json``)."""
        Q: tl.constexpr = BLOCK_R // 16
        qs = tl.max(tl.reshape(rows // 16, (Q, 16)), axis=1)            # each 16-row slice's index
        q_ok = tl.max(tl.reshape(row_ok.to(tl.int32), (Q, 16)), axis=1) > 0
        addr = _cslt_pair(qs * 16, wi, WORDS)[:, :, None] + tl.arange(0, 8)[None, None, :]   # the slice's 8 pairs
        ok = q_ok[:, None, None] & (wi < WORDS)[None, :, None]
        pairs = tl.load(meta_ptr.to(tl.pointer_type(tl.int64)) + addr, mask=ok, other=0, eviction_policy=EVICT)
        lo, hi = pairs.to(tl.int32), (pairs >> 32).to(tl.int32)          # [Q, WPB, 8]
        words = tl.join(_pair_word(lo, hi, 0), _pair_word(lo, hi, 4))    # [Q, WPB, 8 (c), 2 (b)]
        return tl.reshape(tl.permute(words, (0, 3, 2, 1)), (BLOCK_R, WPB))

    @triton.jit
    def _pair_word(lo, hi, shift):
        """One row's 8 group codes from a metadata pair (its nibbles at ``shift``) as an export word."""
        x = (lo >> shift) & 0x0F0F0F0F           # bytes: groups 0 4 1 5, one nibble each
        y = (hi >> shift) & 0x0F0F0F0F           # groups 2 6 3 7
        x = (x | (x >> 12)) & 0xFFFF             # groups 0 1 4 5
        y = (y | (y >> 12)) & 0xFFFF             # groups 2 3 6 7
        return (x & 0xFF) | ((y & 0xFF) << 8) | ((x >> 8) << 16) | ((y >> 8) << 24)

    @triton.jit
    def _cslt_positions(pairs, rows, N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """2:4 positions ``[BLOCK_R, BLOCK_K/2, 2]`` straight from cuSPARSELt's 64-bit pairs ``[BLOCK_R,
        BLOCK_K/16]`` (one per row and 8 groups): kept value ``k`` of a word (group ``g = k//2``) lies
        at bit ``32·((g>>1)&1) + 8·(2·(g&1) + (g>>2)) + 2·(k&1)``, plus 4 for rows ``16a + 8 + c``.
        Decoded in the loop's own layout, the pairs go from the asynchronous copy's buffer straight
        into registers (sm_90a: 234 loop instructions and 2 barriers, as on the export's words;
        regrouping them into words first cost a second pass through shared memory and a barrier)."""
        k = tl.arange(0, 16)
        g = k // 2
        offs = 32 * ((g >> 1) & 1) + 8 * (2 * (g & 1) + (g >> 2)) + 2 * (k & 1)
        shift = (((rows % 64) // 8) % 2) * 4
        bit = (offs[None, None, :] + shift[:, None, None]).to(tl.int64)
        pos = (tl.broadcast_to(pairs[:, :, None], (BLOCK_R, BLOCK_K // 16, 16)) >> bit) & 3
        return tl.reshape(pos.to(tl.int32), (BLOCK_R, BLOCK_K // N, N))

    @triton.jit
    def _positions(words, N: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Position words ``[BLOCK_R, W]`` → each kept value's in-group position ``[BLOCK_R, BLOCK_K/N, N]``."""
        F: tl.constexpr = 32 // BITS
        shifts = tl.arange(0, F) * BITS
        pos = (tl.broadcast_to(words[:, :, None], (BLOCK_R, BLOCK_K // F, F)) >> shifts[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(pos, (BLOCK_R, BLOCK_K // N, N))

    @triton.jit
    def _group_codes(words, N: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Position words ``[BLOCK_R, W]`` → each group's ``N·BITS``-bit code ``[BLOCK_R, BLOCK_K/N]`` (the
        group's ``j``-th position in bits ``BITS·j…``)."""
        GPW: tl.constexpr = 32 // (N * BITS)       # groups per word
        shifts = tl.arange(0, GPW) * (N * BITS)
        code = (tl.broadcast_to(words[:, :, None], (BLOCK_R, BLOCK_K // N // GPW, GPW)) >> shifts[None, None, :])
        return tl.reshape(code & ((1 << (N * BITS)) - 1), (BLOCK_R, BLOCK_K // N))

    @triton.jit
    def _dense_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS,
                    N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVICT: tl.constexpr, TILED: tl.constexpr, NATIVE: tl.constexpr,
                    PAIRS: tl.constexpr = True):
        """Rows ``rows`` × kept values ``k0 … k0+BLOCK_K`` expanded to their ``BLOCK_K·M/N`` dense
        columns (zeros where pruned), in the values' dtype. 16-bit 2:4 values are read as one 32-bit
        word per group and expanded by byte permutes (:func:`_dense_2of4_pairs`; ``NATIVE``: PTX's
        ``prmt``, else its emulation), unless ``PAIRS`` is off."""
        G: tl.constexpr = BLOCK_K // N
        AS_PAIRS: tl.constexpr = N == 2 and M == 4 and PAIRS and val_ptr.dtype.element_ty.primitive_bitwidth == 16
        v, words = _kept_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS, N, BITS, BLOCK_R, BLOCK_K, EVICT,
                              2 * TILED, AS_PAIRS)
        # one return at the end: Triton compiles the statements after a constexpr branch's return, and
        # ``v`` holds int32 pairs in the first branch only
        if AS_PAIRS:
            dense = _dense_2of4_pairs(v, _group_codes(words, N, BITS, BLOCK_R, BLOCK_K), BLOCK_R, G,
                                      val_ptr.dtype.element_ty, NATIVE)
        elif N == 2 and M == 4:
            dense = _dense_2of4(v, _group_codes(words, N, BITS, BLOCK_R, BLOCK_K), BLOCK_R, G)
        elif N == 4 and M == 8:
            dense = _dense_4of8(v, _group_codes(words, N, BITS, BLOCK_R, BLOCK_K), BLOCK_R, G)
        else:
            pos = _positions(words, N, BITS, BLOCK_R, BLOCK_K)
            hit = pos[:, :, :, None] == tl.arange(0, M)[None, None, None, :]
            vals = v[:, :, :, None]
            dense = tl.reshape(tl.sum(tl.where(hit, vals, tl.zeros_like(vals)), axis=2), (BLOCK_R, G * M))
        return dense

    @triton.jit
    def _prmt(a, sel, NATIVE: tl.constexpr):
        """PTX ``prmt.b32 d, a, 0, sel``: byte ``k`` of ``d`` is byte ``sel``'s nibble ``k`` (0–3: of ``a``, 4–7:
        of the zero word) — one instruction on the GPU, emulated by shifts under the interpreter."""
        if NATIVE:
            return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, $2;", "=r,r,r", [a, sel], dtype=tl.int32,
                                             is_pure=True, pack=1)
        out = tl.zeros_like(a)
        for k in tl.static_range(4):
            idx = (sel >> (4 * k)) & 7
            byte = tl.where(idx < 4, (a >> (8 * (idx & 3))) & 0xFF, 0)
            out |= byte << (8 * k)
        return out

    @triton.jit
    def _dense_2of4_pairs(pairs, code, BLOCK_R: tl.constexpr, G: tl.constexpr, DTYPE: tl.constexpr,
                          NATIVE: tl.constexpr):
        """16-bit 2:4 groups, each value pair as one 32-bit word ``[BLOCK_R, G]`` (first value in the low
        half), and their 4-bit codes → ``[BLOCK_R, G·4]`` dense in ``DTYPE`` by two byte permutes per
        group: dense slots 0–1 and 2–3 are each a ``prmt`` of the pair and zero, whose selector — bytes
        0–1 of the pair (``10``) at slot ``p0``, bytes 2–3 (``32``) at slot ``p1``, zero (``44``)
        elsewhere — is ``0x4444`` with ``0x54 ≪ 8·p0`` and ``0x76 ≪ 8·p1`` XORed in (``p0 < p1``: they
        never overlap; the upper half's selector is the same word shifted down 16 bits). About 11
        instructions per group where :func:`_dense_2of4`'s selects took about 22 (sm_90a: the 16-token
        decode's loop 968 → 669 instructions with the weight as the A operand, 917 → 762 without; the
        512-token GEMM's 151 → 130)."""
        t = ((0x54 << ((code << 3) & 0x18)) | (0x76 << ((code << 1) & 0x18))) ^ 0x44444444
        lo = _prmt(pairs, t, NATIVE)
        hi = _prmt(pairs, t >> 16, NATIVE)
        words = tl.reshape(tl.join(lo, hi), (BLOCK_R, G * 2))
        halves = tl.join(words & 0xFFFF, words >> 16).to(tl.int16)
        return tl.reshape(halves.to(DTYPE, bitcast=True), (BLOCK_R, G * 4))

    @triton.jit
    def _dense_2of4(v, code, BLOCK_R: tl.constexpr, G: tl.constexpr):
        """2:4 groups (values ``[BLOCK_R, G, 2]``, 4-bit codes of increasing positions ``[BLOCK_R,
        G]``, as ``check_compressed`` guarantees) → ``[BLOCK_R, G·4]`` dense.

        The two values are split apart in registers and each dense slot takes at most two selects
        (slot 0 can only hold the first value, slot 3 only the second); the four slots are
        interleaved back by joins. The generic expansion sums ``M`` masked copies over the ``N``
        axis, which the compiler lays across lanes (shuffles every step); this one costs about half
        its loop instructions (``scripts/check_kernels_compile.py``)."""
        v0, v1 = tl.split(v)
        p0, p1 = code & 3, code >> 2
        z = tl.zeros_like(v0)
        d0 = tl.where(p0 == 0, v0, z)
        d1 = tl.where(p0 == 1, v0, tl.where(p1 == 1, v1, z))
        d2 = tl.where(p0 == 2, v0, tl.where(p1 == 2, v1, z))
        d3 = tl.where(p1 == 3, v1, z)
        # join(join(d0, d2), join(d1, d3))[..., i, j] is slot 2i + j: the reshape lays the slots in order
        return tl.reshape(tl.join(tl.join(d0, d2), tl.join(d1, d3)), (BLOCK_R, G * 4))

    @triton.jit
    def _dense_4of8(v, code, BLOCK_R: tl.constexpr, G: tl.constexpr):
        """4:8 groups (values ``[BLOCK_R, G, 4]``, 16-bit codes of increasing 4-bit positions) →
        ``[BLOCK_R, G·8]`` dense, as :func:`_dense_2of4`: slot ``s`` can only hold values
        ``max(0, s−4) … min(3, s)``, so the eight slots take 20 selects per group."""
        va, vb = tl.split(tl.reshape(v, (BLOCK_R, G, 2, 2)))   # values 0, 2 and 1, 3
        v0, v2 = tl.split(va)
        v1, v3 = tl.split(vb)
        p0, p1, p2, p3 = code & 15, (code >> 4) & 15, (code >> 8) & 15, code >> 12
        z = tl.zeros_like(v0)
        d0 = tl.where(p0 == 0, v0, z)
        d1 = tl.where(p0 == 1, v0, tl.where(p1 == 1, v1, z))
        d2 = tl.where(p0 == 2, v0, tl.where(p1 == 2, v1, tl.where(p2 == 2, v2, z)))
        d3 = tl.where(p0 == 3, v0, tl.where(p1 == 3, v1, tl.where(p2 == 3, v2, tl.where(p3 == 3, v3, z))))
        d4 = tl.where(p0 == 4, v0, tl.where(p1 == 4, v1, tl.where(p2 == 4, v2, tl.where(p3 == 4, v3, z))))
        d5 = tl.where(p1 == 5, v1, tl.where(p2 == 5, v2, tl.where(p3 == 5, v3, z)))
        d6 = tl.where(p2 == 6, v2, tl.where(p3 == 6, v3, z))
        d7 = tl.where(p3 == 7, v3, z)
        # three levels of joins: index [i, k', k] is slot 4i + 2k' + k
        even = tl.join(tl.join(d0, d4), tl.join(d2, d6))
        odd = tl.join(tl.join(d1, d5), tl.join(d3, d7))
        return tl.reshape(tl.join(even, odd), (BLOCK_R, G * 8))

    @triton.jit
    def _step_inputs(x_ptr, perm_ptr, k0, C, toks, tok_ok, stride_xt, N: tl.constexpr, M: tl.constexpr,
                     G: tl.constexpr, HAS_PERM: tl.constexpr, X_WORDS: tl.constexpr = False):
        """The inputs of the ``G`` groups starting at kept value ``k0``, in permuted column order and
        read once through the index map: ``[BLOCK_T, G·M]`` in ``x``'s dtype. ``X_WORDS`` (16-bit
        ``x`` at a 4-byte aligned address, even row stride): each input is taken from the 32-bit word
        that holds it, so the gather is a 4-byte load — one the software pipeline turns into an
        asynchronous copy issued stages ahead, behind the map's own (a 2-byte gather stays a
        synchronous load inside the loop, and the step's weight copies wait behind it)."""
        cols = (k0 // N) * M + tl.arange(0, G * M)
        col_ok = cols < C
        ok = tok_ok[:, None] & col_ok[None, :]
        src = tl.load(perm_ptr + cols, mask=col_ok, other=0) if HAS_PERM else cols
        if X_WORDS:
            word = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + toks[:, None] * (stride_xt // 2) + (src // 2)[None, :],
                           mask=ok, other=0)
            half = ((word >> ((src & 1) * 16)[None, :]) & 0xFFFF).to(tl.int16)
            return half.to(x_ptr.dtype.element_ty, bitcast=True)
        return tl.load(x_ptr + toks[:, None] * stride_xt + src[None, :], mask=ok, other=0.0)

    @triton.jit
    def _inputs_ahead(x_ahead, x_ptr, perm_ptr, k0, C, toks, tok_ok, stride_xt, N: tl.constexpr, M: tl.constexpr,
                      G: tl.constexpr, BLOCK_K: tl.constexpr, HAS_PERM: tl.constexpr, AHEAD: tl.constexpr,
                      X_WORDS: tl.constexpr = False):
        """The step's inputs (:func:`_step_inputs`) and the carried tile for the next step. ``AHEAD``
        (with a map read by 2-byte loads, not ``X_WORDS``): the inputs were read one step earlier, and
        the next step's are read now — such a gather depends on a load (the map's), which the
        compiler's pipeline leaves synchronous inside the loop, so each step would wait for it.
        Otherwise they are read for this step (in order, the pipeline's asynchronous copies already
        load them ahead) and the carried tile is passed on unused."""
        if AHEAD and HAS_PERM and not X_WORDS:
            xs = x_ahead
            x_ahead = _step_inputs(x_ptr, perm_ptr, k0 + BLOCK_K, C, toks, tok_ok, stride_xt, N, M, G, HAS_PERM)
        else:
            xs = _step_inputs(x_ptr, perm_ptr, k0, C, toks, tok_ok, stride_xt, N, M, G, HAS_PERM, X_WORDS)
        return xs, x_ahead

    @triton.jit
    def _mma_step(acc, dense, xs, WEIGHT_A: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
        """One step on the tensor cores: ``acc[R, T] += dense @ xsᵀ`` with the weight as the MMA's A
        operand (``WEIGHT_A``), else ``acc[T, R] += xs @ denseᵀ``; ``UPCAST``: in float32 (the
        interpreter's bfloat16, see :func:`_upcast`)."""
        if WEIGHT_A:   # one return at the end: Triton compiles the statements after a constexpr branch's return
            if UPCAST:
                acc = tl.dot(dense.to(tl.float32), tl.trans(xs.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(dense.to(xs.dtype), tl.trans(xs), acc, input_precision=PREC)
        elif UPCAST:
            acc = tl.dot(xs.to(tl.float32), tl.trans(dense.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(xs, tl.trans(dense.to(xs.dtype)), acc, input_precision=PREC)
        return acc

    @triton.jit
    def _decode_ids(R, T, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
        """A decode program's split index, its rows and the tokens (with their in-range masks)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        toks = tl.arange(0, BLOCK_T)
        return tl.program_id(1), rows, rows < R, toks, toks < T

    @triton.jit
    def _write_output(acc, y_offs, p_offs, ok, brows, brow_ok, bias_ptr, y_ptr, part_ptr, count_ptr, pid_s, row0,
                      tok0, T, R, stride_yt, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SUM_HERE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
        """Float32 ``acc`` to ``y`` at ``y_offs`` (+ the bias of rows ``brows``), or split ``pid_s``'s partial
        sums (``[SPLIT, T, R]``, ``p_offs`` within one split); ``SUM_HERE``: then :func:`_sum_in_last_split`
        for the output tile from row ``row0`` and token ``tok0``."""
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + brows, mask=brow_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(part_ptr + pid_s * T * R + p_offs, acc, mask=ok)
            if SUM_HERE:
                _sum_in_last_split(bias_ptr, y_ptr, part_ptr, count_ptr, row0, tok0, T, R, stride_yt, HAS_BIAS,
                                   SPLIT, BLOCK_R, BLOCK_T)

    @triton.jit
    def _sum_in_last_split(bias_ptr, y_ptr, part_ptr, count_ptr, row0, tok0, T, R, stride_yt,
                           HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_T: tl.constexpr):
        """Split-K without a second launch: the split programs of an output tile (``program_id(0)``) count
        their arrivals in ``count_ptr``, and the last to arrive adds the ``SPLIT`` partial sums in split
        order (the same sum, bit for bit, as :func:`_sum_partials`, whatever the arrival order), adds the
        bias, writes ``y`` and sets its counter back to 0. Every thread's partial sums are stored before
        the barrier, then one thread's release-acquire atomic publishes them (CUTLASS's split-K semaphore
        pattern; sm_90a: ``MEMBAR.GPU``, the atomic, ``CCTL.IVALL``), and the last program reads them from
        L2 (``.cg``) 16 tokens at a time, in a layout of its own (a GEMM's 256-token tile summed at once
        raised its registers from 117 to 134, one program fewer per SM)."""
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            CHUNK_T: tl.constexpr = BLOCK_T if BLOCK_T < 16 else 16
            rows = row0 + tl.arange(0, BLOCK_R)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)[None, :]
            for t in range(tok0, tok0 + BLOCK_T, CHUNK_T):
                toks = t + tl.arange(0, CHUNK_T)
                ok = (toks < T)[:, None] & (rows < R)[None, :]
                offs = toks[:, None] * R + rows[None, :]
                total = tl.zeros((CHUNK_T, BLOCK_R), dtype=tl.float32)
                for s in range(SPLIT):
                    total += tl.load(part_ptr + s * T * R + offs, mask=ok, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += bias
                tl.store(y_ptr + toks[:, None] * stride_yt + rows[None, :], total.to(y_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(count_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _store_decode(acc, rows, row_ok, toks, tok_ok, bias_ptr, y_ptr, part_ptr, count_ptr, pid_s, T, R, stride_yt,
                      HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SUM_HERE: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_T: tl.constexpr):
        """``acc`` ``[BLOCK_R, BLOCK_T]`` (float32) to ``y`` (+ bias), or to split ``pid_s``'s partial sums
        (:func:`_write_output`)."""
        _write_output(acc, toks[None, :] * stride_yt + rows[:, None], toks[None, :] * R + rows[:, None],
                      row_ok[:, None] & tok_ok[None, :], rows[:, None], row_ok[:, None], bias_ptr, y_ptr, part_ptr,
                      count_ptr, pid_s, tl.program_id(0) * BLOCK_R, 0, T, R, stride_yt, HAS_BIAS, SPLIT, SUM_HERE,
                      BLOCK_R, BLOCK_T)

    @triton.jit
    def _nm_decode_dot_kernel(x_ptr, val_ptr, word_ptr, perm_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
                              T, R, K, C, WORDS, stride_xt, stride_yt, K_PER_SPLIT,
                              N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr,
                              HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                              PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_R: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr,
                              WEIGHT_A: tl.constexpr = False, TILED: tl.constexpr = False,
                              X_WORDS: tl.constexpr = False, SUM_HERE: tl.constexpr = False,
                              NATIVE: tl.constexpr = True):
        """Several tokens: the tile expanded to dense in registers and multiplied on the tensor cores,
        ``acc[T, R] += x_p[T, cols] @ W_p[R, cols]ᵀ`` (tokens in the rows of the MMA: the inputs are
        read row-major, as they lie in memory), or with ``WEIGHT_A`` ``acc[R, T] += W_p @ x_pᵀ`` (the
        weight's rows in the MMA's M, see :data:`DOT_TILES_SWAP`). A map's gather is read as words
        the pipeline copies (``X_WORDS``, :func:`_step_inputs`) or, up to 16 tokens, a step ahead."""
        pid_s, rows, row_ok, toks, tok_ok = _decode_ids(R, T, BLOCK_R, BLOCK_T)
        k_start = pid_s * K_PER_SPLIT
        acc = _dot_loop(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start,
                        tl.minimum(k_start + K_PER_SPLIT, K), K, C, WORDS, stride_xt, N, M, BITS, HAS_PERM, PREC,
                        UPCAST, BLOCK_R, BLOCK_K, BLOCK_T, STAGES, WEIGHT_A, TILED, X_WORDS, NATIVE)
        _store_decode(acc, rows, row_ok, toks, tok_ok, bias_ptr, y_ptr, part_ptr, count_ptr, pid_s, T, R, stride_yt,
                      HAS_BIAS, SPLIT, SUM_HERE, BLOCK_R, BLOCK_T)

    @triton.jit
    def _dot_loop(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start, k_end, K, C, WORDS,
                  stride_xt, N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
                  PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  BLOCK_T: tl.constexpr, STAGES: tl.constexpr, WEIGHT_A: tl.constexpr, TILED: tl.constexpr,
                  X_WORDS: tl.constexpr, NATIVE: tl.constexpr):
        """The tensor-core decode's loop over kept values ``k_start … k_end`` of rows ``rows`` for the input
        rows ``toks`` of ``x`` (any rows: the MoE kernel passes the tokens routed to one expert): float32
        ``[BLOCK_R, BLOCK_T]``."""
        G: tl.constexpr = BLOCK_K // N
        if WEIGHT_A:
            acc = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        x_ahead = _step_inputs(x_ptr, perm_ptr, k_start, C, toks, tok_ok, stride_xt, N, M, G, HAS_PERM, X_WORDS)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            # the byte-permute expansion but for 32 tokens in the MMA's rows (sm_90a: 1361 loop instructions
            # and 182 registers against the selects' 1267 and 150)
            dense = _dense_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS, N, M, BITS, BLOCK_R, BLOCK_K,
                                "evict_first", TILED, NATIVE, WEIGHT_A or BLOCK_T != 32)
            # a step ahead up to 16 tokens (at 32 the carried tile spills the 2:4 tile)
            xs, x_ahead = _inputs_ahead(x_ahead, x_ptr, perm_ptr, k0, C, toks, tok_ok, stride_xt, N, M, G, BLOCK_K,
                                        HAS_PERM, BLOCK_T <= 16, X_WORDS)
            acc = _mma_step(acc, dense, xs, WEIGHT_A, UPCAST, PREC)
        if not WEIGHT_A:
            acc = tl.trans(acc)
        return acc

    @triton.jit
    def _nm_select_kernel(x_ptr, val_ptr, word_ptr, perm_ptr, bias_ptr, y_ptr, part_ptr, count_ptr,
                          T, R, K, C, WORDS, stride_xt, stride_yt, K_PER_SPLIT,
                          N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr,
                          HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr,
                          TILED: tl.constexpr = False, X_WORDS: tl.constexpr = False,
                          SUM_HERE: tl.constexpr = False):
        """Few tokens, no tensor cores: each kept value picks its input among its group's ``M`` (the
        compares are shared by all tokens), multiplies it, and adds into a float32 accumulator of
        its own; the one cross-lane reduction comes after the loop. No dense tile is built. With a
        map, its gather is read as 32-bit words and pipelined (``X_WORDS``, see :func:`_step_inputs`),
        else one step ahead in registers (:func:`_inputs_ahead`)."""
        pid_s, rows, row_ok, toks, tok_ok = _decode_ids(R, T, BLOCK_R, BLOCK_T)
        k_start = pid_s * K_PER_SPLIT
        out = _select_loop(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start,
                           tl.minimum(k_start + K_PER_SPLIT, K), K, C, WORDS, stride_xt, N, M, BITS, HAS_PERM,
                           BLOCK_R, BLOCK_K, BLOCK_T, STAGES, TILED, X_WORDS)
        _store_decode(out, rows, row_ok, toks, tok_ok, bias_ptr, y_ptr, part_ptr, count_ptr, pid_s, T, R, stride_yt,
                      HAS_BIAS, SPLIT, SUM_HERE, BLOCK_R, BLOCK_T)

    @triton.jit
    def _select_loop(x_ptr, val_ptr, word_ptr, perm_ptr, rows, row_ok, toks, tok_ok, k_start, k_end, K, C, WORDS,
                     stride_xt, N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr,
                     TILED: tl.constexpr, X_WORDS: tl.constexpr):
        """The select decode's loop over kept values ``k_start … k_end`` of rows ``rows`` for the input rows
        ``toks`` of ``x`` (any rows, as :func:`_dot_loop`): float32 ``[BLOCK_R, BLOCK_T]``."""
        G: tl.constexpr = BLOCK_K // N
        acc = tl.zeros((BLOCK_R, G, N, BLOCK_T), dtype=tl.float32)
        # with a map the inputs are read one step ahead (_inputs_ahead) unless the pipeline copies them (X_WORDS)
        x_ahead = _step_inputs(x_ptr, perm_ptr, k_start, C, toks, tok_ok, stride_xt, N, M, G, HAS_PERM, X_WORDS)
        for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=STAGES):
            v, words = _kept_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS, N, BITS, BLOCK_R, BLOCK_K,
                                  "evict_first", TILED)
            if TILED:
                pos = _cslt_positions(words, rows, N, BLOCK_R, BLOCK_K)[:, :, :, None]
            else:
                pos = _positions(words, N, BITS, BLOCK_R, BLOCK_K)[:, :, :, None]
            if M == 4:  # 2:4 and 1:4: the group's inputs read once, then a tree of 3 selects on the position's bits
                x_step, x_ahead = _inputs_ahead(x_ahead, x_ptr, perm_ptr, k0, C, toks, tok_ok, stride_xt, N, M, G,
                                                BLOCK_K, HAS_PERM, True, X_WORDS)
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
                    src = tl.load(perm_ptr + first + j, mask=col_ok, other=0) if HAS_PERM else first + j
                    xj = tl.load(x_ptr + toks[None, :] * stride_xt + src[:, None],
                                 mask=col_ok[:, None] & tok_ok[None, :], other=0.0).to(tl.float32)  # slot j of each group
                    picked = tl.where(pos == j, xj[None, :, None, :], picked)
            acc += v.to(tl.float32)[:, :, :, None] * picked
        return tl.sum(tl.reshape(acc, (BLOCK_R, BLOCK_K, BLOCK_T)), axis=1)

    @triton.jit
    def _nm_gemm_kernel(x_ptr, val_ptr, word_ptr, bias_ptr, y_ptr, part_ptr, count_ptr, T, R, C, K, WORDS, stride_xt, stride_yt,
                        C_PER_SPLIT, N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                        SPLIT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, GROUP_T: tl.constexpr,
                        WEIGHT_A: tl.constexpr = False, TILED: tl.constexpr = False, SUM_HERE: tl.constexpr = False,
                        NATIVE: tl.constexpr = True):
        BLOCK_K: tl.constexpr = BLOCK_C * N // M
        pid, pid_s = tl.program_id(0), tl.program_id(1)
        n_t, n_r = tl.cdiv(T, BLOCK_T), tl.cdiv(R, BLOCK_R)
        per_group = GROUP_T * n_r                      # grouped order: neighbouring programs share weight tiles in L2
        first_t = (pid // per_group) * GROUP_T
        size_t = tl.minimum(n_t - first_t, GROUP_T)
        pid_t = first_t + (pid % per_group) % size_t
        pid_r = (pid % per_group) // size_t
        toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        tok_ok, row_ok = toks < T, rows < R
        if WEIGHT_A:
            acc = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.float32)
        else:
            acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
        c_start = pid_s * C_PER_SPLIT
        for c0 in range(c_start, tl.minimum(c_start + C_PER_SPLIT, C), BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            xs = tl.load(x_ptr + toks[:, None] * stride_xt + cols[None, :], mask=tok_ok[:, None] & (cols < C)[None, :],
                         other=0.0)
            dense = _dense_tile(val_ptr, word_ptr, rows, row_ok, c0 * N // M, K, WORDS, N, M, BITS, BLOCK_R, BLOCK_K,
                                "", TILED, NATIVE)
            acc = _mma_step(acc, dense, xs, WEIGHT_A, UPCAST, PREC)
        if WEIGHT_A:
            acc = tl.trans(acc)
        _write_output(acc, toks[:, None] * stride_yt + rows[None, :], toks[:, None] * R + rows[None, :],
                      tok_ok[:, None] & row_ok[None, :], rows[None, :], row_ok[None, :], bias_ptr, y_ptr, part_ptr,
                      count_ptr, pid_s, pid_r * BLOCK_R, pid_t * BLOCK_T, T, R, stride_yt, HAS_BIAS, SPLIT, SUM_HERE,
                      BLOCK_R, BLOCK_T)

    @triton.jit
    def _nm_decompress_kernel(val_ptr, word_ptr, out_ptr, R, C, K, WORDS,
                              N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr,
                              BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TILED: tl.constexpr = False,
                              NATIVE: tl.constexpr = True):
        G: tl.constexpr = BLOCK_K // N
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        k0 = tl.program_id(1) * BLOCK_K
        dense = _dense_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS, N, M, BITS, BLOCK_R, BLOCK_K,
                            "evict_first", TILED, NATIVE)
        cols = (k0 // N) * M + tl.arange(0, G * M)
        tl.store(out_ptr + rows[:, None] * C + cols[None, :], dense, mask=row_ok[:, None] & (cols < C)[None, :])


    @triton.jit
    def _sum_partials_kernel(part_ptr, bias_ptr, y_ptr, numel, R, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs % R, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _check(n: int, m: int, bits: int) -> None:
    if triton is None:
        raise RuntimeError("triton is not installed")
    if n & (n - 1) or m & (m - 1) or 32 % bits:
        raise ValueError(f"the word-layout kernels need N and M powers of two (got {n}:{m})")


def _check_tiled(tiled: bool, block_r: int) -> None:
    """cuSPARSELt-ordered positions (``tiled``) are read by 16-row slices: the program's rows must be whole slices."""
    if tiled and block_r % 16:
        raise ValueError(f"cuSPARSELt-ordered positions are read 16 rows at a time: block_r {block_r}")


def _precision(x: torch.Tensor) -> str:
    """float32 inputs multiply in full precision (not TF32); 16-bit ones on the tensor cores."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _upcast(x: torch.Tensor) -> bool:
    """Under the interpreter bfloat16 ``tl.dot`` is wrong (numpy has no bfloat16 matmul): there the
    products of bfloat16 tiles are taken in float32. Never on a GPU."""
    return x.dtype == torch.bfloat16 and x.device.type != "cuda"


def _native(x: torch.Tensor) -> bool:
    """Whether the kernels run compiled for an NVIDIA GPU and may use inline PTX such as ``prmt``; not
    interpreted on the CPU nor on ROCm (where :func:`_prmt` emulates it with shifts)."""
    return x.device.type == "cuda" and torch.version.hip is None


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: any small number exercises the split path


SMEM_PER_SM = 228 * 1024  # H100 / H200: shared memory per SM where the device does not say


def _smem_per_sm(device: torch.device) -> int:
    """Shared memory per SM (what bounds the tensor-core decode's residency): the device's own
    figure on CUDA (A100 164 KB, H100 228 KB), :data:`SMEM_PER_SM` elsewhere."""
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_multiprocessor", SMEM_PER_SM)
    return SMEM_PER_SM


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
DOT_TILE_FP32 = (16, 128, 8, 1)
DECODE_MAX_TOKENS, DECODE_MAX_TOKENS_FP32 = 64, 16
# up to this many tokens the select kernel is the default: on an H100 at 2 tokens it took 12.5–29.7 µs on
# 4096×4096, 4096×11008 and 11008×4096 (tune_select_tokens.json, 1.20–1.35× cuBLAS) where the tensor-core
# decode took 18.2–39.3 (bench_kernel.json); at 4 tokens it is below cuBLAS (19.9 µs against 17.0 on 4096×4096)
SELECT_MAX_TOKENS = 2
SELECT_LIMIT_TOKENS = 16  # the most tokens the select kernel takes (its per-token accumulators grow with them)


def decode_max_tokens(element_bytes: int) -> int:
    """The most tokens :func:`nm_decode` takes for inputs of this element size."""
    return DECODE_MAX_TOKENS_FP32 if element_bytes >= 4 else DECODE_MAX_TOKENS


def decode_plan(rows: int, kept: int, tokens: int, n: int, m: int, bits: int, device: torch.device,
                block_r: int | None = None, block_k: int | None = None, split: int | None = None,
                stages: int = 4, num_warps: int | None = None, use_dot: bool | None = None,
                element_bytes: int = 2, weight_a: bool = False) -> dict:
    """Kernel, tile, warps, split-K and pipeline depth for :func:`nm_decode`.

    Up to :data:`SELECT_MAX_TOKENS` tokens take the select kernel (but 4:8), more the tensor-core one
    (``use_dot`` forces either; select takes at most 16). ``weight_a``: the tensor-core kernel
    multiplies with the weight tile as the MMA's A operand (:data:`DOT_TILES_SWAP`), not the inputs. The
    tiles are the ones whose compiled loop leaves the most room under an H100's issue rate without
    spilling (``scripts/check_kernels_compile.py``): the select kernel's 16 rows × 128 kept values on 4
    warps lets one token stream at up to 4.9 TB/s of instruction issue (3.8 through an index map); the
    tensor-core kernel's 64 rows × 256 dense columns on 4 warps up to 4.2 TB/s at 3–16 tokens on 2:4
    (6.2–6.4 with ``weight_a``) and 3.4 at 32 (4:8: 64 × 128, 3.4 and 2.8 TB/s), 64 × 128 on 8 warps 3.0
    at 64 tokens (2:4 with the byte-permute expansion, :func:`_dense_2of4_pairs`). Other N:M and
    float32 take smaller tiles: larger ones spill. Split-K makes enough programs to fill every SM: one
    per SM for select (an H100's timing: fewer, longer programs beat split-K there), and for the
    tensor-core kernel as many as its pipeline buffers let reside in the SM's shared memory (2 for the
    2:4 tiles). ``stages`` tiles are in the software pipeline. Timed on an H100 (``scripts/gpu_run.sh
    tune_decode`` → ``scripts/results/tune_decode_*.json``): at one token these tiles unsplit were
    within 5 % of the best of 32; the tensor-core tiles are within 3 % of the best swept, but at about
    dense speed."""
    fields = 32 // bits
    limit = decode_max_tokens(element_bytes)
    if tokens > limit:
        raise ValueError(f"nm_decode takes at most {limit} tokens of {element_bytes}-byte elements (got {tokens}); "
                         "use nm_gemm")
    if use_dot is None:  # 4:8's select chains 8 slots (2.2 TB/s at one token), its expansion does not (3.6)
        use_dot = tokens > SELECT_MAX_TOKENS or (n, m) == (4, 8)
    if not use_dot and tokens > SELECT_LIMIT_TOKENS:
        raise ValueError(f"the select decode takes at most {SELECT_LIMIT_TOKENS} tokens (got {tokens})")
    block_t = max(16, triton.next_power_of_2(tokens)) if use_dot else triton.next_power_of_2(tokens)  # tl.dot: ≥ 16
    if use_dot:
        table = DOT_TILES_SWAP if weight_a else DOT_TILES
        tile = DOT_TILE_FP32 if element_bytes >= 4 else table.get((n, m), DOT_TILES_OTHER)[block_t]
        block_r = block_r or tile[0]
        block_k = block_k or max(fields, n, tile[1] * n // m)
        num_warps = num_warps or tile[2]
        if block_r < 16 or block_k // n * m < 16:
            raise ValueError(f"the tensor-core decode needs block_r ≥ 16 and block_k·M/N ≥ 16 (got {block_r}, {block_k})")
    else:
        block_r = block_r or 16
        block_k = block_k or max(fields, n, 128)
        num_warps = num_warps or (8 if tokens > 2 else 4)
    row_programs = triton.cdiv(rows, block_r)
    steps = triton.cdiv(kept, block_k)
    per_sm = 1   # select: split only when the rows leave SMs idle (an H100 timed split-K's partial sums
                 # and their reduction as slower than one program per SM streaming more rows)
    if use_dot:  # as many as the registers (the tile's compile) and the pipeline's buffers let reside
        buffers = max(1, stages - 1) * (block_r * block_k * element_bytes + block_r * block_k * bits // 8
                                        + block_t * block_k * m // n * element_bytes)   # stages − 1 loads ahead
        by_registers = tile[3] if (block_r, num_warps) == (tile[0], tile[2]) else 4   # a tile being tuned: up to 4
        per_sm = max(1, min(by_registers, _smem_per_sm(device) // buffers))
    if split is None:
        slots = per_sm * _sm_count(device)
        split = max(1, min(steps, triton.cdiv(slots, row_programs)))
        if use_dot:  # the split with the fewest waves per unit of work (ties: fewer partial sums)
            split = min(range(1, min(steps, 2 * split) + 1),
                        key=lambda s: (triton.cdiv(row_programs * s, slots) / s, s))
    per_split = triton.cdiv(steps, split) * block_k
    split = triton.cdiv(kept, per_split)
    return dict(block_r=block_r, block_k=block_k, block_t=block_t, split=split, per_split=per_split, stages=stages,
                num_warps=num_warps, use_dot=use_dot, per_sm=per_sm, weight_a=weight_a and use_dot)


def _partials(split: int, y: torch.Tensor) -> torch.Tensor:
    """Split-K's float32 partial sums ``[split, T, R]`` of output ``y`` (``y`` itself when unsplit)."""
    return torch.empty(split, *y.shape, dtype=torch.float32, device=y.device) if split > 1 else y


SPLIT_COUNTERS = 1 << 16   # arrival counters per device (256 KB of int32), handed out as a ring
_COUNTERS: dict[str, list] = {}   # device → [the zeroed counters, where the next launch's start]


def split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """Zeroed int32 arrival counters, one per output tile, for a split-K launch that sums its partial
    sums in-kernel (:func:`_sum_in_last_split`; each launch leaves its counters at 0 again). One
    buffer per device, made outside any CUDA graph capture and kept for the process (a captured
    graph holds its address), handed out as a ring: launches in flight together on different
    streams take different counters unless :data:`SPLIT_COUNTERS` tiles' worth of launches came
    between them. ``None`` — the separate sum kernel then — for more tiles than that, or during a
    capture before any launch outside one made the buffer (one made inside a capture would be
    zeroed only when the graph first runs)."""
    if tiles > SPLIT_COUNTERS:
        return None
    entry = _COUNTERS.get(str(device))
    if entry is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        entry = _COUNTERS[str(device)] = [torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device), 0]
    counters, start = entry
    if start + tiles > SPLIT_COUNTERS:
        start = 0
    entry[1] = start + tiles
    return counters[start:start + tiles]


def _summing(split: int, tiles: int, device: torch.device, sum_in_kernel: bool | None) -> torch.Tensor | None:
    """The counters for an in-kernel split-K sum (``sum_in_kernel`` ``None``: wherever
    :func:`split_counters` has them; ``False``: never), else ``None``."""
    if split == 1 or sum_in_kernel is False:
        return None
    return split_counters(device, tiles)


def _sum_partials(part: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """The splits' partial sums added, plus the bias, written into ``y`` in its dtype: one launch
    (PyTorch's sum, add and cast took three, each a few microseconds on a graph's critical path)."""
    numel, block = y.numel(), 1024
    _sum_partials_kernel[(triton.cdiv(numel, block),)](part, bias if bias is not None else part, y, numel,
                                                       y.shape[-1], SPLIT=part.shape[0], HAS_BIAS=bias is not None,
                                                       BLOCK=block, num_warps=4)
    return y


def word_gather(x2: torch.Tensor) -> bool:
    """Whether the decode kernels can read ``x2`` ``[T, C]`` through an index map as 32-bit words
    (``X_WORDS``): 16-bit elements, a 4-byte aligned start and an even row stride."""
    return x2.element_size() == 2 and x2.data_ptr() % 4 == 0 and x2.stride(0) % 2 == 0


def nm_decode(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int,
              perm: torch.Tensor | None = None, bias: torch.Tensor | None = None, tiled: bool = False,
              async_gather: bool | None = None, sum_in_kernel: bool | None = None, **plan_overrides) -> torch.Tensor:
    """``x`` ``[..., C]`` with at most :func:`decode_max_tokens` tokens (64; float32: 16) →
    ``x[..., perm] @ W_pᵀ + bias`` ``[..., R]``. ``tiled``: ``words`` ``[R, C/32]`` hold 2:4
    positions in cuSPARSELt's order (:func:`shuffleprune.deploy.cslt_layout.cslt_words`), not row
    by row; the same holds for :func:`nm_gemm` and :func:`nm_decompress_into`. ``async_gather``:
    the select kernel and the weight-as-A tensor-core kernel read the map's gather as 32-bit words
    the pipeline copies ahead (default: wherever :func:`word_gather` allows; the other tensor-core
    kernel would spill with them), ``False`` one step ahead in registers (to 16 tokens).
    ``sum_in_kernel``: split-K's last program of each row tile adds the partial sums (default, see
    :func:`split_counters`); ``False``: a second launch does (:func:`_sum_partials`)."""
    _check(n, m, bits)
    lead, cols = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, cols).contiguous()
    tokens = x2.shape[0]
    rows, kept = values.shape
    p = decode_plan(rows, kept, tokens, n, m, bits, x.device, element_bytes=x.element_size(), **plan_overrides)
    _check_tiled(tiled, p["block_r"])
    can_words = perm is not None and word_gather(x2) and (not p["use_dot"] or p["weight_a"])
    if async_gather and perm is not None and not can_words:
        raise ValueError("async_gather needs the select kernel or weight_a, and 16-bit inputs at a 4-byte aligned "
                         "address with an even row stride")
    x_words = can_words and async_gather is not False
    y = torch.empty(tokens, rows, dtype=x.dtype, device=x.device)
    part = _partials(p["split"], y)
    dummy = values
    grid = (triton.cdiv(rows, p["block_r"]), p["split"])
    counts = _summing(p["split"], grid[0], x.device, sum_in_kernel)
    args = (x2, values, words, perm if perm is not None else dummy, bias if bias is not None else dummy, y, part,
            counts if counts is not None else dummy, tokens, rows, kept, cols, words.shape[1], x2.stride(0), y.stride(0), p["per_split"])
    common = dict(N=n, M=m, BITS=bits, HAS_PERM=perm is not None, HAS_BIAS=bias is not None, SPLIT=p["split"],
                  BLOCK_R=p["block_r"], BLOCK_K=p["block_k"], BLOCK_T=p["block_t"], STAGES=p["stages"],
                  TILED=tiled, X_WORDS=x_words, SUM_HERE=counts is not None, num_warps=p["num_warps"])
    if p["use_dot"]:
        _nm_decode_dot_kernel[grid](*args, PREC=_precision(x), UPCAST=_upcast(x), WEIGHT_A=p["weight_a"],
                                    NATIVE=_native(x), **common)
    else:
        _nm_select_kernel[grid](*args, **common)
    if p["split"] > 1 and counts is None:
        y = _sum_partials(part, bias, y)
    return y.reshape(*lead, rows)


# prefill tiles (block_t, block_r, block_c, warps, stages), each with its loop's instructions per warp
# per step and the programs an SM holds, from its bfloat16 compile for sm_90a at 2048 tokens
# (scripts/check_kernels_compile.py; tests/test_kernels.py checks they still hold), per N:M (other
# N:M are costed as 2:4). The weight tile is expanded in registers and stored for the tensor cores,
# then the tensor-core call is waited on within the step: one program's expansion overlaps only
# with another program's tensor-core work.
GEMM_TILES = {
    (2, 4): (((256, 64, 32, 8, 3), 130, 2), ((128, 64, 32, 4, 4), 165, 4),
             ((64, 64, 32, 4, 4), 149, 7), ((32, 64, 64, 4, 3), 299, 4)),
    (4, 8): (((256, 64, 32, 8, 3), 165, 2), ((128, 64, 32, 4, 4), 288, 4),
             ((64, 64, 32, 4, 4), 271, 6), ((32, 64, 64, 4, 3), 532, 4)),
}
# the GEMM with the weight as the MMA's A operand (``weight_a``): rows in M (64 per warpgroup), tokens in
# N (up to 256 per wgmma), the expanded tile fed from registers to an asynchronous wgmma that stays in
# flight while the next tile expands (the tiles above wait for theirs within the step: the weight is
# their B operand, stored to shared memory first). Compiled for sm_90a like GEMM_TILES; not yet timed.
GEMM_TILES_SWAP = {
    (2, 4): (((256, 64, 64, 4, 3), 335, 2), ((256, 64, 32, 8, 3), 145, 2),
             ((128, 64, 32, 4, 4), 178, 4), ((64, 64, 64, 4, 4), 245, 4)),
    (4, 8): (((256, 64, 64, 4, 3), 657, 2), ((256, 64, 32, 8, 3), 194, 2),
             ((128, 64, 32, 4, 4), 301, 4), ((64, 64, 64, 4, 4), 575, 4)),
}
GEMM_TILE_FP32 = (32, 64, 32, 4, 3)  # float32: full-precision FMA, no tensor cores; larger tiles spill
TENSOR_FLOP_PER_CYCLE = 4096          # dense 16-bit tensor-core FLOP per SM per clock (H100: 989 TFLOP/s)
L2_BYTES_PER_CYCLE = 24               # per SM: about 5.5 TB/s of H100 L2, where split-K's partial sums stay


def gemm_cycles(tokens: int, rows: int, cols: int, tile: tuple[int, int, int, int, int], loop: int, per_sm: int,
                sms: int, split: int = 1, overlap: bool = False) -> float:
    """Clocks the busiest SM spends on :func:`nm_gemm` with ``tile`` and ``split`` column splits:
    every step a program issues ``loop`` instructions per warp (4 issued per clock) and then waits
    for its tensor-core work; the programs resident together overlap one's issue with another's
    tensor work. ``overlap``: each program's tensor-core call stays in flight while it expands its next
    tile (the weight-as-A tiles), so a program's step takes the longer of the two, not their sum.
    Split-K adds its float32 partial sums, written and read back through L2."""
    block_t, block_r, block_c, warps, _ = tile
    issue = loop * warps / 4
    tensor = 2 * block_t * block_r * block_c / TENSOR_FLOP_PER_CYCLE
    programs = triton.cdiv(tokens, block_t) * triton.cdiv(rows, block_r) * split
    on_sm = triton.cdiv(programs, sms)
    batches = [per_sm] * (on_sm // per_sm) + ([on_sm % per_sm] if on_sm % per_sm else [])
    if overlap:
        step = sum(b * max(issue, tensor) for b in batches)
    else:
        step = sum(max(issue + tensor, b * issue, b * tensor) for b in batches)
    reduce = 0 if split == 1 else (2 * split * 4 + 2) * tokens * rows / (sms * L2_BYTES_PER_CYCLE)
    return triton.cdiv(triton.cdiv(cols, block_c), split) * step + reduce


def gemm_plan(tokens: int, rows: int, cols: int, n: int, m: int, bits: int, device: torch.device,
              element_bytes: int = 2, weight_a: bool = False) -> tuple[tuple[int, int, int, int, int], int]:
    """``((block_t, block_r, block_c, num_warps, num_stages), split)`` of :func:`nm_gemm`: of the
    :data:`GEMM_TILES` (``weight_a``: :data:`GEMM_TILES_SWAP`, costed with the tensor-core call
    overlapping the next expansion) of N:M whose steps hold whole position words, and of 1, 2, 4
    or 8 column splits, the pair :func:`gemm_cycles` finds fastest on this device's SMs. Large
    token tiles expand each weight tile once for more tokens; smaller tiles and split-K give every
    SM programs when tokens or rows are few."""
    min_c = 32 // bits * m // n          # dense columns per step that hold one whole position word
    if element_bytes >= 4:
        block_t, block_r, block_c, warps, stages = GEMM_TILE_FP32
        return (block_t, block_r, max(block_c, min_c), warps, stages), 1
    table = GEMM_TILES_SWAP if weight_a else GEMM_TILES
    tiles = [t for t in table.get((n, m), table[(2, 4)]) if t[0][2] % min_c == 0]
    if not tiles:                        # sparse position words (1:16): the smallest tile, wider
        return (32, 64, min_c, 4, 3), 1
    sms = _sm_count(device)
    options = [(t, s) for t in tiles for s in (1, 2, 4, 8) if s == 1 or triton.cdiv(cols, t[0][2]) >= 4 * s]
    (tile, _, _), split = min(options, key=lambda o: (gemm_cycles(tokens, rows, cols, *o[0], sms, o[1], weight_a), o[1]))
    return tile, split


def nm_gemm(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int,
            bias: torch.Tensor | None = None, tile: tuple[int, int, int, int, int] | None = None,
            split: int | None = None, weight_a: bool = False, tiled: bool = False,
            sum_in_kernel: bool | None = None) -> torch.Tensor:
    """``x`` ``[..., C]`` already in the weight's (permuted) column order → ``x @ W_pᵀ + bias``
    (``tile`` and ``split`` default to :func:`gemm_plan`'s; a given ``tile`` alone runs unsplit).
    ``weight_a``: the weight tile is the MMA's A operand (``acc[rows, tokens]``), see
    :data:`GEMM_TILES_SWAP`. ``sum_in_kernel``: as in :func:`nm_decode`."""
    _check(n, m, bits)
    lead, cols = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, cols).contiguous()
    tokens = x2.shape[0]
    rows, kept = values.shape
    if tile is None:
        tile, planned = gemm_plan(tokens, rows, cols, n, m, bits, x.device, x.element_size(), weight_a)
        split = split or planned
    block_t, block_r, block_c, warps, stages = tile
    if (block_c * n // m) % (32 // bits):
        raise ValueError(f"block_c {block_c} must hold whole position words for {n}:{m}")
    _check_tiled(tiled, block_r)
    per_split = triton.cdiv(triton.cdiv(cols, block_c), split or 1) * block_c
    split = triton.cdiv(cols, per_split)
    y = torch.empty(tokens, rows, dtype=x.dtype, device=x.device)
    part = _partials(split, y)
    grid = (triton.cdiv(tokens, block_t) * triton.cdiv(rows, block_r), split)
    counts = _summing(split, grid[0], x.device, sum_in_kernel)
    _nm_gemm_kernel[grid](x2, values, words, bias if bias is not None else values, y, part,
                          counts if counts is not None else values, tokens, rows, cols, kept,
                          words.shape[1], x2.stride(0), y.stride(0), per_split, N=n, M=m, BITS=bits,
                          HAS_BIAS=bias is not None, SPLIT=split, PREC=_precision(x), UPCAST=_upcast(x),
                          BLOCK_T=block_t, BLOCK_R=block_r, BLOCK_C=block_c, GROUP_T=8, WEIGHT_A=weight_a,
                          TILED=tiled, SUM_HERE=counts is not None, NATIVE=_native(x), num_warps=warps,
                          num_stages=stages)
    if split > 1 and counts is None:
        y = _sum_partials(part, bias, y)
    return y.reshape(*lead, rows)


def nm_decompress_into(values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int, cols: int,
                       out: torch.Tensor, block_r: int = 16, block_k: int = 64, num_warps: int = 4,
                       tiled: bool = False) -> torch.Tensor:
    """Write the dense ``[R, cols]`` ``W_p`` into ``out`` (a buffer of at least ``R·cols`` elements of
    the values' dtype); returns the ``[R, cols]`` view. ``block_k`` kept values per program row."""
    _check(n, m, bits)
    rows, kept = values.shape
    dense = out.reshape(-1)[: rows * cols].view(rows, cols)
    block_k = max(32 // bits, block_k)
    _check_tiled(tiled, block_r)
    grid = (triton.cdiv(rows, block_r), triton.cdiv(kept, block_k))
    _nm_decompress_kernel[grid](values, words, dense, rows, cols, kept, words.shape[1], N=n, M=m, BITS=bits,
                                BLOCK_R=block_r, BLOCK_K=block_k, TILED=tiled, NATIVE=_native(values),
                                num_warps=num_warps)
    return dense
