"""The word layout of a compressed N:M weight, read and expanded inside Triton kernels.

``values`` ``[R, K]`` (``K = C·N/M`` kept values per row, model dtype) and ``words`` int32 ``[R, W]``:
the in-group positions as ``BITS``-bit fields, ``32 / BITS`` per 32-bit word (value ``k`` of a row in
bits ``BITS·(k mod F)…`` of word ``k // F``, ``F = 32 / BITS``) — the same bits as the export's byte
layout, read four bytes at a time (:func:`position_words`). With ``TILED`` the 2:4 positions are in
cuSPARSELt's order instead (:mod:`shuffleprune.deploy.cslt_layout`).

- :func:`kept_tile`: a tile of kept values and their position words (16-byte loads, an eviction policy);
- :func:`positions` / :func:`cslt_positions`: each kept value's slot in its group of ``M``;
- :func:`dense_tile`: the tile expanded to dense ``[BLOCK_R, BLOCK_K·M/N]`` in registers. 2:4 and 4:8
  split each group's values apart and give every dense slot a select per value it can hold
  (:func:`_dense_2of4`, :func:`_dense_4of8`; 2:4 by byte permutes on NVIDIA GPUs,
  :func:`_dense_2of4_pairs`); other N:M sum ``M`` masked copies. Which costs fewer instructions per
  byte was read off the compiled sm_90a loops (``kernels/compile_check.py``);
- :func:`mma_step`: one tensor-core step with the expanded tile as the MMA's A or B operand.

Used by the decode (:mod:`.nm_decode`), prefill GEMM and decompression (:mod:`.nm_gemm`) and MoE
experts (:mod:`.nm_experts`) kernels.
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


def check_pattern(n: int, m: int, bits: int) -> None:
    """Refuse what the word-layout kernels cannot run: no Triton, or N and M not powers of two."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    if n & (n - 1) or m & (m - 1) or 32 % bits:
        raise ValueError(f"the word-layout kernels need N and M powers of two (got {n}:{m})")


def check_tiled(tiled: bool, block_r: int) -> None:
    """cuSPARSELt-ordered positions (``tiled``) are read by 16-row slices: the program's rows must be whole slices."""
    if tiled and block_r % 16:
        raise ValueError(f"cuSPARSELt-ordered positions are read 16 rows at a time: block_r {block_r}")


if triton is not None:
    from shuffleprune.kernels.overlap import LINE_WORDS, prefetch_l2, prefetch_rows

    _LINE_WORDS = tl.constexpr(LINE_WORDS)   # a global a kernel reads must be a constexpr

    @triton.jit
    def kept_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS,
                  N: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                  EVICT: tl.constexpr, TILED: tl.constexpr, PAIRS: tl.constexpr = False):
        """Rows ``rows`` × kept values ``k0 … k0+BLOCK_K``: values ``[BLOCK_R, BLOCK_K/N, N]`` (``PAIRS``:
        each 2:4 group's two 16-bit values as one int32 word, ``[BLOCK_R, BLOCK_K/2]``) and their
        position words ``[BLOCK_R, BLOCK_K·BITS/32]`` (read them with :func:`positions` or
        :func:`group_codes`). ``EVICT``: the loads' eviction policy (``"evict_first"`` where the
        weight is read once, ``""`` where tiles are reused). ``TILED``: ``word_ptr`` holds 2:4
        positions in cuSPARSELt's order (:mod:`shuffleprune.deploy.cslt_layout`): with 2, read by
        16-row slices and turned into the same words (``BLOCK_R % 16 == 0``); with 1, the raw 64-bit
        pair of each row and word, for :func:`cslt_positions` (the select loop)."""
        if not PAIRS:   # the pairs are read after the words: read before them, the GEMM's loop took 5 % more
            ks = k0 + tl.arange(0, BLOCK_K)
            v = tl.load(val_ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0,
                        eviction_policy=EVICT)
            v = tl.reshape(v, (BLOCK_R, BLOCK_K // N, N))
        words = _step_words(word_ptr, rows, row_ok, k0, WORDS, BITS, BLOCK_R, BLOCK_K, EVICT, TILED)
        if PAIRS:
            gs = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            v = tl.load(val_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 2) + gs[None, :],
                        mask=row_ok[:, None] & (gs < K // 2)[None, :], other=0, eviction_policy=EVICT)
        return v, words

    @triton.jit
    def _step_words(word_ptr, rows, row_ok, k0, WORDS, BITS: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_K: tl.constexpr, EVICT: tl.constexpr, TILED: tl.constexpr):
        """The position words of rows ``rows`` × kept values ``k0 … k0+BLOCK_K`` as :func:`kept_tile` returns
        them (``TILED`` as there)."""
        F: tl.constexpr = 32 // BITS
        WPB: tl.constexpr = BLOCK_K // F
        wi = k0 // F + tl.arange(0, WPB)
        w_ok = row_ok[:, None] & (wi < WORDS)[None, :]
        if TILED == 1:
            words = tl.load(word_ptr.to(tl.pointer_type(tl.int64)) + _cslt_pair(rows, wi, WORDS), mask=w_ok,
                            other=0, eviction_policy=EVICT)
        elif TILED == 2:
            words = _cslt_words_slices(word_ptr, rows, wi, row_ok, WORDS, EVICT, BLOCK_R, WPB)
        else:
            words = tl.load(word_ptr + rows[:, None] * WORDS + wi[None, :], mask=w_ok, other=0, eviction_policy=EVICT)
        return words

    @triton.jit
    def tma_kept_pairs(val_desc, word_ptr, row0, rows, row_ok, k0, WORDS, BITS: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, TILED: tl.constexpr):
        """:func:`kept_tile` (``PAIRS``) of a 16-bit 2:4 weight whose value tiles the Tensor Memory Accelerator
        copies: ``val_desc`` a tensor descriptor over the value pairs as int32 ``[R, K/2]`` (block
        ``[BLOCK_R, BLOCK_K/2]``; the consecutive ``rows`` from ``row0``, those past the weight read as
        zeros); the position words too, by a descriptor ``word_ptr`` over ``[R, WORDS]`` (block
        ``[BLOCK_R, BLOCK_K·BITS/32]``), unless ``TILED`` (cuSPARSELt's order: read as :func:`kept_tile`
        reads it). One thread issues each tile's bulk copy and no thread holds its addresses."""
        pairs = val_desc.load([row0, k0 // 2])
        if TILED:
            words = _step_words(word_ptr, rows, row_ok, k0, WORDS, BITS, BLOCK_R, BLOCK_K, "evict_first", TILED)
        else:
            words = word_ptr.load([row0, k0 // (32 // BITS)])
        return pairs, words

    @triton.jit
    def prefetch_positions(word_ptr, rows, row_ok, k_lo, k_hi, WORDS, BITS: tl.constexpr, BLOCK_R: tl.constexpr,
                           COUNT: tl.constexpr, TILED: tl.constexpr):
        """Pull the ``COUNT`` position words from the one holding kept value ``k_lo`` (not past ``k_hi``) of
        rows ``rows`` into L2 (:func:`shuffleprune.kernels.overlap.prefetch_l2`): by 128-byte lines of
        each row in the export's layout, by the 64-byte slice of each 16 rows in cuSPARSELt's order
        (``TILED``, as :func:`_cslt_words_slices` reads them)."""
        F: tl.constexpr = 32 // BITS
        wi = k_lo // F + tl.arange(0, COUNT)
        w_ok = wi < (k_hi + F - 1) // F
        if TILED:
            Q: tl.constexpr = BLOCK_R // 16
            first = tl.max(tl.reshape(rows // 16, (Q, 16)), axis=1) * 16     # each 16-row slice's first row
            q_ok = tl.max(tl.reshape(row_ok.to(tl.int32), (Q, 16)), axis=1) > 0
            ok = q_ok[:, None] & w_ok[None, :]
            prefetch_l2(word_ptr.to(tl.pointer_type(tl.int64)) + tl.where(ok, _cslt_pair(first, wi, WORDS), 0))
        else:
            prefetch_rows(word_ptr, rows, row_ok, WORDS, k_lo // F, (k_hi + F - 1) // F, COUNT, _LINE_WORDS)

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
    def cslt_positions(pairs, rows, N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
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
    def cslt_group_codes(pairs, rows, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Each 2:4 group's 4-bit code ``[BLOCK_R, BLOCK_K/2]`` (as :func:`group_codes` gives it) straight
        from cuSPARSELt's 64-bit pairs: a group's two positions lie side by side, at the bit
        :func:`cslt_positions` gives its first kept value."""
        g = tl.arange(0, 8)
        offs = 32 * ((g >> 1) & 1) + 8 * (2 * (g & 1) + (g >> 2))
        shift = (((rows % 64) // 8) % 2) * 4
        bit = (offs[None, None, :] + shift[:, None, None]).to(tl.int64)
        code = (tl.broadcast_to(pairs[:, :, None], (BLOCK_R, BLOCK_K // 16, 8)) >> bit) & 15
        return tl.reshape(code.to(tl.int32), (BLOCK_R, BLOCK_K // 2))

    @triton.jit
    def positions(words, N: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Position words ``[BLOCK_R, W]`` → each kept value's in-group position ``[BLOCK_R, BLOCK_K/N, N]``."""
        F: tl.constexpr = 32 // BITS
        shifts = tl.arange(0, F) * BITS
        pos = (tl.broadcast_to(words[:, :, None], (BLOCK_R, BLOCK_K // F, F)) >> shifts[None, None, :]) & ((1 << BITS) - 1)
        return tl.reshape(pos, (BLOCK_R, BLOCK_K // N, N))

    @triton.jit
    def group_codes(words, N: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
        """Position words ``[BLOCK_R, W]`` → each group's ``N·BITS``-bit code ``[BLOCK_R, BLOCK_K/N]`` (the
        group's ``j``-th position in bits ``BITS·j…``)."""
        GPW: tl.constexpr = 32 // (N * BITS)       # groups per word
        shifts = tl.arange(0, GPW) * (N * BITS)
        code = (tl.broadcast_to(words[:, :, None], (BLOCK_R, BLOCK_K // N // GPW, GPW)) >> shifts[None, None, :])
        return tl.reshape(code & ((1 << (N * BITS)) - 1), (BLOCK_R, BLOCK_K // N))

    @triton.jit
    def dense_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS,
                   N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVICT: tl.constexpr, TILED: tl.constexpr, NATIVE: tl.constexpr,
                   PAIRS: tl.constexpr = True, SPREAD: tl.constexpr = False):
        """Rows ``rows`` × kept values ``k0 … k0+BLOCK_K`` expanded to their ``BLOCK_K·M/N`` dense
        columns (zeros where pruned), in the values' dtype. 16-bit 2:4 values are read as one 32-bit
        word per group and expanded by byte permutes (:func:`_dense_2of4_pairs`; ``NATIVE``: PTX's
        ``prmt``, else its emulation; ``SPREAD``: its form made of broadcasts), unless ``PAIRS`` is off."""
        G: tl.constexpr = BLOCK_K // N
        AS_PAIRS: tl.constexpr = N == 2 and M == 4 and PAIRS and val_ptr.dtype.element_ty.primitive_bitwidth == 16
        v, words = kept_tile(val_ptr, word_ptr, rows, row_ok, k0, K, WORDS, N, BITS, BLOCK_R, BLOCK_K, EVICT,
                             2 * TILED, AS_PAIRS)
        # one return at the end: Triton compiles the statements after a constexpr branch's return, and
        # ``v`` holds int32 pairs in the first branch only
        if AS_PAIRS:
            dense = _dense_2of4_pairs(v, group_codes(words, N, BITS, BLOCK_R, BLOCK_K), BLOCK_R, G,
                                      val_ptr.dtype.element_ty, NATIVE, SPREAD)
        elif N == 2 and M == 4:
            dense = _dense_2of4(v, group_codes(words, N, BITS, BLOCK_R, BLOCK_K), BLOCK_R, G)
        elif N == 4 and M == 8:
            dense = _dense_4of8(v, group_codes(words, N, BITS, BLOCK_R, BLOCK_K), BLOCK_R, G)
        else:
            pos = positions(words, N, BITS, BLOCK_R, BLOCK_K)
            hit = pos[:, :, :, None] == tl.arange(0, M)[None, None, None, :]
            vals = v[:, :, :, None]
            dense = tl.reshape(tl.sum(tl.where(hit, vals, tl.zeros_like(vals)), axis=2), (BLOCK_R, G * M))
        return dense

    @triton.jit
    def tma_dense_tile(val_desc, word_ptr, row0, rows, row_ok, k0, WORDS, BITS: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_K: tl.constexpr, DTYPE: tl.constexpr, TILED: tl.constexpr, NATIVE: tl.constexpr):
        """:func:`dense_tile` of a 16-bit 2:4 weight read by :func:`tma_kept_pairs`. Compiled for sm_90a (64
        rows × 128 kept values, 16 tokens, 4096×4096) the weight-as-A decode takes 126 registers against
        200 with per-thread asynchronous copies, with the same loop (665 instructions against 669;
        Triton 3.6: 124 against 166, 700 against 710)."""
        pairs, words = tma_kept_pairs(val_desc, word_ptr, row0, rows, row_ok, k0, WORDS, BITS, BLOCK_R, BLOCK_K,
                                      2 * TILED)
        return _dense_2of4_pairs(pairs, group_codes(words, 2, BITS, BLOCK_R, BLOCK_K), BLOCK_R, BLOCK_K // 2, DTYPE,
                                 NATIVE)

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
                          NATIVE: tl.constexpr, SPREAD: tl.constexpr = False):
        """16-bit 2:4 groups, each value pair as one 32-bit word ``[BLOCK_R, G]`` (first value in the low
        half), and their 4-bit codes → ``[BLOCK_R, G·4]`` dense in ``DTYPE`` by two byte permutes per
        group: dense slots 0–1 and 2–3 are each a ``prmt`` of the pair and zero, whose selector — bytes
        0–1 of the pair (``10``) at slot ``p0``, bytes 2–3 (``32``) at slot ``p1``, zero (``44``)
        elsewhere — is ``0x4444`` with ``0x54 ≪ 8·p0`` and ``0x76 ≪ 8·p1`` XORed in (``p0 < p1``: they
        never overlap; the upper half's selector is the same word shifted down 16 bits). About 11
        instructions per group where :func:`_dense_2of4`'s selects took about 22 (sm_90a: the 16-token
        decode's loop 968 → 669 instructions with the weight as the A operand, 917 → 762 without; the
        512-token GEMM's 151 → 130).

        ``SPREAD``: each pair and selector is broadcast to the group's two dense words and each word is one
        ``prmt`` of them, where the pairs' ``join`` made them side by side. Made only of broadcasts and
        element-wise operations, the expansion lets the compiler give the pairs, as they are read from
        shared memory, the layout of the MMA's A operand (each thread the dense words it feeds the
        tensor cores): compiled for sm_90a (Triton 3.9; 64 rows × 128 kept values, 16 tokens, weight as A)
        the expanded tile no longer goes through shared memory to change layout (the loop's shared-memory
        traffic 30.2 → 18.9 KB, its barrier for that gone), for more instructions (669 → 922: each
        group's selector is worked out by the two threads that hold its halves)."""
        t = ((0x54 << ((code << 3) & 0x18)) | (0x76 << ((code << 1) & 0x18))) ^ 0x44444444
        if SPREAD:
            half = tl.arange(0, 2)[None, None, :]
            sel = tl.reshape(t[:, :, None] >> (16 * half), (BLOCK_R, G * 2))
            spread = tl.reshape(tl.broadcast_to(pairs[:, :, None], (BLOCK_R, G, 2)), (BLOCK_R, G * 2))
            words = _prmt(spread, sel, NATIVE)
        else:
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
    def mma_step(acc, dense, xs, WEIGHT_A: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
        """One step on the tensor cores: ``acc[R, T] += dense @ xsᵀ`` with the weight as the MMA's A
        operand (``WEIGHT_A``), else ``acc[T, R] += xs @ denseᵀ``; ``UPCAST``: in float32 (the
        interpreter's bfloat16, see :func:`.gpu.upcast`)."""
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
