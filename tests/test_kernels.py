"""The word-layout Triton kernels (``kernels/nm_decode.py``, ``nm_gemm.py``, ``split_k.py`` on the layout
of ``nm_words.py``) against float64 references, interpreted on the CPU (``TRITON_INTERPRET=1``): decode (with split-K, with and without ``tl.dot``), the prefill
GEMM, and decompression into a shared buffer; ragged shapes, 2:4 and 4:8, index map and bias,
float16 / bfloat16 / float32; and every ``SparseLinear`` policy through the same reference."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from shuffleprune.deploy.format import compress, meta_bits
from shuffleprune.deploy import auto_choice, impl_rules
from shuffleprune.deploy.impls import IMPLS, LIBRARY_IMPLS, SWAP_TILES, default_choice
from shuffleprune.deploy.sparse_linear import SparseLinear
from shuffleprune.masks import nm_keep_mask

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def _case(rows: int, cols: int, n: int, m: int, tokens: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w = (w * nm_keep_mask(w.abs(), n, m))
    w[0, :m] = 0  # a group with fewer than N non-zeros
    w = w.to(dtype)
    values, meta = compress(w, n, m)
    x = torch.randn(tokens, cols, generator=g).to(dtype)
    perm = torch.randperm(cols, generator=g)
    bias = torch.randn(rows, generator=g).to(dtype)
    return w, values, meta, x, perm, bias


def _close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> bool:
    scale = max(1.0, ref.abs().max().item())
    return y.dtype == dtype and torch.allclose(y.double(), ref, atol=TOL[dtype] * scale, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,n,m,tokens,split,use_dot,dot", [
    (48, 64, 2, 4, 1, None, None, False),   # one token: select kernel, split-K chosen by the plan
    (37, 96, 2, 4, 3, 3, False, False),     # select forced at 3 tokens, ragged rows, three splits of the kept values
    (24, 160, 2, 4, 1, 2, None, False),     # one token, 3 and 2 steps per split: the mapped inputs read a step ahead
    (33, 128, 4, 8, 2, 1, False, False),    # select forced, 4:8 (4-bit positions, selects chained over 8 slots)
    (20, 64, 1, 4, 1, None, None, False),   # 1:4 (one kept value per group)
    (7, 64, 2, 4, 1, None, True, True),     # tensor-core kernel forced at one token, 7 of its 64 rows
    (29, 160, 2, 4, 2, None, None, False),  # two tokens: still the select kernel, K not a multiple of the step
    (20, 64, 1, 4, 3, None, None, True),    # tensor cores, 1:4 (generic expansion)
    (33, 128, 4, 8, 5, 1, None, True),      # tensor cores, 4:8 expansion, no split
    (21, 256, 4, 8, 1, None, None, True),   # 4:8 takes the tensor cores from one token
    (40, 96, 2, 4, 8, 2, None, True),       # tensor cores, 2:4 expansion, ragged, split
    (24, 160, 2, 4, 16, None, None, True),  # 16 tokens, K not a multiple of the step
])
@pytest.mark.parametrize("with_perm,with_bias", [(True, True), (False, False)])
def test_decode_kernel_matches_float64(rows, cols, n, m, tokens, split, use_dot, dot, dtype, with_perm, with_bias):
    from shuffleprune.kernels.decode_tiles import decode_plan
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.kernels.nm_words import position_words

    w, values, meta, x, perm, bias = _case(rows, cols, n, m, tokens, dtype, seed=rows + tokens)
    p = perm if with_perm else None
    b = bias if with_bias else None
    over = {"split": split, "block_k": 16} if split else {}   # short steps, so the kept values split
    if use_dot is not None:
        over["use_dot"] = use_dot
    y = nm_decode(x, values, position_words(meta), n, m, meta_bits(m), None if p is None else p.to(torch.int32), b,
                  **over)
    xr = x.double() if p is None else x.double()[:, p]
    ref = xr @ w.double().t() + (0 if b is None else b.double())
    assert y.shape == (tokens, rows) and _close(y, ref, dtype)
    plan = decode_plan(rows, values.shape[1], tokens, n, m, meta_bits(m), x.device, element_bytes=x.element_size(),
                       **over)
    assert plan["use_dot"] == dot
    if split:
        assert plan["split"] == split


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("tiled", [False, True])
def test_select_loop_by_group_and_by_value_both_match_float64(tokens, dtype, tiled):
    """The 2:4 select loop by group (the default: a group's two values as one word, its positions as one
    4-bit code) and per kept value (``by_group=False``) give the float64 product at 1–2 tokens, with the
    map read in the kernel or not, in the export's position words and in cuSPARSELt's order; ragged
    rows and kept values split over two programs."""
    from shuffleprune.deploy.cslt_layout import cslt_words
    from shuffleprune.kernels.decode_tiles import decode_plan
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.kernels.nm_words import position_words

    rows, cols = (64, 96) if tiled else (37, 160)   # cuSPARSELt's order: whole 64-row bands, 32-column tiles
    w, values, meta, x, perm, bias = _case(rows, cols, 2, 4, tokens, dtype, seed=3 + tokens)
    words = cslt_words(position_words(meta)) if tiled else position_words(meta)
    for p in (perm.to(torch.int32), None):
        ref = (x.double() if p is None else x.double()[:, p.long()]) @ w.double().t() + bias.double()
        for by_group in (True, False):
            y = nm_decode(x, values, words, 2, 4, meta_bits(4), p, bias, tiled=tiled, split=2, block_k=32,
                          by_group=by_group)
            assert _close(y, ref, dtype), (p is None, by_group)
    assert decode_plan(rows, values.shape[1], tokens, 2, 4, 2, x.device, by_group=False)["by_group"] is False
    assert decode_plan(rows, values.shape[1], 3, 2, 4, 2, x.device, by_group=False)["by_group"]   # tensor cores


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("tiled", [False, True])
def test_resident_input_decode_matches_float64(tokens, dtype, tiled):
    """The resident-input 2:4 decode (``kernels/nm_resident.py``: a program reads its chunk's inputs once,
    through the map, then streams rows past them) gives the float64 product at 1–2 tokens, with the map
    or without, with bias or without, in the export's words and in cuSPARSELt's order: one chunk of the
    kept values, and five chunks over three row ranges (ragged rows), their partial sums added by the
    last program of each range or by a second launch (the two bit for bit: both add in chunk order)."""
    from shuffleprune.deploy.cslt_layout import cslt_words
    from shuffleprune.kernels.nm_resident import nm_decode_resident, resident_plan
    from shuffleprune.kernels.nm_words import position_words

    rows, cols = (64, 96) if tiled else (37, 160)   # cuSPARSELt's order: whole 64-row bands, 32-column tiles
    w, values, meta, x, perm, bias = _case(rows, cols, 2, 4, tokens, dtype, seed=7 + tokens)
    words = cslt_words(position_words(meta)) if tiled else position_words(meta)
    chunked = {"block_k": 16, "rows_per": 16}
    plan = resident_plan(rows, values.shape[1], tokens, 1, **chunked)
    assert (plan["split"], plan["ranges"]) == ((3, 4) if tiled else (5, 3))
    assert resident_plan(rows, values.shape[1], tokens, 1)["split"] == 1
    for p, b in ((perm.to(torch.int32), bias), (None, None)):
        ref = (x.double() if p is None else x.double()[:, p.long()]) @ w.double().t() + (0 if b is None else b.double())
        ys = {}
        for over, in_kernel in (({}, None), (chunked, None), (chunked, False)):
            y = ys[bool(over), in_kernel] = nm_decode_resident(x, values, words, 2, 4, 2, p, b, tiled=tiled,
                                                                sum_in_kernel=in_kernel, **over)
            assert y.shape == (tokens, rows) and _close(y, ref, dtype), (p is None, over, in_kernel)
        assert torch.equal(ys[True, None], ys[True, False])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [2, 9, 16, 40])
@pytest.mark.parametrize("tiled", [False, True])
def test_tma_weight_tiles_decode_as_the_loads_do(tokens, dtype, tiled):
    """The weight-as-A tensor-core decode with its weight tiles copied by tensor descriptors (``tma``) gives
    the float64 product, bit for bit what its per-thread loads give: ragged rows (the descriptor's
    zeros past the last), the map and bias or neither, several steps per split, split-K summed in the
    kernel and by a second launch, the export's words (by descriptor) and cuSPARSELt's order (read
    as without)."""
    from shuffleprune.deploy.cslt_layout import cslt_words
    from shuffleprune.kernels.decode_tiles import DOT_TILES_SWAP_TMA, decode_plan
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.kernels.nm_words import position_words

    rows, cols = (128, 512) if tiled else (100, 512)   # cuSPARSELt's order: whole 64-row bands
    w, values, meta, x, perm, bias = _case(rows, cols, 2, 4, tokens, dtype, seed=3 + tokens)
    words = cslt_words(position_words(meta)) if tiled else position_words(meta)
    for p, b in ((perm.to(torch.int32), bias), (None, None)):
        ref = (x.double() if p is None else x.double()[:, p.long()]) @ w.double().t() + (0 if b is None else b.double())
        for over in ({}, {"block_r": 32, "block_k": 64, "split": 2}, {"block_r": 16, "block_k": 64, "split": 2,
                                                                      "sum_in_kernel": False}):
            kw = dict(use_dot=True, weight_a=True, tiled=tiled, **over)
            y = nm_decode(x, values, words, 2, 4, 2, p, b, tma=True, **kw)
            assert y.shape == (tokens, rows) and _close(y, ref, dtype), (p is None, over)
            tile = decode_plan(rows, values.shape[1], tokens, 2, 4, 2, x.device, use_dot=True, weight_a=True, tma=True,
                               **{k: v for k, v in over.items() if k != "sum_in_kernel"})
            same = {k: tile[k] for k in ("block_r", "block_k", "split", "num_warps")}   # the loads on its tile
            assert torch.equal(y, nm_decode(x, values, words, 2, 4, 2, p, b, **{**kw, **same}))
    plan = decode_plan(4096, 2048, tokens, 2, 4, 2, x.device, weight_a=True, use_dot=True, tma=True, stages=3)
    block_r, columns, warps, per_sm = DOT_TILES_SWAP_TMA[plan["block_t"]]   # its own tile, as compiled
    assert plan["tma"] and (plan["block_r"], plan["block_k"] * 2, plan["num_warps"]) == (block_r, columns, warps)
    assert plan["per_sm"] == per_sm and plan["block_k"] * 2 >= 64   # 16 bytes of position words per row and step
    assert not decode_plan(4096, 2048, tokens, 2, 4, 2, x.device, weight_a=True, use_dot=True)["tma"]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [2, 9, 16])
@pytest.mark.parametrize("tiled", [False, True])
def test_spread_expansion_decodes_what_the_joined_one_does(tokens, dtype, tiled):
    """The weight-as-A tensor-core decode with its 2:4 tiles expanded by broadcasts (``spread``) gives the
    float64 product, bit for bit what the pairs' joined expansion gives on the same tile: ragged rows and
    kept values, the map and bias or neither, split-K summed in the kernel and by a second launch, the
    64-row 4-warp tile and the 32-row 2-warp one SparseLinear weighs (``decode_swap_spread``,
    ``decode_swap_spread_sync``), the export's words and cuSPARSELt's order."""
    from shuffleprune.deploy.cslt_layout import cslt_words
    from shuffleprune.deploy.impls import DECODE_KERNELS
    from shuffleprune.kernels.decode_tiles import decode_plan
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.kernels.nm_words import position_words

    rows, cols = (128, 352) if tiled else (100, 352)   # 176 kept values: not a multiple of any step
    w, values, meta, x, perm, bias = _case(rows, cols, 2, 4, tokens, dtype, seed=7 + tokens)
    words = cslt_words(position_words(meta)) if tiled else position_words(meta)
    tiles = [{k: v for k, v in DECODE_KERNELS[name].items() if k != "spread"}
             for name in ("decode_swap_spread", "decode_swap_spread_sync")]
    for p, b in ((perm.to(torch.int32), bias), (None, None)):
        ref = (x.double() if p is None else x.double()[:, p.long()]) @ w.double().t() + (0 if b is None else b.double())
        for over in (*tiles, {"use_dot": True, "weight_a": True, "block_r": 16, "block_k": 32, "split": 3,
                              "sum_in_kernel": False}):
            y = nm_decode(x, values, words, 2, 4, 2, p, b, tiled=tiled, spread=True, **over)
            assert y.shape == (tokens, rows) and _close(y, ref, dtype), (p is None, over)
            assert torch.equal(y, nm_decode(x, values, words, 2, 4, 2, p, b, tiled=tiled, **over)), (p is None, over)
    plan = decode_plan(4096, 2048, tokens, 2, 4, 2, x.device, use_dot=True, weight_a=True, spread=True)
    assert plan["spread"] and plan == {**decode_plan(4096, 2048, tokens, 2, 4, 2, x.device, use_dot=True,
                                                     weight_a=True), "spread": True}   # the same tile and split
    _, v48, m48, x48, *_ = _case(24, 256, 4, 8, 4, dtype)
    with pytest.raises(ValueError, match="spread takes"):   # 4:8, 32-bit inputs, TMA's tiles, the select loop
        nm_decode(x48, v48, position_words(m48), 4, 8, 4, spread=True, use_dot=True, weight_a=True)
    _, v32, m32, x32, *_ = _case(24, 256, 2, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="spread takes"):
        nm_decode(x32, v32, position_words(m32), 2, 4, 2, spread=True, use_dot=True, weight_a=True)
    with pytest.raises(ValueError, match="spread takes"):
        decode_plan(4096, 2048, tokens, 2, 4, 2, x.device, use_dot=True, weight_a=True, tma=True, spread=True)
    with pytest.raises(ValueError, match="spread takes"):
        decode_plan(4096, 2048, 2, 2, 4, 2, x.device, use_dot=False, spread=True)
    lin = SparseLinear(values, meta, cols, 2, 4, perm=perm, bias=bias)
    assert {"decode_swap_spread", "decode_swap_spread_sync"} <= set(lin.candidates(x))   # 2-16 tokens, 16-bit
    assert not {"decode_swap_spread", "decode_swap_spread_sync"} & set(lin.candidates(x[:1]))
    assert "decode_swap_spread" in lin.candidates(x.repeat(17, 1)[:17])   # 64 rows: to 64 tokens as decode_swap
    assert "decode_swap_spread_sync" not in lin.candidates(x.repeat(17, 1)[:17])   # 32 rows: to 16
    assert not {"decode_swap_spread", "decode_swap_spread_sync"} & set(lin.candidates(x.repeat(65, 1)[:65]))
    named = SparseLinear(values, meta, cols, 2, 4, perm=perm, bias=bias, policy="decode_swap_spread")
    assert _close(named(x), (x.double()[:, perm] @ w.double().t() + bias.double()), dtype)   # the gathered input


def test_tma_decode_refuses_what_the_copies_cannot_read():
    """Tensor descriptors need 16-bit 2:4 values of the inputs' dtype, the weight-as-A tensor-core loop and
    rows of a multiple of 16 bytes; ``SparseLinear`` weighs ``decode_swap_tma`` only where they hold."""
    from shuffleprune.kernels.nm_decode import nm_decode, tma_applies
    from shuffleprune.kernels.nm_words import position_words

    w, values, meta, x, perm, bias = _case(24, 256, 2, 4, 4, torch.bfloat16)
    words = position_words(meta)
    assert tma_applies(x, values, words, 2, 4, False)
    with pytest.raises(ValueError, match="weight-as-A"):
        nm_decode(x, values, words, 2, 4, 2, tma=True, use_dot=True)
    with pytest.raises(ValueError, match="at least 64 kept values"):   # a step's words: 16 bytes at least
        nm_decode(x, values, words, 2, 4, 2, tma=True, use_dot=True, weight_a=True, block_k=32)
    _, v32, m32, x32, *_ = _case(24, 256, 2, 4, 4, torch.float32)
    assert not tma_applies(x32, v32, position_words(m32), 2, 4, False)
    with pytest.raises(ValueError, match="16-bit inputs"):
        nm_decode(x32, v32, position_words(m32), 2, 4, 2, tma=True, use_dot=True, weight_a=True)
    _, v96, m96, x96, *_ = _case(24, 96, 2, 4, 4, torch.bfloat16)   # 48 kept values: rows of 96 bytes, words of 12
    assert not tma_applies(x96, v96, position_words(m96), 2, 4, False)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        nm_decode(x96, v96, position_words(m96), 2, 4, 2, tma=True, use_dot=True, weight_a=True)
    assert not tma_applies(x.half(), values, words, 2, 4, False)   # values of another dtype
    lin = SparseLinear(values, meta, 256, 2, 4, perm=perm, bias=bias)
    assert "decode_swap_tma" in lin.candidates(x) and "decode_resident_tma" in lin.candidates(x[:1])
    x40 = torch.randn(40, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert "decode_swap_tma" in lin.candidates(x40)   # its 128-column step to 64 tokens
    assert "decode_swap_tma" not in lin.candidates(torch.cat([x40, x40]))   # 80: past the decodes
    assert not {"decode_swap_tma", "decode_resident_tma"} & set(SparseLinear(v96, m96, 96, 2, 4).candidates(x96[:2]))
    w96 = _case(24, 96, 2, 4, 4, torch.bfloat16)[0].double()
    for policy, xs in (("decode_swap_tma", x96), ("decode_resident_tma", x96[:1])):   # where they cannot run: the
        named = SparseLinear(v96, m96, 96, 2, 4, policy=policy)                       # decodes without copies
        assert _close(named(xs), xs.double() @ w96.t(), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("tiled", [False, True])
def test_resident_decode_with_tma_tiles_gives_what_its_loads_give(tokens, dtype, tiled):
    """The resident decode with its weight's tiles copied by tensor descriptors (``tma``) gives, bit for bit,
    what its per-thread loads give, and the float64 product: ragged rows past the last descriptor row,
    the map and bias or neither, one chunk and four over three row ranges, summed in the kernel and by
    a second launch; the export's words (by descriptor) and cuSPARSELt's order (read as without).
    Chunks under 64 kept values are refused (a row's words in a step: 16 bytes at least)."""
    from shuffleprune.deploy.cslt_layout import cslt_words
    from shuffleprune.kernels.nm_resident import nm_decode_resident
    from shuffleprune.kernels.nm_words import position_words

    rows, cols = (64, 512) if tiled else (37, 512)
    w, values, meta, x, perm, bias = _case(rows, cols, 2, 4, tokens, dtype, seed=11 + tokens)
    words = cslt_words(position_words(meta)) if tiled else position_words(meta)
    for p, b in ((perm.to(torch.int32), bias), (None, None)):
        ref = (x.double() if p is None else x.double()[:, p.long()]) @ w.double().t() + (0 if b is None else b.double())
        for over in ({}, {"block_k": 64, "rows_per": 16}, {"block_k": 64, "rows_per": 16, "sum_in_kernel": False}):
            y = nm_decode_resident(x, values, words, 2, 4, 2, p, b, tiled=tiled, tma=True, **over)
            assert _close(y, ref, dtype), (p is None, over)
            assert torch.equal(y, nm_decode_resident(x, values, words, 2, 4, 2, p, b, tiled=tiled, **over))
    with pytest.raises(ValueError, match="at least 64 kept values"):
        nm_decode_resident(x, values, words, 2, 4, 2, tiled=tiled, tma=True, block_k=32)


def test_resident_decode_requests_its_first_tiles_into_l2_before_its_inputs():
    """Each program first requests into L2 its chunk of the rows its pipeline loads first (4 stages of 16
    rows: 48, as a power of two 32), with one line of their position words; a dependent launch from two
    tokens as many rows as the decode's 4 MiB over all programs allows if that is more; in cuSPARSELt's
    order whole 16-row slices or nothing; nothing where a chunk is shorter than a cache line."""
    from shuffleprune.kernels.nm_resident import prefetch_plan, resident_plan

    p = resident_plan(4096, 2048, 2, 132)                       # 8 chunks × 64 ranges of 64 rows
    assert prefetch_plan(p, 1, 2, 2, False, stages=4) == {"PREFETCH": 32, "PREFETCH_WORDS": 32, "LINE": 64}
    assert prefetch_plan(p, 2, 2, 2, False, stages=4, pdl=True)["PREFETCH"] == 32    # the budget's 16 are fewer
    assert prefetch_plan(p, 1, 2, 2, False, pdl=True)["PREFETCH"] == 0               # no head, one token: none
    assert prefetch_plan(p, 2, 2, 2, False, pdl=True)["PREFETCH"] == 16              # 8·64 programs · 16 rows · 512 B
    many = resident_plan(4096, 8192, 2, 132, per_sm=8)          # 1024 programs: 8 rows each within the budget
    assert prefetch_plan(many, 2, 2, 2, False, pdl=True)["PREFETCH"] == 8
    assert prefetch_plan(many, 2, 2, 2, True, pdl=True)["PREFETCH"] == 0             # not a whole 16-row slice
    assert prefetch_plan(many, 2, 2, 2, True, stages=4, pdl=True)["PREFETCH"] == 32
    assert prefetch_plan(resident_plan(16, 2048, 1, 132), 1, 2, 2, False, stages=4)["PREFETCH"] == 16   # its rows
    assert prefetch_plan(resident_plan(64, 24, 2, 132), 2, 2, 2, False, stages=4)["PREFETCH"] == 0      # 32 values


def test_resident_input_decode_refuses_what_it_does_not_run():
    """More than two tokens, a pattern other than 2:4, 32-bit values or a row range that is no power of
    two are refused; ``SparseLinear``'s ``decode_resident`` runs ``decode_mapped`` there instead."""
    from shuffleprune.deploy.impls import TILE_MAX_TOKENS
    from shuffleprune.kernels.nm_resident import RESIDENT_MAX_TOKENS, nm_decode_resident, resident_plan
    from shuffleprune.kernels.nm_words import position_words

    assert TILE_MAX_TOKENS["decode_resident"] == RESIDENT_MAX_TOKENS   # auto weighs it where it runs
    w, values, meta, x, perm, bias = _case(24, 64, 2, 4, 3, torch.float16)
    with pytest.raises(ValueError, match="1-2 tokens of a 2:4 weight"):
        nm_decode_resident(x, values, position_words(meta), 2, 4, 2)
    _, v32, m32, x32, *_ = _case(24, 64, 2, 4, 1, torch.float32)
    with pytest.raises(ValueError, match="16-bit values"):
        nm_decode_resident(x32, v32, position_words(m32), 2, 4, 2)
    with pytest.raises(ValueError, match="power of two rows"):
        resident_plan(24, 32, 1, 1, rows_per=24)
    lin = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias, policy="decode_resident")
    assert _close(lin(x), x.double()[:, perm] @ w.double().t() + bias.double(), torch.float16)


@pytest.mark.parametrize("rows,cols,n,m,tokens,span,over", [
    (40, 192, 2, 4, 1, 64, {"block_k": 32}),                    # select, three blocks per step, several steps
    (24, 160, 2, 4, 2, 16, {"block_k": 16, "split": 2}),       # select, split-K, K not a multiple of the step
    (33, 128, 4, 8, 2, 16, {"use_dot": False}),                 # 4:8: the select loop's per-slot reads
    (40, 96, 2, 4, 8, 32, {"weight_a": True, "block_k": 16}),   # tensor cores, weight as the MMA's A operand
    (24, 128, 2, 4, 16, 64, {"use_dot": True}),                 # tensor cores, inputs as the A operand
    (30, 96, 2, 4, 1, 64, {}),                                  # 96 columns: the last block cut short
])
def test_decode_reads_a_block_map_as_offsets(rows, cols, n, m, tokens, span, over):
    """A map within aligned blocks (as ``prune`` writes them) given as 1-byte offsets: the select and
    tensor-core decodes read them instead of the int32 map and give the float64 product (another
    block map's offsets give that map's product, so the offsets are what was read); offsets that do
    not cover the input fall back to the int32 map. Offsets of a map that leaves its blocks, or of a
    span that is no power of two, are refused."""
    from shuffleprune.kernels.nm_decode import block_map_offsets, block_span, nm_decode
    from shuffleprune.kernels.nm_words import position_words
    from shuffleprune.perm.core import random_block_perm

    dtype = torch.bfloat16
    w, values, meta, x, _, bias = _case(rows, cols, n, m, tokens, dtype, seed=rows + span)
    gen = torch.Generator().manual_seed(span)
    perm, other = random_block_perm(cols, span, gen), random_block_perm(cols, span, gen)
    ref, ref_other = (x.double()[:, p] @ w.double().t() + bias.double() for p in (perm, other))
    perm32, offsets = perm.to(torch.int32), block_map_offsets(perm, span)
    assert offsets.dtype == torch.uint8 and int(offsets.max()) < span
    args = (values, position_words(meta), n, m, meta_bits(m), perm32, bias)
    assert _close(nm_decode(x, *args, block_map=(offsets, span), **over), ref, dtype)
    # the offsets are what the kernel read: another block map's give that map's product
    assert _close(nm_decode(x, *args, block_map=(block_map_offsets(other, span), span), **over), ref_other, dtype)
    # offsets that do not cover the input's columns: the int32 map is read
    assert _close(nm_decode(x, *args, block_map=(block_map_offsets(other, span)[:-span], span), **over), ref, dtype)
    assert block_span((offsets, span), perm32, cols) == span and block_span((offsets[:-1], span), perm32, cols) == 0
    assert block_span(None, perm32, cols) == block_span((offsets, span), None, cols) == 0
    with pytest.raises(ValueError, match="leaves its blocks"):
        block_map_offsets(torch.randperm(cols, generator=torch.Generator().manual_seed(0)), span)
    with pytest.raises(ValueError, match="power of two"):
        block_map_offsets(perm, 48)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,kernel", [(1, {}), (2, {}), (5, {"weight_a": True}), (20, {"weight_a": True})])
def test_mapped_decode_reads_its_gather_as_words_only_where_aligned(tokens, kernel, dtype):
    """The map's gather as 32-bit words (an aligned 16-bit input; the select loop, and the tensor-core
    decode with the weight as the MMA's A operand) and one step ahead in registers (an input starting
    mid-word, or ``async_gather=False``; at 20 tokens read in the step) give the float64 product."""
    from shuffleprune.kernels.nm_decode import nm_decode, word_gather
    from shuffleprune.kernels.nm_words import position_words

    rows, cols = 40, 192
    w, values, meta, x, perm, bias = _case(rows, cols, 2, 4, tokens, dtype, seed=7 + tokens)
    ref = x.double()[:, perm] @ w.double().t() + bias.double()
    odd = torch.empty(tokens * cols + 1, dtype=dtype)[1:].view(tokens, cols)   # starts 2 bytes into a word
    odd.copy_(x)
    assert word_gather(x) and not word_gather(odd) and not word_gather(x.float())
    args = (values, position_words(meta), 2, 4, meta_bits(4), perm.to(torch.int32), bias)
    for inp, over in ((x, {}), (x, {"async_gather": False}), (odd, {})):
        y = nm_decode(inp, *args, block_k=32, **kernel, **over)   # several steps: the pipelined gather crosses steps
        assert _close(y, ref, dtype)
    with pytest.raises(ValueError, match="async_gather"):
        nm_decode(odd, *args, async_gather=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,cols,n,m,tokens,block_t,warps", [
    (40, 96, 2, 4, 20, 32, 4),      # 17–32 tokens: a 32-token tile, the 2:4 tile of 2–16 tokens
    (70, 160, 2, 4, 40, 64, 8),     # 33–64 tokens: a 64-token tile on 8 warps, ragged rows and K
    (33, 128, 4, 8, 64, 64, 8),     # 4:8, a full 64-token tile
    (20, 64, 1, 4, 24, 32, 4),      # 1:4, generic expansion
])
def test_decode_kernel_takes_up_to_64_tokens(rows, cols, n, m, tokens, block_t, warps, dtype):
    """Prompts of 17–64 tokens run the tensor-core decode (index map read in the kernel) on
    16-bit inputs; float32 and the select kernel stop at 16 tokens with an error naming nm_gemm."""
    from shuffleprune.kernels.decode_tiles import decode_plan
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.kernels.nm_words import position_words

    w, values, meta, x, perm, bias = _case(rows, cols, n, m, tokens, dtype, seed=rows + tokens)
    y = nm_decode(x, values, position_words(meta), n, m, meta_bits(m), perm.to(torch.int32), bias)
    assert _close(y, x.double()[:, perm] @ w.double().t() + bias.double(), dtype)
    plan = decode_plan(rows, values.shape[1], tokens, n, m, meta_bits(m), x.device, element_bytes=2)
    assert plan["use_dot"] and plan["block_t"] == block_t and plan["num_warps"] == warps
    with pytest.raises(ValueError, match="nm_gemm"):
        nm_decode(x.float(), values.float(), position_words(meta), n, m, meta_bits(m))
    with pytest.raises(ValueError, match="at most 16"):
        nm_decode(x, values, position_words(meta), n, m, meta_bits(m), use_dot=False)
    with pytest.raises(ValueError, match="nm_gemm"):
        nm_decode(torch.cat([x] * 4), values, position_words(meta), n, m, meta_bits(m))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,n,m,tokens", [(48, 64, 2, 4, 17), (37, 160, 2, 4, 70), (33, 128, 4, 8, 40)])
def test_gemm_kernel_matches_float64(rows, cols, n, m, tokens, dtype):
    from shuffleprune.kernels.nm_gemm import nm_gemm
    from shuffleprune.kernels.nm_words import position_words

    w, values, meta, x, _, bias = _case(rows, cols, n, m, tokens, dtype, seed=cols)
    y = nm_gemm(x, values, position_words(meta), n, m, meta_bits(m), bias, tile=(16, 16, 64, 4, 1))
    assert _close(y, x.double() @ w.double().t() + bias.double(), dtype)
    y = nm_gemm(x, values, position_words(meta), n, m, meta_bits(m), None, tile=(32, 32, 64, 4, 1))
    assert _close(y, x.double() @ w.double().t(), dtype)
    y = nm_gemm(x, values, position_words(meta), n, m, meta_bits(m), bias, tile=(16, 32, 32, 4, 1), split=2)
    assert _close(y, x.double() @ w.double().t() + bias.double(), dtype)   # split-K: partial sums + bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,n,m,tokens", [(70, 160, 2, 4, 3), (33, 256, 4, 8, 16), (20, 64, 1, 4, 5),
                                                  (65, 96, 2, 4, 40)])
def test_weight_as_mma_a_operand_matches_float64(rows, cols, n, m, tokens, dtype):
    """The tensor-core decode and the GEMM with the weight tile as the MMA's A operand (``acc[rows,
    tokens]``, stored transposed): ragged rows and K, 2:4, 4:8 and the generic expansion, index map
    and bias, split-K, and the tiles of DOT_TILES_SWAP / GEMM_TILES_SWAP / GEMM_TILES_SWAP_TALL."""
    from shuffleprune.kernels.decode_tiles import decode_plan
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.kernels.nm_gemm import nm_gemm
    from shuffleprune.kernels.nm_words import position_words

    w, values, meta, x, perm, bias = _case(rows, cols, n, m, tokens, dtype, seed=rows * tokens)
    words, bits = position_words(meta), meta_bits(m)
    ref = x.double()[:, perm] @ w.double().t() + bias.double()
    if tokens <= 16 or dtype != torch.float32:
        y = nm_decode(x, values, words, n, m, bits, perm.to(torch.int32), bias, use_dot=True, weight_a=True)
        assert _close(y, ref, dtype)
        y = nm_decode(x, values, words, n, m, bits, perm.to(torch.int32), None, use_dot=True, weight_a=True,
                      block_r=16, block_k=16, split=2)   # split-K partials of the transposed accumulator
        assert _close(y, ref - bias.double(), dtype)
        plan = decode_plan(rows, values.shape[1], tokens, n, m, bits, x.device, element_bytes=x.element_size(),
                           use_dot=True, weight_a=True)
        assert plan["weight_a"] and plan["use_dot"]
    xp = x[:, perm].contiguous()
    y = nm_gemm(xp, values, words, n, m, bits, bias, weight_a=True)   # the plan's swap tile
    assert _close(y, ref, dtype)
    y = nm_gemm(xp, values, words, n, m, bits, bias, weight_a=True, tall=True)   # 128 weight rows per program
    assert _close(y, ref, dtype)
    y = nm_gemm(xp, values, words, n, m, bits, None, tile=(16, 16, 64, 4, 1), split=2, weight_a=True)
    assert _close(y, ref - bias.double(), dtype)

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel,tokens", [("select", 1), ("select", 2), ("dot", 5), ("swap", 9), ("gemm", 20),
                                           ("gemm_swap", 33)])
def test_split_k_sums_in_the_last_split_as_the_separate_kernel_does(kernel, tokens, dtype, monkeypatch):
    """Split-K's partial sums added by the split that arrives last at its output tile (one launch) give
    the two-launch result bit for bit (the same float32 sum in split order, then the bias), leave every
    counter at 0 for the next launch, and fall back to the second launch beyond the counters there are."""
    from shuffleprune.kernels import split_k
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.kernels.nm_gemm import nm_gemm
    from shuffleprune.kernels.nm_words import position_words

    rows, cols = 37, 256
    w, values, meta, x, perm, bias = _case(rows, cols, 2, 4, tokens, dtype, seed=tokens)
    words, perm32 = position_words(meta), perm.to(torch.int32)
    if kernel.startswith("gemm"):
        xp = x[:, perm].contiguous()
        tile = (64, 16, 32, 4, 1) if kernel == "gemm_swap" else (16, 16, 32, 4, 1)   # 64 tokens: summed 16 at a time
        run = lambda **kw: nm_gemm(xp, values, words, 2, 4, 2, bias, tile=tile, split=4,
                                   weight_a=kernel == "gemm_swap", **kw)
    else:
        kind = {"select": {"use_dot": False}, "dot": {"use_dot": True}, "swap": {"use_dot": True, "weight_a": True}}
        run = lambda **kw: nm_decode(x, values, words, 2, 4, 2, perm32, bias, block_r=16, block_k=16,
                                     split=3, **kind[kernel], **kw)
    two_launches = run(sum_in_kernel=False)
    assert _close(two_launches, x.double()[:, perm] @ w.double().t() + bias.double(), dtype)
    sum_kernel, summed = split_k.sum_partials, []
    monkeypatch.setattr(split_k, "sum_partials", lambda *a: summed.append(a) or sum_kernel(*a))
    one_launch = run()
    assert not summed and torch.equal(one_launch, two_launches)
    counters = split_k._COUNTERS[x.device][0]   # every counter of the ring
    assert counters.dtype == torch.int32 and not counters.any()
    first, second = split_k.split_counters(x.device, 5), split_k.split_counters(x.device, 5)
    assert second.data_ptr() == first.data_ptr() + 5 * 4   # the next launch takes the next counters
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.delitem(split_k._COUNTERS, torch.device("cuda:0"), raising=False)
    assert split_k.split_counters(torch.device("cuda:0"), 3) is None   # none made inside a graph capture
    monkeypatch.setattr(split_k, "SPLIT_COUNTERS", 2)   # more output tiles than counters: the sum kernel
    assert torch.equal(run(), two_launches) and len(summed) == 1


def _experts_case(experts: int, rows: int, cols: int, n: int, m: int, dtype: torch.dtype, mapped: list[bool], seed: int):
    """``experts`` N:M matrices stacked as the export's experts load (values, words, maps with the identity
    where an expert has none) and the dense matrices, each in its map's column order."""
    from shuffleprune.kernels.nm_words import position_words

    g = torch.Generator().manual_seed(seed)
    dense, values, words, perms = [], [], [], []
    for e in range(experts):
        w, v, meta, *_ = _case(rows, cols, n, m, 1, dtype, seed=seed + e)
        dense.append(w)
        values.append(v)
        words.append(position_words(meta))
        perms.append(torch.randperm(cols, generator=g) if mapped[e] else torch.arange(cols))
    perm = torch.stack(perms).to(torch.int32) if any(mapped) else None
    return dense, torch.stack(values), torch.stack(words), perm, perms


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,n,m,tokens,top_k,block_t,split,use_dot,mapped", [
    (37, 96, 2, 4, 1, 2, None, None, False, [True, False, True, True]),   # decode: one pair per block, select loop
    (24, 160, 2, 4, 5, 2, 1, 3, False, [True] * 4),     # experts chosen twice: several blocks each, split-K
    (40, 64, 2, 4, 7, 3, 2, None, False, [False] * 4),  # two pairs per block, no maps
    (33, 128, 4, 8, 3, 2, None, 2, True, [True, True, False, False]),   # 4:8 on the tensor cores, split-K
    (29, 96, 2, 4, 9, 2, 16, None, True, [True] * 4),   # 2:4 tensor-core blocks (weight as the A operand)
    (20, 64, 1, 4, 6, 2, 4, 1, None, [False, True, False, True]),   # 1:4 (the generic expansion)
])
def test_grouped_experts_kernel_matches_float64(rows, cols, n, m, tokens, top_k, block_t, split, use_dot, mapped,
                                                dtype):
    """Every (token, slot) pair through its own expert's N:M matrix and map in one launch: the hidden state of
    the pair's token (``x_div = top_k``) and the pair's own row (``x_div = 1``, the second projection), ids
    past the last expert (expert-parallel sentinels) giving zero rows, against float64."""
    from shuffleprune.kernels.nm_experts import nm_experts

    experts = len(mapped)
    dense, values, words, perm, perms = _experts_case(experts, rows, cols, n, m, dtype, mapped, seed=rows + tokens)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts + 1, generator=g)[:top_k] for _ in range(tokens)])  # id E: dropped
    over = {"split": split, "block_k": 16} if split else {}
    if use_dot is not None:
        over["use_dot"] = use_dot
    for x_div, x in ((top_k, torch.randn(tokens, cols, generator=g)), (1, torch.randn(tokens * top_k, cols, generator=g))):
        x = x.to(dtype)
        y, routes = nm_experts(x, values, words, n, m, meta_bits(m), ids, x_div, perm, block_t=block_t, **over)
        again, reused = nm_experts(x, values, words, n, m, meta_bits(m), ids, x_div, perm, block_t=block_t,
                                   routes=routes, **over)
        assert reused is routes and torch.equal(again, y)   # a second projection reuses the grouping
        if perm is not None:   # the maps read by the kernel itself: the same sums of the same products
            in_kernel, _ = nm_experts(x, values, words, n, m, meta_bits(m), ids, x_div, perm, block_t=block_t,
                                      gather_first=False, **over)
            assert torch.equal(in_kernel, y)
        ref = torch.zeros(tokens * top_k, rows, dtype=torch.float64)
        for pair, e in enumerate(ids.reshape(-1).tolist()):
            if e < experts:
                ref[pair] = dense[e].double() @ x[pair // x_div].double()[perms[e]]
        assert y.shape == ref.shape and _close(y, ref, dtype), (x_div, (y.double() - ref).abs().max())
        assert not y[ids.reshape(-1) == experts].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_pairs_reads_each_pairs_input_through_its_experts_map(dtype):
    """``gather_pairs``: row ``p`` is input row ``p // x_div`` in expert ``ids[p]``'s map order, for both
    projections' ``x_div``, over more columns than one program's block; a pair routed to no local
    expert (id ``E``, a sentinel) still gets a row (any: the grouped kernel leaves its output zero)."""
    from shuffleprune.kernels.nm_experts import GATHER_BLOCK_C, gather_pairs

    g = torch.Generator().manual_seed(3)
    experts, cols = 3, GATHER_BLOCK_C + 40
    perm = torch.stack([torch.randperm(cols, generator=g) for _ in range(experts)]).to(torch.int32)
    ids = torch.tensor([[2, 0], [1, 3], [0, 2]])   # 3 tokens, top 2; id 3 is dropped
    for x_div, x in ((2, torch.randn(3, cols, generator=g)), (1, torch.randn(6, cols, generator=g))):
        x = x.to(dtype)
        got = gather_pairs(x, perm, ids, x_div)
        assert got.shape == (6, cols) and got.dtype == dtype
        for p, e in enumerate(ids.reshape(-1).tolist()):
            if e < experts:
                assert torch.equal(got[p], x[p // x_div][perm[e].long()]), (x_div, p)


@pytest.mark.parametrize("pairs,experts,block_t", [(1, 8, 1), (14, 4, 2), (40, 8, 16), (9, 64, 1), (30, 3, 4)])
def test_route_blocks_groups_each_experts_pairs_in_order_in_blocks_of_one_expert(pairs, experts, block_t):
    """route_blocks puts every local pair in exactly one slot, of a block of its own expert, in the pairs'
    order; dropped ids and padding fill the rest; the block count is the bound fixed by the shapes."""
    from shuffleprune.kernels.nm_experts import route_blocks

    ids = torch.randint(-1, experts + 1, (pairs,), generator=torch.Generator().manual_seed(pairs))
    slots, block_expert = route_blocks(ids, experts, block_t)
    assert block_expert.numel() == -(-pairs // block_t) + min(experts, pairs)
    assert slots.numel() == block_expert.numel() * block_t and slots.dtype == block_expert.dtype == torch.int32
    by_block = slots.view(-1, block_t)
    placed = []
    for b, e in enumerate(block_expert.tolist()):
        filled = [p for p in by_block[b].tolist() if p < pairs]
        if e < 0:
            assert not filled
        assert all(ids[p] == e for p in filled)
        placed += filled
    local = [p for p in range(pairs) if 0 <= ids[p] < experts]
    assert sorted(placed) == local and placed == sorted(local, key=lambda p: (int(ids[p]), p))


@pytest.mark.parametrize("shape,experts,block_t,dtype", [
    ((1,), 8, 1, torch.int64), ((7, 2), 4, 2, torch.int64), ((40,), 8, 16, torch.int32), ((9,), 64, 1, torch.int64),
    ((8, 8), 128, 1, torch.int64), ((30,), 3, 4, torch.int32), ((64,), 512, 16, torch.int64), ((32, 2), 6, 32, torch.int64)])
def test_route_blocks_kernel_groups_as_the_sort_does(shape, experts, block_t, dtype):
    """The one-launch grouping (up to 64 pairs: a decode step's) gives ``route_blocks``' sort-and-scatter
    answer exactly, dropped ids (−1, ≥ E) and empty blocks included, for any ids layout and dtype."""
    from shuffleprune.kernels.nm_experts import ROUTE_KERNEL_PAIRS, route_blocks

    g = torch.Generator().manual_seed(sum(shape) + experts)
    ids = torch.randint(-1, experts + 1, shape, generator=g).to(dtype)
    ids.view(-1)[: ids.numel() // 3] = ids.view(-1)[0]   # several pairs of one expert, more than a block's worth
    assert ids.numel() <= ROUTE_KERNEL_PAIRS
    slots, block_expert = route_blocks(ids, experts, block_t, kernel=True)
    ref_slots, ref_expert = route_blocks(ids, experts, block_t, kernel=False)
    assert slots.dtype == block_expert.dtype == torch.int32
    assert torch.equal(block_expert, ref_expert) and torch.equal(slots, ref_slots)
    strided = torch.stack([ids.reshape(-1), ids.reshape(-1) + 1], 1)[:, :1]   # a column: flattened, a strided view
    assert ids.numel() == 1 or not strided.reshape(-1).is_contiguous()
    assert all(torch.equal(a, b) for a, b in zip(route_blocks(strided, experts, block_t, kernel=True), (ref_slots, ref_expert)))


def test_sparse_experts_hold_one_stacked_copy_with_each_expert_a_view():
    """SparseExperts: each expert's SparseLinear reads views of the stacked buffers (no copy), its own map
    or none, gives that expert's product, and is made again over the new buffers after ``.to()``."""
    from shuffleprune.deploy.sparse_experts import SparseExperts

    dense, values, words, perm, perms = _experts_case(3, 24, 64, 2, 4, torch.float32, [True, False, True], seed=1)
    meta = words.view(torch.uint8).reshape(3, 24, -1)
    held = SparseExperts(values, meta, 64, 2, 4, perm, [True, False, True])
    assert len(held) == 3 and held[1].perm is None and torch.equal(held[2].perm, perm[2])
    assert held[1].values.data_ptr() == values[1].data_ptr() and held[1].meta.data_ptr() == meta[1].data_ptr()
    x = torch.randn(5, 64)
    for e in range(3):
        torch.testing.assert_close(held[e](x).double(), x.double()[:, perms[e]] @ dense[e].double().t(), rtol=1e-5,
                                   atol=1e-5)
    first = held[0]
    held.to(torch.float64)
    assert held[0] is not first and held[0].values.dtype == torch.float64
    assert held[0].values.data_ptr() == held.values.data_ptr()


@pytest.mark.parametrize("rows,cols,n,m", [(37, 96, 2, 4), (33, 136, 4, 8), (5, 24, 2, 4)])
def test_decompress_into_a_shared_buffer_is_exact(rows, cols, n, m):
    from shuffleprune.kernels.nm_gemm import nm_decompress_into
    from shuffleprune.kernels.nm_words import position_words

    w, values, meta, *_ = _case(rows, cols, n, m, 1, torch.bfloat16)
    buf = torch.full((rows * cols + 11,), 7.0, dtype=torch.bfloat16)   # stale contents must not leak through
    dense = nm_decompress_into(values, position_words(meta), n, m, meta_bits(m), cols, buf)
    assert torch.equal(dense, w) and dense.data_ptr() == buf.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols,n,m", [(37, 96, 2, 4), (33, 136, 4, 8), (5, 24, 2, 4), (20, 64, 1, 4), (3, 200, 2, 4)])
def test_mapped_decompress_writes_the_weight_in_the_inputs_original_order(rows, cols, n, m, dtype):
    """``nm_decompress_mapped_into`` writes ``W`` with ``W[:, perm[j]] = W_p[:, j]`` (so ``x @ Wᵀ`` is the
    mapped layer without gathering ``x``) over stale buffer contents, several rows per program and a
    last program with fewer (37 rows); a row too wide for its shared memory, or an inverse map of the
    wrong width, is refused."""
    from shuffleprune.kernels.nm_gemm import mapped_fits, nm_decompress_mapped_into
    from shuffleprune.kernels.nm_words import position_words

    w, values, meta, x, perm, _ = _case(rows, cols, n, m, 3, dtype)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(cols)
    buf = torch.full((rows * cols + 11,), 7.0, dtype=dtype)
    dense = nm_decompress_mapped_into(values, position_words(meta), n, m, meta_bits(m), cols, inverse.int(), buf)
    original = torch.empty_like(w)
    original[:, perm] = w
    assert torch.equal(dense, original) and dense.data_ptr() == buf.data_ptr()
    assert torch.allclose(x.double() @ dense.double().t(), x.double()[:, perm] @ w.double().t())
    with pytest.raises(ValueError, match="must be"):
        nm_decompress_mapped_into(values, position_words(meta), n, m, meta_bits(m), cols, inverse[1:].int(), buf)
    assert mapped_fits(16384, 2, 4, torch.bfloat16) and not mapped_fits(16385, 2, 4, torch.bfloat16)
    assert mapped_fits(8192, 2, 4, torch.float32) and not mapped_fits(8193, 2, 4, torch.float32)
    assert not mapped_fits(96, 3, 6, torch.float16)
    with pytest.raises(ValueError, match="gather the input"):
        nm_decompress_mapped_into(torch.zeros(1, 4098, dtype=torch.float32), torch.zeros(1, 257, dtype=torch.int32),
                                  2, 4, 2, 8196, torch.zeros(8196, dtype=torch.int32), torch.empty(8196))


def test_a_layers_inverse_map_is_made_once_per_map():
    """``SparseLinear.inverse_map`` inverts the index map, is kept, and is made again once ``perm`` is replaced."""
    _, values, meta, _, perm, _ = _case(8, 64, 2, 4, 1, torch.float16)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm)
    inv = layer.inverse_map()
    assert inv.dtype == torch.int32 and torch.equal(inv[perm], torch.arange(64, dtype=torch.int32))
    assert layer.inverse_map() is inv
    layer.perm = torch.randperm(64, generator=torch.Generator().manual_seed(3)).int()
    assert torch.equal(layer.inverse_map()[layer.perm.long()], torch.arange(64, dtype=torch.int32))


def test_kernel_plans_are_worked_out_once_per_shape_and_device_facts(monkeypatch):
    """The decode and GEMM plans the host needs at every launch are looked up after their first
    working-out (13–19 µs and 0.26–0.53 ms on a 2-core CPU, more than an H100's time for the layer):
    the same answer as working it out, a fresh dict each time for the decode's, and worked out anew
    when the device facts they read differ (SM count, shared memory per SM)."""
    from shuffleprune.kernels import decode_tiles, gpu, nm_gemm

    cuda = torch.device("cuda")
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    monkeypatch.setattr(gpu, "smem_per_sm", lambda device: 228 * 1024)
    monkeypatch.setattr(decode_tiles, "_PLANS", {})
    monkeypatch.setattr(nm_gemm, "_PLANS", {})
    worked = []
    plan_decode, plan_gemm = decode_tiles.plan_decode, nm_gemm.plan_gemm
    monkeypatch.setattr(decode_tiles, "plan_decode", lambda *a: worked.append("decode") or plan_decode(*a))
    monkeypatch.setattr(nm_gemm, "plan_gemm", lambda *a: worked.append("gemm") or plan_gemm(*a))
    for tokens in (1, 2, 16, 32, 64):
        first = decode_tiles.decode_plan(4096, 2048, tokens, 2, 4, 2, cuda)
        first["split"] = -1   # a caller's change stays its own
        assert decode_tiles.decode_plan(4096, 2048, tokens, 2, 4, 2, cuda) == plan_decode(4096, 2048, tokens, 2, 4, 2, cuda)
    for tokens in (17, 512, 2048):
        assert nm_gemm.gemm_plan(tokens, 4096, 4096, 2, 4, 2, cuda) == nm_gemm.gemm_plan(tokens, 4096, 4096, 2, 4, 2, cuda) \
            == plan_gemm(tokens, 4096, 4096, 2, 4, 2, cuda)
    assert worked == ["decode"] * 5 + ["gemm"] * 3
    monkeypatch.setattr(gpu, "sm_count", lambda device: 4)   # another device: planned for its SMs
    assert decode_tiles.decode_plan(4096, 2048, 16, 2, 4, 2, cuda) == plan_decode(4096, 2048, 16, 2, 4, 2, cuda)
    assert nm_gemm.gemm_plan(512, 1024, 4096, 2, 4, 2, cuda) == plan_gemm(512, 1024, 4096, 2, 4, 2, cuda)
    monkeypatch.setattr(gpu, "smem_per_sm", lambda device: 100 * 1024)
    assert decode_tiles.decode_plan(4096, 2048, 32, 2, 4, 2, cuda)["per_sm"] == 1   # one 32-token pipeline fits
    assert worked == ["decode"] * 5 + ["gemm"] * 3 + ["decode", "gemm", "decode"]


def _shared_memory_for(monkeypatch, stages: int) -> list[tuple[str, int]]:
    """Triton's interpreter refusing every kernel launched with a software pipeline deeper than ``stages``
    (its ``STAGES`` or ``num_stages``) as a GPU with less shared memory than Hopper's refuses it: Triton's
    ``OutOfResources`` at the launch, before any program runs. The list it returns fills with the
    refused launches' (kernel, depth)."""
    from triton.runtime.errors import OutOfResources
    from triton.runtime.interpreter import InterpretedFunction

    refused: list[tuple[str, int]] = []
    run = InterpretedFunction.run

    def short_of_memory(self, *args, grid, warmup, **kwargs):
        depth = kwargs.get("STAGES", kwargs.get("num_stages"))
        if depth is not None and depth > stages:
            refused.append((self.fn.__name__, depth))
            raise OutOfResources(depth * 40_000, stages * 40_000, "shared memory")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", short_of_memory)
    return refused


def test_kernels_sized_for_hopper_run_with_a_shallower_pipeline_where_shared_memory_is_short(monkeypatch):
    """On a GPU that gives a program less shared memory than an H100 (Ada's 99 KB, an A100's 163 KB) a
    tile's pipeline sized on Hopper is refused at its first launch (``kernel_compile_sm89.json``: the
    tensor-core decodes, the grouped experts kernel and one GEMM tile). The decode, the grouped experts
    kernel and the GEMM then run with one stage fewer at a time until the kernel fits, give the float64
    product, and keep that depth: a second call launches the fitting kernel at once. A kernel that does
    not fit with one stage, or any other error, is raised."""
    from triton.runtime.errors import OutOfResources

    from shuffleprune.kernels import gpu, nm_decode, nm_experts, nm_gemm
    from shuffleprune.kernels.nm_words import position_words

    monkeypatch.setattr(nm_decode, "_LAUNCHES", {})
    monkeypatch.setattr(gpu, "FITTED_STAGES", {})

    def fitted(kernel: str) -> list[int]:   # the depths kept for that kernel's kinds of launch
        return [depth for key, depth in gpu.FITTED_STAGES.items() if key[0] == kernel]

    refused = _shared_memory_for(monkeypatch, 2)
    w, values, meta, x, perm, bias = _case(40, 192, 2, 4, 16, torch.bfloat16, seed=3)
    words, ref = position_words(meta), x.double()[:, perm] @ w.double().t() + bias.double()
    for call in range(2):   # the tensor-core decode (4 stages on Hopper): 4 and 3 refused, once
        y = nm_decode.nm_decode(x, values, words, 2, 4, meta_bits(4), perm.to(torch.int32), bias)
        assert _close(y, ref, torch.bfloat16)
        assert refused == [("_nm_decode_kernel", 4), ("_nm_decode_kernel", 3)]
    assert [launch.plain.kwargs["STAGES"] for launch in nm_decode._LAUNCHES.values()] == [2]

    refused.clear()
    y = nm_gemm.nm_gemm(x, values, words, 2, 4, meta_bits(4), bias, tile=(16, 32, 64, 4, 4))
    y2 = nm_gemm.nm_gemm(x, values, words, 2, 4, meta_bits(4), bias, tile=(16, 32, 64, 4, 4))
    xg = x.double()
    assert _close(y, xg @ w.double().t() + bias.double(), torch.bfloat16) and torch.equal(y, y2)
    assert refused == [("_nm_gemm_kernel", 4), ("_nm_gemm_kernel", 3)] and fitted("nm_gemm") == [2]

    refused.clear()
    dense, ev, ewords, eperm, perms = _experts_case(4, 29, 96, 2, 4, torch.bfloat16, [True] * 4, seed=5)
    ids = torch.tensor([[0, 2], [1, 3], [2, 0]])
    xe = torch.randn(3, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for call in range(2):
        ye, _ = nm_experts.nm_experts(xe, ev, ewords, 2, 4, meta_bits(4), ids, 2, eperm, block_t=16, use_dot=True)
        expected = torch.stack([dense[e].double() @ xe[pair // 2].double()[perms[e]]
                                for pair, e in enumerate(ids.reshape(-1).tolist())])
        assert _close(ye, expected, torch.bfloat16)
    assert [depth for name, depth in refused if name == "_nm_experts_kernel"] == [4, 3]
    assert fitted("nm_experts") == [2]

    _shared_memory_for(monkeypatch, 0)   # not even one stage fits: Triton's error, as before
    with pytest.raises(OutOfResources):
        nm_decode.nm_decode(x[:8], values, words, 2, 4, meta_bits(4), perm.to(torch.int32), bias)
    for error in (OutOfResources(1, 0, "threads"), RuntimeError("another failure")):
        def launch(stages: int, error=error):
            raise error
        with pytest.raises(type(error)):
            gpu.with_fewer_stages(launch, 4)


def test_a_decode_launch_is_worked_out_once_per_kind_of_call(monkeypatch):
    """``nm_decode`` works out its plan, grid and kernel arguments once per kind of call (shapes, dtypes,
    options, whether the input can be read as words) and looks them up after: a second layer of the same
    shape reuses them, another token count or an input that starts mid-word does not; every output is
    the float64 product."""
    from shuffleprune.kernels import nm_decode
    from shuffleprune.kernels.nm_words import position_words

    monkeypatch.setattr(nm_decode, "_LAUNCHES", {})
    worked = []
    work = nm_decode._decode_launch
    monkeypatch.setattr(nm_decode, "_decode_launch", lambda *a: worked.append(a[0].shape) or work(*a))
    layers = [_case(40, 192, 2, 4, 2, torch.bfloat16, seed=s) for s in (1, 2)]
    for tokens in (1, 1, 2):
        for w, values, meta, x, perm, bias in layers:
            x = x[:tokens]
            y = nm_decode.nm_decode(x, values, position_words(meta), 2, 4, meta_bits(4), perm.to(torch.int32), bias)
            assert _close(y, x.double()[:, perm] @ w.double().t() + bias.double(), torch.bfloat16)
    assert worked == [(1, 192), (2, 192)]
    w, values, meta, x, perm, bias = layers[0]
    odd = torch.empty(192 + 1, dtype=torch.bfloat16)[1:].view(1, 192)   # 2 bytes into a word: read element-wise
    odd.copy_(x[:1])
    y = nm_decode.nm_decode(odd, values, position_words(meta), 2, 4, meta_bits(4), perm.to(torch.int32), bias)
    assert _close(y, x[:1].double()[:, perm] @ w.double().t() + bias.double(), torch.bfloat16)
    assert worked == [(1, 192), (2, 192), (1, 192)]
    assert [launch.plain.kwargs["X_WORDS"] for launch in nm_decode._LAUNCHES.values()] == [True, True, False]
    launched = []

    class Stub:   # a kernel swapped in (as scripts/bench_host_overhead.py does): launched, not the kept one
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(grid)

    monkeypatch.setattr(nm_decode, "_nm_decode_kernel", Stub())
    nm_decode.nm_decode(x[:1], values, position_words(meta), 2, 4, meta_bits(4), perm.to(torch.int32), bias)
    assert len(launched) == 1


def test_gemm_plan_follows_tokens_rows_and_sm_count(monkeypatch):
    """The prefill tile and split-K come from the cost model over GEMM_TILES: long prompts take the
    256-token tile unsplit (the weight expanded once for more tokens), few tokens or rows smaller
    tiles and column splits that give every SM programs; N:M whose position words need wider steps
    and float32 get tiles that fit them."""
    from shuffleprune.kernels import gpu, nm_gemm

    cuda = torch.device("cuda")
    monkeypatch.setattr(gpu, "sm_count", lambda device: 132)
    big, *_, small = [t[0] for t in nm_gemm.GEMM_TILES[(2, 4)]]
    assert nm_gemm.gemm_plan(2048, 4096, 4096, 2, 4, 2, cuda) == (big, 1)
    assert nm_gemm.gemm_plan(64, 4096, 4096, 2, 4, 2, cuda)[0][0] <= 64
    tile, split = nm_gemm.gemm_plan(512, 1024, 4096, 2, 4, 2, cuda)   # 4 row tiles × 2 token tiles: too few
    assert tile[0] < big[0] and split > 1
    for n, m in ((1, 4), (4, 8), (2, 4)):
        block_c = nm_gemm.gemm_plan(512, 4096, 4096, n, m, meta_bits(m), cuda)[0][2]
        assert block_c * n // m % (32 // meta_bits(m)) == 0       # whole position words per step
    assert nm_gemm.gemm_plan(1, 8, 64, 1, 16, 4, cuda)[0][2] == 128   # 1:16: eight 4-bit fields need 128 columns
    assert nm_gemm.gemm_plan(2048, 4096, 4096, 2, 4, 2, cuda, element_bytes=4) == (nm_gemm.GEMM_TILE_FP32, 1)
    tall = [t[0] for t in nm_gemm.GEMM_TILES_SWAP_TALL[(2, 4)]]   # the weight-as-A GEMM on 128 weight rows per program
    assert nm_gemm.gemm_plan(2048, 4096, 4096, 2, 4, 2, cuda, weight_a=True, tall=True) == (tall[0], 1)
    assert nm_gemm.gemm_plan(64, 4096, 4096, 2, 4, 2, cuda, weight_a=True, tall=True)[0] == tall[-1]   # 64 tokens
    assert nm_gemm.gemm_plan(512, 4096, 4096, 4, 8, 4, cuda, weight_a=True, tall=True)[0] in \
        [t[0] for t in nm_gemm.GEMM_TILES_SWAP_TALL[(4, 8)]]
    loop, per_sm = nm_gemm.GEMM_TILES[(2, 4)][0][1:]
    full = nm_gemm.gemm_cycles(2048, 4096, 4096, big, loop, per_sm, 132)
    assert nm_gemm.gemm_cycles(4096, 4096, 4096, big, loop, per_sm, 132) == pytest.approx(2 * full, rel=0.05)
    assert nm_gemm.gemm_cycles(2048, 4096, 4096, big, loop, per_sm, 66) > 1.9 * full
    assert nm_gemm.gemm_cycles(2048, 4096, 4096, big, loop, 1, 132) > full  # no second program to overlap with
    assert nm_gemm.gemm_cycles(2048, 4096, 4096, big, loop, per_sm, 132, split=2) > full   # partial sums cost


def test_decode_split_reads_the_devices_shared_memory(monkeypatch):
    """Split-K is sized by the programs that reside per SM: the device's own shared memory (an
    A100's 164 KB holds one 32-token 2:4 pipeline, an H100's 228 KB two), the H100 figure when the
    device does not report it."""
    from types import SimpleNamespace

    from shuffleprune.kernels.decode_tiles import decode_plan

    cuda = torch.device("cuda")

    def plan(props):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
        return decode_plan(4096, 2048, 32, 2, 4, 2, cuda)

    a100 = plan(SimpleNamespace(multi_processor_count=108, shared_memory_per_multiprocessor=164 * 1024))
    h100 = plan(SimpleNamespace(multi_processor_count=108, shared_memory_per_multiprocessor=228 * 1024))
    unknown = plan(SimpleNamespace(multi_processor_count=108))
    assert (a100["per_sm"], h100["per_sm"], unknown["per_sm"]) == (1, 2, 2)


def test_device_facts_are_read_once_per_device_index(monkeypatch):
    """The SM count and shared memory every decode launch plans with are read from PyTorch once per
    device index (its lookup costs microseconds per call on the host); a device named without an index
    (whichever is current) is asked each time."""
    from types import SimpleNamespace

    from shuffleprune.kernels import gpu

    asked = []
    props = SimpleNamespace(multi_processor_count=132, shared_memory_per_multiprocessor=228 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: asked.append(device) or props)
    gpu._indexed_properties.cache_clear()
    try:
        for _ in range(3):
            assert gpu.sm_count(torch.device("cuda", 5)) == 132
            assert gpu.smem_per_sm(torch.device("cuda", 5)) == 228 * 1024
        assert asked == [5]
        gpu.sm_count(torch.device("cuda"))
        gpu.sm_count(torch.device("cuda"))
        assert len(asked) == 3
    finally:
        gpu._indexed_properties.cache_clear()


def test_position_words_are_the_export_bytes_read_four_at_a_time():
    from shuffleprune.kernels.nm_words import position_words

    _, values, meta, *_ = _case(6, 64, 2, 4, 1, torch.float32)        # 32 kept per row: 8 bytes, 2 words
    words = position_words(meta)
    assert words.dtype == torch.int32 and words.data_ptr() == meta.data_ptr()   # a view, no copy
    k = 21
    assert (int(words[3, k // 16]) >> (2 * (k % 16))) & 3 == (int(meta[3, k // 4]) >> (2 * (k % 4))) & 3
    _, values, meta, *_ = _case(6, 40, 2, 4, 1, torch.float32)        # 20 kept: 5 bytes, padded to 2 words
    assert position_words(meta).shape == (6, 2)


@pytest.mark.parametrize("policy,tokens", [(p, t) for p in IMPLS if p not in LIBRARY_IMPLS for t in (1, 9, 20, 70)
                                            if not (p.startswith("decode") and t > 64)
                                            and not (p == "decode_select" and t > 16)]   # decode: ≤ 64 tokens, select ≤ 16
                         + [("decode+pdl", 1), ("decode+pdl", 9), ("decode_swap+pdl", 20), ("decode_mapped+pdl", 9)])
def test_every_sparse_linear_policy_matches_float64(policy, tokens):
    w, values, meta, _, perm, bias = _case(24, 64, 2, 4, 1, torch.float16, seed=tokens)
    x = torch.randn(1, tokens, 64, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    lin = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias, policy=policy)
    ref = x.double()[..., perm] @ w.double().t() + bias.double()
    y = lin(x)
    assert y.shape == (1, tokens, 24) and _close(y, ref, torch.float16)


def test_no_tokens_give_an_empty_output_with_nothing_launched_or_measured(monkeypatch):
    """An empty input (an expert no token was routed to, an empty batch): every policy, ``auto``
    included, returns an empty ``[..., 0, R]`` output of the input's dtype without running an
    implementation or measuring one (before, the decode kernels failed to compile a tile of no
    tokens, and ``auto`` would have timed its candidates on nothing, under the bucket of two
    tokens); the decode kernel's own entry point returns one too."""
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.kernels.nm_words import position_words

    _, values, meta, _, perm, bias = _case(24, 64, 2, 4, 1, torch.float16)
    assert nm_decode(torch.randn(3, 0, 64).half(), values, position_words(meta), 2, 4, 2, perm.to(torch.int32),
                     bias).shape == (3, 0, 24)

    def refuse(*args):
        raise AssertionError("nothing runs or is measured on no tokens")

    monkeypatch.setattr(SparseLinear, "run", refuse)
    monkeypatch.setattr(auto_choice, "measure", refuse)
    for policy in ("auto", *(p for p in IMPLS if p not in LIBRARY_IMPLS)):
        lin = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias, policy=policy)
        for shape in ((0, 64), (2, 0, 64)):
            y = lin(torch.randn(*shape).half())
            assert y.shape == (*shape[:-1], 24) and y.dtype == torch.float16 and lin.choices == {}


@pytest.mark.parametrize("policy", ["auto", *(p for p in IMPLS if p not in LIBRARY_IMPLS)])
def test_an_input_of_another_width_is_refused_by_every_policy(policy):
    """As ``nn.Linear`` refuses it: before, the kernels read the first ``in_features`` columns of a wider
    input (and the gather its first ones through the map) and returned an output of the right shape."""
    _, values, meta, _, perm, bias = _case(24, 64, 2, 4, 1, torch.float16)
    lin = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias, policy=policy)
    for shape in ((3, 65), (0, 63), (65,)):
        with pytest.raises(ValueError, match="last dimension is 64"):
            lin(torch.randn(*shape).half())
    assert lin(torch.randn(64).half()).shape == (24,)   # one vector, as nn.Linear takes it


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (2, 2, 1500), (37, 7)])   # one token, ragged, two column
@pytest.mark.parametrize("kernel", ["gather_columns", "gather_rows"])                # blocks, rows past a program's end
def test_gather_kernels_are_index_select(kernel, shape, dtype):
    """Both Triton gathers (the many-program column kernel, and the row kernel that stages whole rows
    in shared memory, several rows per program) write exactly ``x[..., perm]``, also from a strided
    input and with or without a dependent launch; a map of the wrong width is refused."""
    from shuffleprune.kernels import gather

    gather_fn = getattr(gather, kernel)
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(*shape[:-1], 2 * shape[-1], generator=g).to(dtype)[..., ::2]   # every other column: strided
    perm = torch.randperm(shape[-1], generator=g).to(torch.int32)
    for pdl in (False, True):   # on the CPU pdl is an ordinary launch
        y = gather_fn(x, perm, pdl=pdl)
        assert y.shape == x.shape and y.is_contiguous() and torch.equal(y, x[..., perm.long()])
    with pytest.raises(ValueError, match="must be"):
        gather_fn(x, perm[:-1])


def test_gather_rows_takes_rows_that_fit_its_shared_memory_and_splits_tokens_over_programs():
    """The row gather stages at most 64 KiB per row (32768 16-bit columns, 16384 float32 ones, padded
    to a power of two) and refuses wider rows, naming the other gather; a program takes 1–8 rows,
    leaving about four programs per SM."""
    from shuffleprune.kernels.gather import gather_rows, rows_fit, rows_per_program

    assert rows_fit(32768, torch.bfloat16) and not rows_fit(32769, torch.bfloat16)
    assert rows_fit(16384, torch.float32) and not rows_fit(16385, torch.float32)
    with pytest.raises(ValueError, match="gather_columns"):
        gather_rows(torch.zeros(1, 16385), torch.zeros(16385, dtype=torch.int32))
    assert [rows_per_program(t, 132) for t in (1, 527, 528, 2048, 10**6)] == [1, 1, 1, 3, 8]


def test_prefetch_share_is_whole_lines_within_the_budget_and_the_row():
    """Each program of a dependent decode prefetches a power of two of whole 128-byte lines per row,
    all programs together at most ``PREFETCH_BYTES``, never past the row's kept values, and the
    position words of those values."""
    from shuffleprune.kernels.overlap import (LINE_BYTES, PREFETCH_BYTES, decode_prefetch_bytes, position_words_per_row,
                                              prefetch_per_row)

    for programs, block_r, row, elt in [(256, 16, 2048, 2), (132, 64, 7168, 2), (8, 16, 96, 2), (64, 64, 1024, 4)]:
        count = prefetch_per_row(programs, block_r, row, elt)
        assert count * elt % LINE_BYTES == 0 and count & (count - 1) == 0
        assert count <= row and programs * block_r * count * elt <= PREFETCH_BYTES
        assert 2 * count > min(row, PREFETCH_BYTES // (programs * block_r * elt))   # the largest such power
    assert prefetch_per_row(256, 16, 2048, 2) == 1024          # 8 MiB over 4096 rows of bf16: 2 KiB each
    assert prefetch_per_row(100_000, 64, 4096, 2) == 0         # less than a line each: nothing
    assert prefetch_per_row(256, 16, 2048, 2, decode_prefetch_bytes(2)) == 512   # a decode's 4 MiB
    assert prefetch_per_row(256, 16, 2048, 2, decode_prefetch_bytes(1)) == 0     # one token: none (timed fastest)
    # and the position words holding those values: 16 per word for 2:4, 8 for 4:8; the export's rows by whole
    # 128-byte lines (32 words at least), cuSPARSELt's order by words; none beside no values
    assert [position_words_per_row(kept, bits, tiled) for kept, bits, tiled in [
        (1024, 2, False), (256, 2, False), (256, 2, True), (1024, 4, True), (0, 2, False), (64, 3, False)]] == [
        64, 32, 16, 128, 0, 0]


def test_dependent_launch_is_off_the_gpu_and_where_the_environment_turns_it_off(monkeypatch):
    """Programmatic dependent launch needs a CUDA GPU of compute capability 9.0 on (never the CPU's
    interpreter) and stays off wherever ``SHUFFLEPRUNE_PDL=0``."""
    from shuffleprune.kernels import gpu, overlap

    x = torch.zeros(2)
    assert not gpu.pdl(x) and not overlap.enabled(x)
    monkeypatch.setattr(gpu, "pdl", lambda x: True)   # as on an H100
    assert overlap.enabled(x)
    monkeypatch.setenv("SHUFFLEPRUNE_PDL", "0")
    assert not overlap.enabled(x)
    assert overlap.launch_options(False) == {} and overlap.launch_options(True) == {"launch_pdl": True}


def test_auto_times_the_two_fastest_triton_kernels_again_as_dependent_launches(monkeypatch):
    """Where kernels can launch as programmatic dependents, the two fastest decode or GEMM kernels (and any
    other near the fastest candidate: the next test) are timed once more with ``+pdl`` (where the output
    agrees and a CUDA graph captures them), and the fastest of all candidates is kept, a plain launch on
    a tie; nothing of it off Hopper."""

    w, values, meta, x, perm, bias = _case(64, 64, 2, 4, 4, torch.float32)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias)
    ref = layer.reference(x)
    outputs, ran = {}, []

    def fake_run(self, impl, x):
        ran.append(impl)
        return outputs.get(impl, ref)

    def measure(graph: dict[str, float], how: str = "cuda_graph",
                candidates=("decode", "decode_swap", "decode_select", "scratch")) -> tuple[str, str]:
        monkeypatch.setattr(auto_choice, "cuda_graph_ms", lambda calls, reps, warm=2, outputs=None, **kw: (
            outputs.append(calls[0]()), graph[ran[-1]], how if ran[-1].endswith("+pdl") else "cuda_graph")[1:])
        ran.clear()
        return auto_choice.measure(layer, x, list(candidates))

    monkeypatch.setattr(SparseLinear, "run", fake_run)
    monkeypatch.setattr(auto_choice, "overlap_enabled", lambda x: True)
    plain = {"decode": 2.0, "decode_swap": 1.0, "decode_select": 3.0, "scratch": 4.0}
    assert measure({**plain, "decode_swap+pdl": 0.8, "decode+pdl": 0.9}) == ("decode_swap+pdl", "decode_swap+pdl")
    assert "decode_select+pdl" not in ran                                              # only the two fastest
    assert measure({**plain, "decode_swap+pdl": 0.8, "decode+pdl": 0.7})[0] == "decode+pdl"   # the order may change
    assert measure({**plain, "decode_swap+pdl": 1.0, "decode+pdl": 2.1})[0] == "decode_swap"  # a tie: plainly
    assert measure({**plain, "scratch": 0.5, "decode_swap+pdl": 0.8, "decode+pdl": 0.9})[0] == "scratch"
    assert measure({**plain, "decode_swap+pdl": 0.8, "decode+pdl": 0.9}, how="events")[0] == "decode_swap"
    outputs["decode_swap+pdl"] = ref * float("nan")                                      # wrong: not kept
    with pytest.warns(RuntimeWarning, match=r"decode_swap\+pdl is off by nan"):
        assert measure({**plain, "decode_swap+pdl": 0.8, "decode+pdl": 1.5})[0] == "decode_swap"
    outputs.clear()
    gemms = {"gemm": 1.5, "gemm_swap": 0.9, "decode": 2.0, "scratch": 4.0}   # the GEMMs too (17–64 tokens)
    assert measure({**gemms, "gemm_swap+pdl": 0.7, "gemm+pdl": 1.4}, candidates=gemms)[0] == "gemm_swap+pdl"
    assert {"gemm_swap+pdl", "gemm+pdl"} <= set(ran) and "decode+pdl" not in ran
    monkeypatch.setattr(auto_choice, "overlap_enabled", lambda x: False)
    assert measure({**plain})[0] == "decode_swap" and not any(i.endswith("+pdl") for i in ran)
    with pytest.raises(ValueError, match="may end in"):
        SparseLinear(values, meta, 64, 2, 4, policy="scratch+pdl")
    assert SparseLinear(values, meta, 64, 2, 4, policy="gemm_swap+pdl").policy == "gemm_swap+pdl"


@pytest.mark.parametrize("tiled", [False, True])
def test_auto_times_each_candidate_over_copies_of_the_weight_in_turn(monkeypatch, tiled):
    """``auto``'s graph timing runs its calls on the layer's weight and its copies in turn (so, on a GPU,
    no call finds its weight in L2): each copy is new memory with the same weight (the output is the
    reference's), in the layer's layout (cuSPARSELt's buffer too); afterwards the layer holds its own
    tensors again and no copy is kept."""

    w, values, meta, x, perm, bias = _case(64, 64, 2, 4, 2, torch.float16)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias)
    if tiled:
        assert layer.use_cslt_layout() and layer.tiled
    own = (layer.values, layer.meta)
    ref = layer.reference(x)
    copies = [layer._weight_copy() for _ in range(2)]
    monkeypatch.setattr(auto_choice, "weight_copies", lambda layer: [layer._own_weight(), *copies])
    ran, graphs = [], []
    original = SparseLinear.run

    def spy(self, impl, x):
        ran.append((self.values.data_ptr(), self.meta.data_ptr(), self.tiled and self._packed_buffer().data_ptr()))
        return original(self, impl, x)

    def graph_timer(calls, reps, warm=2, outputs=None, **kw):
        start = len(ran)
        outputs.extend(c() for c in calls)
        graphs.append(ran[start:])
        assert all(torch.allclose(y.float(), ref.float(), atol=2e-2) for y in outputs)
        return (1.0 if len(graphs) == 1 else 2.0), "cuda_graph"

    monkeypatch.setattr(SparseLinear, "run", spy)
    monkeypatch.setattr(auto_choice, "cuda_graph_ms", graph_timer)
    assert auto_choice.measure(layer, x, ["decode", "scratch"], calls=5) == ("decode", "decode")
    mine = (own[0].data_ptr(), own[1].data_ptr(), tiled and layer._packed.data_ptr())
    theirs = [(c[0].data_ptr(), c[1].data_ptr(), tiled and c[2].data_ptr()) for c in copies]
    assert len({mine, *theirs}) == 3 and all(mine[i] != t[i] for t in theirs for i in (0, 1))
    assert graphs == [[mine, *theirs, mine, theirs[0]]] * 2          # 5 calls over 3 weights, per candidate
    assert layer.values is own[0] and layer.meta is own[1]
    held = {id(t) for t in vars(layer).values() if isinstance(t, torch.Tensor)} | {id(t) for t in layer.buffers()}
    assert not held & {id(t) for c in copies for t in c if t is not None}   # no copy kept by the layer
    assert all(torch.equal(c[0], own[0]) and torch.equal(c[1], own[1]) for c in copies)


class _ThreadAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """The tensors PyTorch's operators allocate on the calling thread while active (a dispatch mode is
    the thread's own; an output sharing an input's storage, a view, allocates nothing): what PyTorch
    2.8 on routes into a CUDA graph pool while ``torch.compile(mode="reduce-overhead")`` warms up."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import weakref

        out = func(*args, **(kwargs or {}))
        given = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor)}
        self.made += [weakref.ref(t) for t in torch.utils._pytree.tree_leaves(out)
                      if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in given]
        return out

    def kept(self, *outputs: torch.Tensor) -> list[tuple]:
        """What was allocated here and is still alive, besides ``outputs``' storage."""
        import gc

        gc.collect()
        returned = {t.untyped_storage().data_ptr() for t in outputs}
        return [(tuple(t.shape), t.dtype) for ref in self.made
                if (t := ref()) is not None and t.untyped_storage().data_ptr() not in returned]


def test_what_layers_keep_from_their_first_call_is_not_allocated_by_the_calling_thread(monkeypatch):
    """The state a sparse layer builds at its first call and keeps — the shared scratch, a stacked
    group's weight, split-K's counters, what ``auto`` measures — is allocated through
    :func:`shuffleprune.runtime.graph_pools.outside_graph_pools`, off the calling thread: a compiled model's CUDA
    graphs (``mode="reduce-overhead"``) take every allocation of that thread into a pool that may hold
    only their outputs (on an H100 they refused 128 kept tensors). The CPU stands in for the CUDA
    warm-up here; the layers' outputs are unchanged and a later call allocates nothing it keeps."""
    from shuffleprune.runtime import graph_pools
    from shuffleprune.deploy import sparse_linear
    from shuffleprune.deploy.fused_inputs import FusedInputs
    from shuffleprune.kernels import split_k

    monkeypatch.setattr(graph_pools, "pool_may_route", lambda device: True)
    sparse_linear.release_scratch()
    auto_choice.release_choices()
    monkeypatch.setattr(split_k, "_COUNTERS", {})
    _, values, meta, x, perm, bias = _case(24, 64, 2, 4, 3, torch.float32)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias, policy="scratch")
    want = F.linear(x[:, perm], layer.dense_permuted(), bias)
    with _ThreadAllocations() as first:                 # the shared scratch is made and kept
        y = layer(x)
    assert torch.allclose(y, want, atol=1e-5) and first.kept(y) == []
    assert sparse_linear._SCRATCH                       # (it was made: by the worker thread)
    with _ThreadAllocations() as later:
        y = layer(x)
    assert later.kept(y) == []

    a = SparseLinear(values, meta, 64, 2, 4, perm=perm, policy="scratch")
    b = SparseLinear(values[:8].clone(), meta[:8].clone(), 64, 2, 4, perm=perm, policy="scratch")
    a.fused_inputs = b.fused_inputs = group = FusedInputs([a, b])
    with _ThreadAllocations() as stacking:              # the group's stacked weight is built and kept
        ya, yb = a(x), b(x)
    assert group.stacked is not None and stacking.kept(ya, yb) == []
    assert torch.allclose(ya, want - bias, atol=1e-5) and torch.allclose(yb, want[:, :8] - bias[:8], atol=1e-5)

    with _ThreadAllocations() as counting:              # split-K's arrival counters, made once per device
        counters = split_k.split_counters(torch.device("cpu"), 4)
    assert counters is not None and not counters.any() and counting.kept() == []

    kept_by_measuring = []

    def fake_measure(layer, x, candidates):              # auto measures once per kind of layer and keeps buffers
        kept_by_measuring.append(torch.zeros(5))
        return "scratch", "scratch"

    monkeypatch.setattr(auto_choice, "measure", fake_measure)
    auto = SparseLinear(values, meta, 64, 2, 4, perm=perm)
    with _ThreadAllocations() as measuring:
        assert auto._choice(x) == auto._choice(x) == "scratch"
    assert len(kept_by_measuring) == 1 and measuring.kept() == []


def test_outside_graph_pools_runs_elsewhere_only_where_a_pool_may_take_allocations(monkeypatch):
    """On the CPU (and in a capture) the function is simply called; where a CUDA graph pool may take
    the thread's allocations it runs on a thread of its own with the caller's grad and inference
    modes, returns its value and raises its error."""
    import threading

    from shuffleprune.runtime import graph_pools

    def where() -> tuple:
        return threading.get_ident(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    here = threading.get_ident()
    assert graph_pools.outside_graph_pools(where, torch.zeros(1)) == (here, True, False)
    routes = graph_pools.pool_may_route
    monkeypatch.setattr(graph_pools, "pool_may_route", lambda device: True)
    # its own thread is in no pool, so a call nested in it (the scratch grown while auto measures) runs in place
    assert graph_pools.outside_graph_pools(lambda: routes(torch.device("cuda")), torch.zeros(1)) is False
    with torch.no_grad():
        ident, grad, inference = graph_pools.outside_graph_pools(where, torch.device("cpu"))
    assert ident != here and not grad and not inference
    with torch.inference_mode():
        assert graph_pools.outside_graph_pools(where, torch.zeros(1))[1:] == (False, True)
    with pytest.raises(ValueError, match="from the worker"):
        graph_pools.outside_graph_pools(lambda: (_ for _ in ()).throw(ValueError("from the worker")), torch.zeros(1))


def test_loop_shared_bytes_counts_what_a_warp_moves_through_shared_memory():
    """Per warp and iteration: 32 threads × each load's or store's width (``LDSM``'s 8×8 matrices 4
    bytes each per thread, an asynchronous copy's write), a quarter of each warpgroup MMA's shared
    operands (B alone where A is in registers); the never-true ``@!PT`` placeholders count nothing.
    The shared ceiling is the weight rate at which that traffic fills an SM's 128 bytes per cycle."""
    from shuffleprune.kernels.compile_check import H100, loop_shared_bytes, shared_ceiling_tbs

    loop = ["LDS R104, [R22+0x16000]", "LDS.128 R92, [R20]", "STS.128 [R144+UR7+0x14000], R8",
            "LDSM.16.M88.4 R8, [R146+UR7+0x14000]", "@!PT LDS RZ, [RZ]", "IMAD.MOV.U32 R1, RZ, RZ, R2",
            "HGMMA.64x16x16.F32.BF16 R24, R68, gdesc[UR20], R24", "HGMMA.64x64x16.F32.BF16 R56, gdesc[UR4], R56, gsb0",
            "LDGSTS.E.BYPASS.128 [R15], desc[UR4][R8.64], P6", "LDGSTS.E [R158+UR4+0x16000], desc[UR5][R8.64], P6",
            "@P0 LDS.U8 R1, [R2]", "LDSM.16.MT88.2 R4, [R6]"]
    assert loop_shared_bytes(loop) == (128 + 512 + 512 + 512 + 16 * 16 * 2 // 4 + (64 * 16 + 64 * 16) * 2 // 4
                                       + 512 + 128 + 32 + 256)
    assert loop_shared_bytes(["IMAD R1, R2, R3, R4", "BRA `(.L_x_1)"]) == 0
    assert shared_ceiling_tbs(18432, 0, 4) is None
    # 18 KB of weight per iteration, 4 warps moving 8 KB each: 128 B/cycle × 18/32 × 1.755 GHz × 132 SMs
    assert shared_ceiling_tbs(18432, 8192, 4, H100) == pytest.approx(128 * 18432 / 32768 * 1.755e9 * 132 / 1e12)


def test_ptxas_report_reads_registers_and_spills_stored_and_loaded():
    """ptxas's report as ``ptxas -v`` or NVRTC's log gives it: registers, and spill bytes stored plus loaded; no
    registers where the text holds no report (a failed compile's log)."""
    from shuffleprune.kernels.compile_check import ptxas_report

    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
           "ptxas         .     8 bytes stack frame, 16 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 96 registers, used 1 barriers, 2052 bytes smem\n")
    assert ptxas_report(log) == (96, 28)
    assert ptxas_report(log.replace("16 bytes spill stores, 12", "0 bytes spill stores, 0")) == (96, 0)
    assert ptxas_report("kernel.cu(3): error: identifier undefined") == (None, 0)


def test_main_loop_is_the_longest_loop_body_or_the_longest_holding_an_instruction():
    """The longest span from a label to a backward branch to it, with no exit inside; asked for one holding
    ``HMMA.SP``, the MMAs' loop even where an epilogue's loop is longer (the prompt GEMM's split-K sum)."""
    from shuffleprune.kernels.compile_check import main_loop

    def ins(i: int, text: str) -> str:
        return f"        /*{16 * i:04x}*/                   {text} ;"

    body = [".L_x_1:", ins(0, "LDSM.16.M88.4 R8, [R2]"), ins(1, "HMMA.SP.16832.F32.BF16 R4, R8, R12, R4, R3, 0x0"),
            ins(2, "@P0 BRA `(.L_x_1)"), ".L_x_2:"]
    body += [ins(3 + k, "LDG.E.128 R4, desc[UR4][R2.64]") for k in range(4)]
    body += [ins(7, "BRA `(.L_x_2)"), ins(8, "EXIT")]
    sass = "\n".join(body)
    assert len(main_loop(sass)) == 5 and "HMMA" not in " ".join(main_loop(sass))
    mma = main_loop(sass, holding="HMMA.SP")
    assert len(mma) == 3 and mma[1].startswith("HMMA.SP")
    assert main_loop(sass, holding="HGMMA") == []


def test_timing_copies_exceed_the_l2_within_free_memory():
    """How many weights ``auto`` cycles through: enough to pass 2.5× the L2 together, at most 64, one
    where the weight alone passes it or the copies would not leave 256 MiB free."""
    from shuffleprune.deploy.auto_choice import timing_copies

    mib, free = 2**20, 80 * 2**30
    assert timing_copies(9 * mib, 50 * mib, free) == 14          # a 4096×4096 2:4 bf16 weight on an H100
    assert timing_copies(125 * mib, 50 * mib, free) == 1          # alone beyond 2.5× the L2
    assert timing_copies(2**10, 50 * mib, free) == 64
    assert timing_copies(9 * mib, 50 * mib, 13 * 9 * mib + 2**28) == 14
    assert timing_copies(9 * mib, 50 * mib, 13 * 9 * mib + 2**28 - 1) == 1


def test_auto_measures_each_kind_of_layer_once_per_token_bucket(monkeypatch):
    """``auto``'s timed choice is shared by layers of the same shape, pattern, map span and bias: the
    second q-like layer reuses the first's, another shape or a layer without a map measures anew,
    and so does a new token bucket, and a map of another span (one within blocks of 16 columns, as
    prune's within 64, reads the input nearly in order; one over all columns jumps): before, every
    map shared the choice measured on the first."""
    from shuffleprune.perm.core import random_block_perm

    auto_choice.release_choices()
    measured = []

    def fake_measure(layer, x, candidates):
        measured.append((layer.out_features, layer.perm is not None, x.shape[-2]))
        return candidates[0], candidates[0]

    _, values, meta, _, perm, _ = _case(24, 64, 2, 4, 1, torch.float16)
    assert SparseLinear(values, meta, 64, 2, 4, perm=perm).map_span == 64   # a random map over all 64 columns
    monkeypatch.setattr(auto_choice, "measure", fake_measure)
    x1 = torch.randn(1, 1, 64).half()
    gen = torch.Generator().manual_seed(3)
    block_a, block_b = (SparseLinear(values, meta, 64, 2, 4, perm=random_block_perm(64, 16, gen)) for _ in range(2))
    assert block_a.map_span == block_b.map_span == 16
    block_a._choice(x1), block_b._choice(x1), SparseLinear(values, meta, 64, 2, 4, perm=perm)._choice(x1)
    assert measured == [(24, True, 1), (24, True, 1)]   # the two block maps share one measurement
    auto_choice.release_choices()
    measured.clear()

    _, values2, meta2, *_ = _case(40, 64, 2, 4, 1, torch.float16)
    q, k = (SparseLinear(values, meta, 64, 2, 4, perm=perm) for _ in range(2))
    other, unmapped = SparseLinear(values2, meta2, 64, 2, 4, perm=perm), SparseLinear(values, meta, 64, 2, 4)
    x5 = torch.randn(1, 5, 64).half()
    assert q._choice(x1) == k._choice(x1) == q.choices[1] == k.choices[1]
    other._choice(x1), unmapped._choice(x1), q._choice(x5), k._choice(x5)
    assert measured == [(24, True, 1), (40, True, 1), (24, False, 1), (24, True, 5)]
    auto_choice.release_choices()
    SparseLinear(values, meta, 64, 2, 4, perm=perm)._choice(x1)
    assert measured[-1] == (24, True, 1) and len(measured) == 5


def test_a_device_maps_span_is_read_at_the_first_call_outside_a_capture(monkeypatch):
    """A layer built with its map on a device (here the meta device stands in) does not read the map
    while it is built, nor inside a CUDA graph capture (a read synchronizes, which a capture refuses):
    it reads it once, at the first call outside one. Built with a host map, it reads it at once."""
    from shuffleprune.deploy import sparse_linear

    reads = []

    def fake_span(perm):
        reads.append(perm.device.type)
        return 64

    monkeypatch.setattr(sparse_linear, "map_span", fake_span)
    _, values, meta, _, perm, _ = _case(24, 64, 2, 4, 1, torch.float16)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm.to("meta"))
    monkeypatch.setattr(sparse_linear, "capturing", lambda x: True)
    assert layer.map_span is None and reads == []
    monkeypatch.setattr(sparse_linear, "capturing", lambda x: False)
    assert layer.map_span == layer.map_span == 64 and reads == ["meta"]
    assert SparseLinear(values, meta, 64, 2, 4, perm=perm).map_span == 64 and reads == ["meta", "cpu"]
    assert SparseLinear(values, meta, 64, 2, 4).map_span is None and len(reads) == 2
    monkeypatch.undo()
    # a map assigned anew is read anew (decode_offsets relies on its span); .to() keeps the same map's
    from shuffleprune.perm.core import random_block_perm

    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm)
    assert layer.map_span == 64
    layer.perm = random_block_perm(64, 16, torch.Generator().manual_seed(1)).to(torch.int32)
    assert layer.map_span == 16 and layer.to(torch.float16).map_span == 16
    layer.perm = None
    assert layer.map_span is None


def test_block_offsets_are_made_only_for_maps_within_small_blocks_and_auto_no_longer_weighs_them():
    """``decode_offsets`` (the map read as 1-byte offsets) applies to a map within aligned blocks of at
    most 256 columns, not to a map over 512 columns nor a layer without a map; its offsets are made
    once per map. ``auto`` no longer weighs it, nor ``decode_tall`` (``NOT_WEIGHED``: never picked on
    the H100), though both still run when named."""
    from shuffleprune.deploy.impls import NOT_WEIGHED
    from shuffleprune.perm.core import random_block_perm

    gen = torch.Generator().manual_seed(5)
    _, values, meta, *_ = _case(24, 512, 2, 4, 1, torch.float16)
    block = SparseLinear(values, meta, 512, 2, 4, perm=random_block_perm(512, 64, gen))
    wide = SparseLinear(values, meta, 512, 2, 4, perm=torch.randperm(512, generator=gen))
    plain = SparseLinear(values, meta, 512, 2, 4)
    one, many = torch.randn(1, 512).half(), torch.randn(17, 512).half()
    assert impl_rules.offsets_apply(block) and not impl_rules.offsets_apply(wide) and not impl_rules.offsets_apply(plain)
    for layer in (block, wide, plain):
        assert not set(NOT_WEIGHED) & set(layer.candidates(one) + layer.candidates(many))
    assert "decode_mapped_tall" in block.candidates(one)   # the 32-row tile reading the map stays weighed
    assert set(NOT_WEIGHED) <= set(IMPLS)   # policies still: each runs against the reference in the IMPLS test above
    assert wide.block_map() is None and plain.block_map() is None
    offsets, span = block.block_map()
    assert span == 64 and offsets.dtype == torch.uint8 and block.block_map()[0] is offsets
    assert torch.equal(torch.arange(512) // 64 * 64 + offsets.long(), block.perm.long())
    block.perm = random_block_perm(512, 64, gen).to(torch.int32)
    assert block.block_map()[0] is not offsets


def test_a_graph_choice_unlike_the_eager_one_runs_once_on_the_calling_thread(monkeypatch):
    """``auto`` measures on a thread of its own, and a library's handle is per thread (PyTorch's
    cuSPARSELt handle is thread-local): where a layer takes a CUDA-graph choice that differs from its
    eager one, it runs that choice once on the calling thread, outside the group's shared gather, so a
    later capture makes nothing (on an H100 a prompt whose capture ran cuSPARSELt first could not be
    captured). Where both choices agree, or the bucket is known, nothing extra runs."""
    import threading

    from shuffleprune.deploy.shared_input import SharedGather

    auto_choice.release_choices()
    answer = {"choices": ("gemm", "scratch")}
    monkeypatch.setattr(auto_choice, "measure", lambda layer, x, candidates: answer["choices"])
    ran = []
    monkeypatch.setattr(SparseLinear, "run",
                        lambda self, impl, x: ran.append((impl, threading.get_ident(), self.shared_gather)))
    _, values, meta, _, perm, _ = _case(24, 64, 2, 4, 1, torch.float16)
    layer, other = (SparseLinear(values, meta, 64, 2, 4, perm=perm) for _ in range(2))
    shared = SharedGather()
    layer.shared_gather, other.shared_gather = shared.join(), shared.join()
    x1, x5 = torch.randn(1, 1, 64).half(), torch.randn(1, 5, 64).half()
    assert layer._choice(x1) == "scratch" and layer.choices[1] == "gemm"
    assert ran == [("gemm", threading.get_ident(), None)] and layer.shared_gather is shared
    layer._choice(x1)
    assert len(ran) == 1                      # a known bucket runs nothing more
    assert other._choice(x1) == "scratch"     # the choice measured on the first layer, run once here too
    assert [impl for impl, *_ in ran] == ["gemm", "gemm"]
    answer["choices"] = ("decode", "decode")
    assert layer._choice(x5) == "decode" and len(ran) == 2
    auto_choice.release_choices()


def _fake_timers(monkeypatch, graph_ms: dict[str, float], eager: dict[str, float]) -> list[str]:
    """``SparseLinear`` on the CPU with its timers faked: each candidate's output is the reference,
    its CUDA-graph time ``graph_ms[impl]`` and its eager time ``eager[impl]``; returns the list the
    eagerly timed candidates are appended to."""
    ran, timed_eagerly = [], []

    def fake_run(self, impl, x):
        ran.append(impl)
        return self.reference(x)

    def graph_timer(calls, reps, warm=2, outputs=None, **kw):
        outputs.append(calls[0]())
        return graph_ms[ran[-1]], "cuda_graph"

    def eager_timer(calls, reps, warm=1):
        calls[0]()
        timed_eagerly.append(ran[-1])
        return eager[ran[-1]]

    monkeypatch.setattr(SparseLinear, "run", fake_run)
    monkeypatch.setattr(auto_choice, "cuda_graph_ms", graph_timer)
    monkeypatch.setattr(auto_choice, "eager_ms", eager_timer)
    return timed_eagerly


def test_auto_keeps_cslt_for_eager_calls_only_when_it_wins_eagerly_too(monkeypatch):
    """cuSPARSELt timed fastest in a CUDA graph serves graph captures; calls outside one run it only
    if it also beats the fastest other candidate eagerly (PyTorch 2.11 builds its plan on every call),
    else that other candidate. A graph winner not in ``EAGER_CHECKED`` serves both, timed once."""
    w, values, meta, x, perm, bias = _case(64, 64, 2, 4, 32, torch.float32)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias)
    graph = {"cslt": 1.0, "gemm": 3.0, "scratch": 2.0}
    eager = _fake_timers(monkeypatch, graph, {"cslt": 9.0, "gemm": 0.5, "scratch": 4.0})
    assert auto_choice.measure(layer, x, ["cslt", "gemm", "scratch"]) == ("cslt", "scratch")
    assert sorted(eager) == ["cslt", "scratch"]      # against the graph's runner-up only
    eager.clear()
    eager_ms = {"cslt": 3.0, "gemm": 0.5, "scratch": 4.0}
    eager = _fake_timers(monkeypatch, graph, eager_ms)
    assert auto_choice.measure(layer, x, ["cslt", "gemm", "scratch"]) == ("cslt", "cslt")   # a PyTorch with the plan cached
    eager = _fake_timers(monkeypatch, {"cslt": 5.0, "gemm": 3.0, "scratch": 2.0}, eager_ms)
    assert auto_choice.measure(layer, x, ["cslt", "gemm", "scratch"]) == ("scratch", "scratch") and eager == []


def test_auto_times_the_tma_decodes_eagerly_too_when_a_graph_picks_them(monkeypatch):
    """The TMA-fed decodes make their tensor descriptors per call (the launcher encodes them), so a
    graph's pick of one (plain or as a dependent) is timed eagerly against the fastest other candidate,
    and the faster of the two serves eager calls."""

    w, values, meta, x, perm, bias = _case(64, 256, 2, 4, 8, torch.bfloat16)
    layer = SparseLinear(values, meta, 256, 2, 4, perm=perm, bias=bias)
    graph = {"decode_swap_tma": 1.0, "decode_swap": 1.2, "decode_resident_tma": 0.9, "scratch": 3.0}
    eager = _fake_timers(monkeypatch, graph, {"decode_swap_tma": 5.0, "decode_swap": 2.0, "scratch": 4.0})
    assert auto_choice.measure(layer, x, ["decode_swap_tma", "decode_swap", "scratch"]) == ("decode_swap_tma", "decode_swap")
    assert sorted(eager) == ["decode_swap", "decode_swap_tma"]
    eager = _fake_timers(monkeypatch, graph, {"decode_swap_tma": 1.5, "decode_swap": 2.0})
    assert auto_choice.measure(layer, x, ["decode_swap_tma", "decode_swap"]) == ("decode_swap_tma", "decode_swap_tma")
    eager = _fake_timers(monkeypatch, graph, {"decode_resident_tma": 3.0, "decode_swap": 2.0})   # the TMA runner-up
    assert auto_choice.measure(layer, x, ["decode_resident_tma", "decode_swap_tma", "decode_swap"]) == (   # is not the rival
        "decode_resident_tma", "decode_swap")
    monkeypatch.setattr(auto_choice, "overlap_enabled", lambda x: True)   # a dependent launch's pick, by its kernel
    eager = _fake_timers(monkeypatch, {**graph, "decode_swap_tma+pdl": 0.8, "decode_swap+pdl": 1.1},
                         {"decode_swap_tma+pdl": 4.0, "decode_swap+pdl": 2.5})
    assert auto_choice.measure(layer, x, ["decode_swap_tma", "decode_swap"]) == ("decode_swap_tma+pdl", "decode_swap+pdl")


def test_auto_times_as_dependents_every_kernel_near_the_fastest_not_just_two(monkeypatch):
    """With dependent launches on, ``auto`` times again so the two fastest Triton kernels and any other
    within ``PDL_RETIME_WITHIN`` of the fastest candidate: the H100's 1024×4096 layer at 2 tokens
    (2026-11-27), where the gathered decode, 4th without it, won as a dependent (9.2 → 7.4 µs). One
    far slower is not timed again."""

    w, values, meta, x, perm, bias = _case(64, 64, 2, 4, 2, torch.float16)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias)
    graph = {"decode_mapped": 8.2, "decode_shallow": 9.1, "decode_swap": 9.15, "decode": 9.2, "gemm": 30.0,
             "scratch": 20.0, "decode_mapped+pdl": 8.4, "decode_shallow+pdl": 9.5, "decode_swap+pdl": 8.9,
             "decode+pdl": 7.4, "gemm+pdl": 1.0}
    _fake_timers(monkeypatch, graph, {})
    monkeypatch.setattr(auto_choice, "overlap_enabled", lambda x: True)
    assert auto_choice.measure(layer, x, ["decode_mapped", "decode_shallow", "decode_swap", "decode", "gemm", "scratch"]) == (
        "decode+pdl", "decode+pdl")
    assert auto_choice.pdl_retimed({k: v for k, v in graph.items() if "+" not in k}) == [
        "decode_mapped", "decode_shallow", "decode_swap", "decode"]   # gemm (3.7× the fastest) is not
    monkeypatch.setattr(auto_choice, "overlap_enabled", lambda x: False)
    assert auto_choice.measure(layer, x, ["decode_mapped", "decode", "scratch"]) == ("decode_mapped", "decode_mapped")


def test_auto_runs_the_graph_choice_in_a_capture_and_the_eager_one_outside(monkeypatch):
    """``_choice``: a measured bucket answers with the graph's pick inside a CUDA graph capture and
    the eager pick outside; an unmeasured bucket met first inside a capture takes the default without
    measuring; ``forget_choices`` (a new layout or input order) forgets both picks."""
    from shuffleprune.deploy import sparse_linear

    auto_choice.release_choices()
    measured = []

    def fake_measure(layer, x, candidates):
        measured.append(x.shape[-2])
        return "cslt", "scratch"

    in_capture, ran = [False], []
    monkeypatch.setattr(auto_choice, "measure", fake_measure)
    monkeypatch.setattr(SparseLinear, "run", lambda self, impl, x: ran.append(impl))
    monkeypatch.setattr(sparse_linear, "capturing", lambda x: in_capture[0])
    _, values, meta, _, perm, _ = _case(64, 64, 2, 4, 1, torch.float16)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm)
    x32, x5 = torch.randn(1, 32, 64).half(), torch.randn(1, 5, 64).half()
    assert layer._choice(x32) == "scratch" and measured == [32]
    assert ran == ["cslt"]   # the graph's pick run once outside the capture, where the layer took it
    in_capture[0] = True
    assert layer._choice(x32) == "cslt" and measured == [32]
    assert layer._choice(x5) == default_choice(layer.candidates(x5)) and measured == [32]   # not measured in a capture
    assert layer.choices == {32: "cslt"} and layer.eager_choices == {32: "scratch"}
    layer.forget_choices()
    assert layer.choices == {} and layer.eager_choices == {}
    auto_choice.release_choices()


def test_cslt_configuration_is_searched_once_per_kind_of_layer_and_never_in_a_capture(monkeypatch):
    """cuSPARSELt's searched configuration is shared by layers of one shape and token count (``auto``
    measures one layer of each kind; the others must not run unsearched in a CUDA graph); a count
    first met inside a capture runs cuSPARSELt's default there and is searched at its first eager call."""
    auto_choice.release_choices()
    searched, configs, in_capture = [], [], [False]

    def fake_search(packed, xt, bias):
        searched.append(xt.shape[1])
        return (3, 2, 1)

    def fake_mm(packed, xt, bias, alpha, out_dtype, transpose_result, *config):
        configs.append(config)
        return torch.zeros(xt.shape[1], packed.shape[0], dtype=xt.dtype)

    monkeypatch.setattr(auto_choice, "cslt_search", fake_search)
    monkeypatch.setattr(auto_choice, "capturing", lambda x: in_capture[0])
    monkeypatch.setattr(torch, "_cslt_sparse_mm", fake_mm)
    _, values, meta, *_ = _case(64, 64, 2, 4, 1, torch.bfloat16)
    layers = [SparseLinear(values, meta, 64, 2, 4) for _ in range(3)]
    assert all(layer.use_cslt_layout() for layer in layers)
    x32, x20 = torch.randn(32, 64).bfloat16(), torch.randn(20, 64).bfloat16()
    assert layers[0]._cslt(x32).shape == (32, 64)
    layers[1]._cslt(x32)
    assert searched == [32] and configs == [(3, 2, 1)] * 2
    in_capture[0] = True
    layers[2]._cslt(x32), layers[2]._cslt(x20)
    assert searched == [32] and configs[2:] == [(3, 2, 1), ()]   # the shared search; the default in a capture
    in_capture[0] = False
    assert layers[2]._cslt(x20).shape == (20, 64)
    assert searched == [32, 24] and configs[-1] == (3, 2, 1)   # 20 tokens reach cuSPARSELt padded to 24
    auto_choice.release_choices()
    layers[0]._cslt(x32)
    assert searched == [32, 24, 32]


def test_auto_skips_a_candidate_that_cannot_run_on_this_device(monkeypatch):
    """``auto`` keeps the fastest candidate that ran; one that raises what a GPU with less shared memory
    than an H100 raises (Triton's OutOfResources), a RuntimeError or a ValueError is skipped, not
    fatal; any other error (a bug) propagates."""
    from triton.runtime.errors import OutOfResources


    times = {"decode": OutOfResources(232448, 101376, "shared memory"), "decode_swap": 0.5, "scratch": 0.7,
             "gather": ValueError("does not fit")}

    def fake_timer(calls, reps, warm=2):
        impl = fake_timer.impl
        result = times[impl]
        if isinstance(result, Exception):
            raise result
        return result, "cuda_graph"

    def fake_run(self, impl, x):
        fake_timer.impl = impl
        return torch.ones(4, 24)

    monkeypatch.setattr(auto_choice, "cuda_graph_ms", lambda calls, reps, warm=2, outputs=None, **kw: (
        outputs.append(calls[0]()), fake_timer(calls, reps))[1])
    monkeypatch.setattr(SparseLinear, "run", fake_run)
    monkeypatch.setattr(SparseLinear, "reference", lambda self, x: torch.ones(4, 24))
    _, values, meta, _, perm, _ = _case(24, 64, 2, 4, 1, torch.float16)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm)
    x = torch.randn(4, 64).half()
    assert auto_choice.measure(layer, x, list(times)) == ("decode_swap", "decode_swap")   # graph and eager: no cslt to recheck
    times["decode_swap"] = RuntimeError("an unexpected bug")
    assert auto_choice.measure(layer, x, list(times)) == ("scratch", "scratch")   # RuntimeError: as before, a candidate that cannot run
    times["scratch"] = KeyError("a bug")
    with pytest.raises(KeyError):
        auto_choice.measure(layer, x, list(times))


def test_auto_stops_at_a_candidate_that_faults_the_gpu_and_leaves_out_those_named_to_skip(monkeypatch):
    """An error CUDA cannot recover from (an illegal address) is not a candidate to skip: every later call would
    fail with it, so ``auto`` stops with a ``DeviceFault`` naming the kernel and the variable that leaves it out;
    ``SHUFFLEPRUNE_SKIP_IMPLS`` takes it (and a ``+pdl`` launch alone) out of the candidates and the stored
    choices; a name that is no implementation is a one-line error."""
    from shuffleprune.deploy.impls import SKIP_ENV
    from shuffleprune.errors import UserError
    from shuffleprune.runtime.faults import DeviceFault, device_fault, raise_if_fault

    assert device_fault(RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors ..."))
    assert device_fault(RuntimeError("Triton Error [CUDA]: misaligned address"))
    assert not device_fault(RuntimeError("out of resource: shared memory, Required: 232448, Hardware limit: 101376"))
    inner = DeviceFault("the rows gather of 64 columns failed on this GPU with an error that ends the process (...)")
    with pytest.raises(DeviceFault) as passed:   # raised inside a candidate's call: it goes on as it was
        raise_if_fault(inner, "SparseLinear 24x64: decode on 4 tokens", "leave it out")
    assert passed.value is inner
    faults = {"decode": RuntimeError("CUDA error: an illegal memory access was encountered"), "scratch": None}

    def fake_run(self, impl, x):
        if faults[impl] is not None:
            raise faults[impl]
        return torch.ones(4, 24)

    monkeypatch.setattr(SparseLinear, "run", fake_run)
    monkeypatch.setattr(SparseLinear, "reference", lambda self, x: torch.ones(4, 24))
    monkeypatch.setattr(auto_choice, "cuda_graph_ms",
                        lambda calls, reps, warm=2, outputs=None, **kw: (outputs.append(calls[0]()), (0.5, "cuda_graph"))[1])
    _, values, meta, _, perm, _ = _case(24, 64, 2, 4, 1, torch.float16)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm)
    x = torch.randn(4, 64).half()
    with pytest.raises(DeviceFault, match=rf"24x64: decode on 4 tokens failed .*illegal memory access.*{SKIP_ENV}=decode"):
        auto_choice.measure(layer, x, ["decode", "scratch"])
    monkeypatch.setenv(SKIP_ENV, "decode, decode_swap_tma decode_swap+pdl")
    x1 = torch.randn(1, 64).half()
    left = layer.candidates(x1)
    assert "decode" not in left and "decode_shallow" in left   # the named one out, the others kept
    assert "decode_swap" in layer.candidates(torch.randn(5, 64).half())   # only its +pdl launch is left out
    assert not auto_choice.stored_applies(["decode_swap+pdl", "decode_swap"], ["decode_swap"])
    assert auto_choice.stored_applies(["decode_swap", "decode_swap"], ["decode_swap"])
    timed = {}
    auto_choice.time_pdl(layer, x, None, "decode_swap", timed, [], 1, 1)   # left out: not even run
    assert timed == {}
    monkeypatch.setenv(SKIP_ENV, "decode,no_such_kernel")
    with pytest.raises(UserError, match="'no_such_kernel', which is no implementation"):
        layer.candidates(x1)


def _bench_kernel_script(monkeypatch):
    """``scripts/bench_kernel.py`` loaded as a module (``scripts/`` on the path for its own imports)."""
    import importlib.util
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    monkeypatch.syspath_prepend(str(scripts))
    spec = importlib.util.spec_from_file_location("bench_kernel_under_test", scripts / "bench_kernel.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _gpu_that_never_finishes(monkeypatch) -> None:
    """CUDA events whose work never finishes, and a hang limit of 0.05 s (``runtime.faults.finish_or_fault``)."""
    from shuffleprune.runtime import faults

    class Event:
        def record(self, stream=None):
            pass

        def query(self):
            return False

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(faults, "HANG_LIMIT_S", 0.05)


def test_bench_kernels_warm_pass_runs_again_without_a_kernel_that_faulted_and_leaves_it_out_after(monkeypatch):
    """A warm process of ``scripts/bench_kernel.py`` that ends at a ``DeviceFault`` is run again with the kernel it
    names left out, the processes after it leave it out from the start, and so does the timed run (its
    environment), so one faulting kernel costs neither the compile pass nor the table."""
    import argparse
    import os
    import subprocess
    import types

    from shuffleprune.deploy.impls import SKIP_ENV, advised_skip
    from shuffleprune.runtime.faults import DeviceFault, raise_if_fault

    bench = _bench_kernel_script(monkeypatch)
    with pytest.raises(DeviceFault) as fault:
        raise_if_fault(RuntimeError("CUDA error: an illegal memory access was encountered"),
                       "decode_swap_tma (64x64, 16 tokens)", f"leave it out with {SKIP_ENV}=decode_swap_tma")
    assert advised_skip(f"Traceback ...\nshuffleprune.runtime.faults.DeviceFault: {fault.value}\n") == "decode_swap_tma"
    assert advised_skip("RuntimeError: out of resource: shared memory") is None
    skips = []

    def fake_run(cmd, stdout=None, stderr=None, text=None, env=None):
        skips.append(env[SKIP_ENV])
        if "decode_swap_tma" in env[SKIP_ENV]:
            return types.SimpleNamespace(returncode=0, stderr="")
        return types.SimpleNamespace(returncode=1,
                                     stderr=f"Traceback ...\nshuffleprune.runtime.faults.DeviceFault: {fault.value}\n")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setenv(SKIP_ENV, "")   # (set, not deleted: the run's own setting is then undone after the test)
    args = argparse.Namespace(smoke=True, tokens=[1, 16], shapes=["64x64"], impls=["auto"], warm_serving=False,
                              warm_jobs=1)
    bench.warm_in_parallel(args)   # two processes: tokens 1, then 16
    assert skips == ["", "decode_swap_tma", "decode_swap_tma"] and os.environ[SKIP_ENV] == "decode_swap_tma"


def test_bench_kernels_timed_run_keeps_its_rows_and_names_the_kernel_that_faulted(monkeypatch, tmp_path):
    """A ``DeviceFault`` in ``bench_kernel``'s timed run ends it, with the rows measured so far and the kernel
    it names in the file's ``skipped_impls``, which ``gpu_run.sh`` leaves out of the steps after."""
    import json
    import sys

    from shuffleprune.deploy.impls import SKIP_ENV
    from shuffleprune.runtime.faults import DeviceFault

    bench = _bench_kernel_script(monkeypatch)
    run = SparseLinear.run

    def faulting(self, impl, x):
        if impl == "decode_swap" and x.shape[0] == 5:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return run(self, impl, x)

    monkeypatch.setattr(SparseLinear, "run", faulting)
    monkeypatch.setenv(SKIP_ENV, "")
    monkeypatch.setenv("SHUFFLEPRUNE_AUTO_STORE", "0")   # main() sets it so: undone after the test
    monkeypatch.setattr(sys, "argv", ["bench_kernel.py", "--smoke", "--impls", "decode", "decode_swap", "--tokens", "1", "5",
                                      "--out", str(tmp_path / "bench_kernel.json")])
    with pytest.raises(DeviceFault, match="decode_swap .48x64, 5 tokens. failed"):
        bench.main()
    written = json.loads((tmp_path / "bench_kernel_smoke.json").read_text())
    assert written["skipped_impls"] == ["decode_swap"] and not written["complete"]
    assert {(r["tokens"], r["impl"]) for r in written["rows"]} >= {(1, "decode"), (1, "dense"), (5, "decode")}


def test_auto_ends_with_a_device_fault_naming_a_candidate_that_never_finishes(monkeypatch):
    """A candidate whose kernel is still running on the GPU long after its launch (a wrong barrier or loop never
    returns) stops ``auto`` with a ``DeviceFault`` naming it and how to leave it out, instead of hanging the process
    at the output check; one that finishes within the limit is checked and timed as before."""
    from types import SimpleNamespace

    from shuffleprune.runtime.faults import DeviceFault

    w, values, meta, x, perm, bias = _case(24, 64, 2, 4, 3, torch.float32)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias)
    on_gpu = SimpleNamespace(is_cuda=True)   # an output its kernels are still writing

    _gpu_that_never_finishes(monkeypatch)
    monkeypatch.setattr(SparseLinear, "run", lambda self, impl, x: on_gpu if impl == "decode_swap" else self.reference(x))
    monkeypatch.setattr(auto_choice, "cuda_graph_ms", lambda calls, reps, warm=2, outputs=None, **kw: (0.1, "cuda_graph"))
    with pytest.raises(DeviceFault, match=r"decode_swap on 3 tokens did not finish in 0.05 s.*"
                                          r"SHUFFLEPRUNE_SKIP_IMPLS=decode_swap"):
        auto_choice.measure(layer, x, ["scratch", "decode_swap", "gather"])
    assert auto_choice.measure(layer, x, ["scratch", "gather"])[0] == "scratch"


def test_auto_drops_a_candidate_whose_replayed_output_disagrees_though_its_eager_call_agreed(monkeypatch):
    """In a CUDA graph consecutive calls may overlap (programmatic dependents sharing a split-K workspace): a
    kernel right in one eager call can be wrong as served. ``auto`` checks the outputs the timed replays left
    (``cuda_graph_ms(outputs=...)``) as well and drops such a candidate with a warning, the fastest or not."""
    w, values, meta, x, perm, bias = _case(24, 64, 2, 4, 3, torch.float32)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias)
    ref = layer.reference(x)
    ran = []
    monkeypatch.setattr(SparseLinear, "run", lambda self, impl, x: ran.append(impl) or ref)   # every eager call right
    speed = {"decode": 0.1, "decode_swap": 0.2, "scratch": 0.7}

    def replayed(calls, reps, warm=2, outputs=None, **kw):   # decode's last call as replayed: overwritten by the next one
        calls[-1]()
        outputs.extend([ref, ref * 2 if ran[-1] == "decode" else ref])
        return speed[ran[-1]], "cuda_graph"

    monkeypatch.setattr(auto_choice, "cuda_graph_ms", replayed)
    with pytest.warns(RuntimeWarning, match=r"decode is off by 1 of the output's scale as replayed in a CUDA graph"):
        assert auto_choice.measure(layer, x, ["decode", "decode_swap", "scratch"]) == ("decode_swap", "decode_swap")
    no_ref = auto_choice.graph_ms(layer, "scratch", x, layer.weight_copies(1), 3, 1, None)
    assert no_ref == (0.7, "cuda_graph", 0.0)   # no reference: no error asked


def test_auto_names_a_candidate_that_never_finishes_only_as_timed(monkeypatch):
    """A candidate whose checked call finished but whose timed graph never does (``cuda_graph_ms``'s bounded
    waits) ends ``auto`` with a DeviceFault naming it and the setting that leaves it out."""
    from shuffleprune.runtime.faults import DeviceFault

    w, values, meta, x, perm, bias = _case(24, 64, 2, 4, 3, torch.float32)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias)
    monkeypatch.setattr(SparseLinear, "run", lambda self, impl, x: self.reference(x))

    def timer(calls, reps, warm=2, outputs=None, what="", fix="", **kw):
        if "decode_swap" in what:
            raise DeviceFault(f"{what} did not finish in 30 s on this GPU; {fix}")
        outputs.append(calls[0]())
        return 0.5, "cuda_graph"

    monkeypatch.setattr(auto_choice, "cuda_graph_ms", timer)
    with pytest.raises(DeviceFault, match=r"24x64: decode_swap on 3 tokens did not finish.*"
                                          r"SHUFFLEPRUNE_SKIP_IMPLS=decode_swap"):
        auto_choice.measure(layer, x, ["scratch", "decode_swap"])


def test_the_graph_timer_keeps_the_last_two_calls_outputs_and_lets_the_others_go():
    import weakref

    from shuffleprune.runtime.timing import REPLAYED_KEPT, last_outputs

    made = []   # weak references: a capture's pool reuses an output's memory only once nothing holds it

    def call(i):
        y = torch.full((2,), float(i))
        made.append(weakref.ref(y))
        return y

    kept = last_outputs([lambda i=i: call(i) for i in range(5)])
    assert REPLAYED_KEPT == 2 and [int(y[0]) for y in kept] == [3, 4] and kept[1] is made[-1]()
    assert [ref() for ref in made[:3]] == [None] * 3
    assert [int(y[0]) for y in last_outputs([lambda: call(9)])] == [9]


def test_auto_drops_a_candidate_whose_output_disagrees_with_pytorch(monkeypatch):
    """Before timing, ``auto`` checks each candidate's output against PyTorch's own product of the
    decompressed weight: a kernel that is wrong on this device (here: its output perturbed, or NaN) is
    dropped with a warning even when it is the fastest, and the default falls back to the scratch."""

    w, values, meta, x, perm, bias = _case(24, 64, 2, 4, 3, torch.float32)
    layer = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias)
    ref = layer.reference(x)
    assert _close(ref, x.double()[:, perm] @ w.double().t() + bias.double(), torch.float32)
    outputs = {"decode": ref + 0.05 * ref.abs().max(), "decode_swap": ref * float("nan"), "gather": ref + 1e-3,
               "scratch": ref}
    speed = {"decode": 0.1, "decode_swap": 0.1, "gather": 0.5, "scratch": 0.7}
    monkeypatch.setattr(SparseLinear, "run", lambda self, impl, x: outputs[impl])
    monkeypatch.setattr(auto_choice, "cuda_graph_ms",
                        lambda calls, reps, warm=2, **kw: (speed[next(k for k, v in outputs.items() if v is calls[0]())],
                                                           "cuda_graph"))
    with pytest.warns(RuntimeWarning) as caught:
        assert auto_choice.measure(layer, x, list(outputs))[0] == "gather"   # within 16-bit rounding of the reference
    assert [re.search(r": (\w+ is off by \S+)", str(c.message)).group(1) for c in caught] == [
        "decode is off by 0.05", "decode_swap is off by nan"]
    with pytest.warns(RuntimeWarning) as caught:
        assert auto_choice.measure(layer, x, ["decode", "decode_swap"]) == ("scratch", "scratch")
    assert len(caught) == 2


def test_the_decode_policies_plan_the_select_tiles_they_name(monkeypatch):
    """At one token ``decode_shallow`` is ``decode`` planned with 3 pipeline stages instead of 4, the
    ``_tall`` policies with 32 rows per program and the ``_wide`` ones with 256 kept values per step
    instead of 16 and 128, on the gathered input or (``decode_mapped_…``) reading the map in the kernel;
    ``decode_mapped_by_value`` selects per kept value, not by group; all compute the same (the policy
    test above checks each against float64)."""
    from shuffleprune.deploy import sparse_linear
    from shuffleprune.kernels import nm_decode

    plans, plan, gathers = [], nm_decode.decode_plan, []
    monkeypatch.setattr(nm_decode, "decode_plan", lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1])
    gather = sparse_linear.gather_input
    monkeypatch.setattr(sparse_linear, "gather_input", lambda *a, **k: gathers.append(1) or gather(*a, **k))
    _, values, meta, _, perm, _ = _case(24, 64, 2, 4, 1, torch.float16)
    x = torch.randn(1, 64).half()
    policies = ("decode", "decode_shallow", "decode_tall", "decode_wide", "decode_mapped", "decode_mapped_tall",
                "decode_mapped_wide", "decode_mapped_by_value")
    for policy in policies:
        gathers.clear()
        SparseLinear(values, meta, 64, 2, 4, perm=perm, policy=policy)(x)
        assert bool(gathers) == (not policy.startswith("decode_mapped")), policy   # the map: gathered or in-kernel
    assert [(p["stages"], p["block_r"], p["block_k"], p["use_dot"], p["by_group"]) for p in plans] == [
        (4, 16, 128, False, True), (3, 16, 128, False, True), (4, 32, 128, False, True), (4, 16, 256, False, True),
        (4, 16, 128, False, True), (4, 32, 128, False, True), (4, 16, 256, False, True), (4, 16, 128, False, False)]


def test_auto_times_the_mapped_kernel_only_for_mapped_layers_and_defaults_to_decode():
    """Mapped layers weigh the gather-then-decode path against the kernel reading the map itself (to 16 tokens);
    at 1-2 tokens the select loop with its pipeline a tile shallower, from two tokens the select loop
    and the weight-as-A tensor-core decode (2:4 at 2-16 tokens also with half its step, on 32 rows, and
    expanded by broadcasts on either tile; the 64-row one to 64 tokens), from 17 both GEMMs,
    are weighed too; where nothing can be timed (a first call inside a graph capture), decode runs, else the scratch."""

    _, values, meta, _, perm, _ = _case(24, 64, 2, 4, 1, torch.float16)
    mapped, plain = SparseLinear(values, meta, 64, 2, 4, perm=perm), SparseLinear(values, meta, 64, 2, 4)
    x1, x20, x70 = (torch.randn(t, 64).half() for t in (1, 20, 70))
    # at one token the 256-value step on either input and the 32-row tile reading the map (the gathered input's
    # is not weighed: NOT_WEIGHED), at two the gathered input's 256-value step; not for 4:8 (its decode is the
    # tensor cores') nor float32 inputs
    assert mapped.candidates(x1) == ["decode", "decode_shallow", "decode_wide", "decode_mapped",
                                      "decode_mapped_tall", "decode_mapped_wide", "decode_mapped_by_value",
                                      "decode_resident", "scratch"]
    assert plain.candidates(x1) == ["decode", "decode_shallow", "decode_wide", "decode_resident", "scratch"]
    assert mapped.candidates(torch.randn(2, 64).half()) == [   # the select loop's two depths and the wide step
        "decode", "decode_shallow", "decode_wide", "decode_mapped", "decode_mapped_by_value", "decode_resident",
        "decode_swap", "decode_swap_narrow", "decode_swap_sync", "decode_swap_spread", "decode_swap_spread_sync",
        "scratch"]
    assert plain.candidates(x1.float())[:3] == ["decode", "decode_shallow", "scratch"]
    _, values48, meta48, _, perm48, _ = _case(24, 64, 4, 8, 1, torch.float16)
    assert SparseLinear(values48, meta48, 64, 4, 8, perm=perm48).candidates(x1) == [
        "decode", "decode_shallow", "decode_mapped", "scratch"]
    assert mapped.candidates(torch.randn(5, 64).half()) == ["decode", "decode_mapped", "decode_select",
                                                              "decode_swap", "decode_swap_narrow", "decode_swap_sync",
                                                              "decode_swap_spread", "decode_swap_spread_sync", "scratch"]
    assert SparseLinear(values48, meta48, 64, 4, 8, perm=perm48).candidates(torch.randn(5, 64).half()) == [
        "decode", "decode_mapped", "decode_select", "decode_swap", "scratch"]   # decode_swap's other tiles: 2:4's
    assert not set(SWAP_TILES) & set(mapped.candidates(torch.randn(5, 64)))   # 16-bit
    assert mapped.candidates(x20) == ["decode", "decode_swap", "decode_swap_spread", "gemm", "gemm_swap",
                                       "gemm_swap_tall",   # map in-kernel: ≤ 16
                                       "scratch", "scratch_mapped"]   # from 17 tokens, the map into the scratch instead of a gather
    assert mapped.candidates(x70) == ["gemm", "gemm_swap", "gemm_swap_tall", "scratch", "scratch_mapped"]
    assert plain.candidates(x70) == ["gemm", "gemm_swap", "gemm_swap_tall", "scratch"]
    assert "gemm_swap_tall" not in plain.candidates(torch.randn(16, 64).half())   # the GEMMs from 17 tokens
    assert "gemm_swap_tall" not in plain.candidates(x70.float())   # float32: the one FMA tile, as gemm_swap's
    wide = SparseLinear(*_case(8, 16392, 2, 4, 1, torch.float16)[1:3], 16392, 2, 4, perm=torch.randperm(16392))
    assert "scratch_mapped" not in wide.candidates(torch.randn(20, 16392).half())   # a row past its shared memory
    assert plain.candidates(torch.randn(5, 64).float())[:2] == ["decode", "decode_select"]   # float32: up to 16
    assert "decode_swap" not in plain.candidates(torch.randn(20, 64).float())
    assert default_choice(mapped.candidates(x1)) == "decode"
    assert default_choice(mapped.candidates(x70)) == "scratch"
    # the first kernel is weighed only where no decode applies (a pattern of M not a power of two)
    _, values36, meta36, _, _, _ = _case(24, 66, 3, 6, 1, torch.float16)
    assert SparseLinear(values36, meta36, 66, 3, 6).candidates(torch.randn(1, 66).half()) == ["scratch", "gather"]


def test_a_named_implementation_that_does_not_apply_runs_its_nearest_that_does(monkeypatch):
    """``impl_rules.runs_as``: what ``SparseLinear.run`` launches for a policy that does not apply to the input (on
    the CPU: no sparse tensor cores, no tensor descriptors, no CUDA) — its nearest that does."""
    _, values, meta, _, perm, _ = _case(24, 64, 2, 4, 1, torch.float16)
    mapped, plain = SparseLinear(values, meta, 64, 2, 4, perm=perm), SparseLinear(values, meta, 64, 2, 4)
    x1, x5, x20 = (torch.randn(t, 64).half() for t in (1, 5, 20))
    assert impl_rules.runs_as(mapped, "decode_resident", x1) == "decode_resident"
    assert impl_rules.runs_as(mapped, "decode_resident_tma", x1) == "decode_resident"   # no descriptors here
    assert impl_rules.runs_as(mapped, "decode_resident", x20) == "decode_mapped"       # past its token count
    assert impl_rules.runs_as(mapped, "decode_swap_tma", x5) == "decode_swap"
    for impl in ("decode_sparse_mma", "decode_sparse_mma_mapped_inline", "gemm_sparse_mma", "gemm_sparse_wgmma",
                 "gemm_sparse_wgmma_mapped"):
        assert impl_rules.runs_as(mapped, impl, x20) == "scratch", impl   # the Triton kernels only on CUDA
    for impl in ("decode", "decode_mapped", "gemm_swap", "scratch", "cslt"):
        assert impl_rules.runs_as(mapped, impl, x5) == impl
    # with sparse tensor cores that take the gathered input only, the mapped forms run on it; not Hopper: mma.sp
    monkeypatch.setattr(impl_rules, "sparse_mma_applies", lambda layer, x, mapped=False: not mapped)
    monkeypatch.setattr(impl_rules, "sparse_gemm_applies", lambda layer, x, wgmma=False: not wgmma)
    assert impl_rules.runs_as(mapped, "decode_sparse_mma", x1) == "decode_sparse_mma"
    assert impl_rules.runs_as(mapped, "decode_sparse_mma_mapped", x1) == "scratch"
    assert impl_rules.runs_as(plain, "decode_sparse_mma_mapped", x1) == "decode_sparse_mma_mapped"   # no map to read
    for impl in ("gemm_sparse_wgmma", "gemm_sparse_wgmma_mapped"):
        assert impl_rules.runs_as(mapped, impl, x20) == "gemm_sparse_mma", impl


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width,tokens,offset", [(64, 1, 0.0), (100, 3, 1.0), (4096, 2, 0.0)])
def test_rmsnorm_writing_its_output_through_an_index_map_matches_float64(width, tokens, offset, dtype):
    """The producer-side map: the fused kernel equals the norm computed in float64, then gathered."""
    from shuffleprune.kernels.norm_map import rmsnorm_mapped

    g = torch.Generator().manual_seed(width)
    x = (torch.randn(2, tokens, width, generator=g) * 3 + 0.5).to(dtype)
    weight = torch.randn(width, generator=g)
    perm = torch.randperm(width, generator=g)
    eps = 1e-5
    xd = x.double()
    ref = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (weight.double() + offset))[..., perm]
    y = rmsnorm_mapped(x, (weight + offset)[perm].float(), perm.to(torch.int32), eps)
    assert y.shape == x.shape and _close(y, ref, dtype)
    with pytest.raises(ValueError, match="must both be"):
        rmsnorm_mapped(x, weight[:-1].float(), perm.to(torch.int32), eps)


def test_every_kernel_path_compiles_for_sm90_with_wide_streaming_loads_and_tensor_cores(tmp_path):
    """The kernels above only ever run interpreted here; this compiles them for real (Triton + ptxas for
    sm_90a, no GPU needed) through the same host functions, and checks what the compiler made of them:
    no failure, no register spill, 16-byte evict-first loads of the weight in decode issued ahead by
    the software pipeline (asynchronous copies), 2:4 decode loops short enough not to be issue-bound at
    one token and on the tensor cores to 32 tokens, and to beat a dense weight streamed at HBM3's peak
    everywhere (the two-token select loop, 1.2–1.35× cuBLAS on an H100, only that), split-K sized for no more
    programs per SM than the compiled kernel lets reside, tensor-core instructions where ``tl.dot`` is
    used (decode from 3 tokens, prefill) and wgmma where the weight is the A operand (``decode_swap``,
    ``decode_mapped``, ``gemm_swap``, residency as DOT_TILES_SWAP says), no synchronous load left in
    the loop where an index map is read as words (the select loop, ``decode_mapped``), split-K summed in
    the kernel behind a release-acquire atomic, prefill tiles that stay in L2 (no evict-first),
    and the GEMM tile tables (loop length, residency) that ``gemm_plan``'s cost model reads still true, and
    the TMA-fed decode's tiles (bulk copies, residency as DOT_TILES_SWAP_TMA says).

    The tables, residencies, loop lengths, spill-free allocation and evict-first hints were read off Triton
    3.9's compile (this venv's); another Triton compiles the same kernels otherwise (3.6 and 3.8 drop the
    evict-first hint from the pipelined copies, 3.6 makes the dot decode's loop at 32-64 tokens too long to
    issue at HBM3's rate, 3.8 spills 12 bytes in its 32-token tile:
    ``scripts/results/kernel_compile_sm90_triton3*.json``), so under it only what does not hang on its register
    allocation and cache hints is asserted (``tuned`` marks the rest), and a warning says so."""
    import json
    import os
    import subprocess
    import sys
    import warnings
    from pathlib import Path

    import triton
    from packaging.version import Version   # transformers' dependency

    from shuffleprune.kernels.decode_tiles import DOT_TILES_SWAP_TMA, SELECT_MAX_TOKENS
    from shuffleprune.kernels.gpu import next_pow2

    tuned_triton = Version(triton.__version__).release[:2] == (3, 9)

    def tuned(holds: bool) -> bool:
        """Whether a property read off Triton 3.9's compile holds (not asserted under another Triton)."""
        return holds or not tuned_triton

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = tmp_path / "compile.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "check_kernels_compile.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and all("error" not in r for r in rows)
    assert all(r["fits"] and tuned(r["spill_bytes"] == 0) for r in rows)
    impls = {r["impl"] for r in rows}
    assert {"decode", "decode_nomap", "decode_swap", "decode_mapped", "gemm", "gemm_swap", "gemm_swap_tall", "gemm_tile",
            "gemm_swap_tile", "gemm_swap_tall_tile", "scratch",
            "scratch_mapped", "rmsnorm_mapped", "experts", "experts_mapped", "decode_blockmap", "decode_tall",
            "decode_wide", "decode_mapped_tall", "decode_mapped_wide", "decode_mapped_by_value", "route_blocks",
            "decode_swap_narrow", "decode_swap_sync", "decode_swap_spread", "decode_swap_spread_sync", "decode_swap_tma",
            "gather_pairs", "decode_resident",
            "decode_resident_nomap", "decode_resident_tma"} <= impls
    sixteen_bit = [r for r in rows if r["dtype"] != "float32"]
    for r in sixteen_bit:
        if r["impl"] in ("decode", "decode_nomap"):
            assert r["widest_load_bytes"] == 16 and tuned(r["evict_first"]) and r["async_copies"], r
            if r["pattern"] == "2:4" and (r["tokens"] == 1 or r["tensor_core"] and r["tokens"] <= 32):
                assert tuned(r["issue_ceiling_tbs"] > 3.35), r   # its loop can issue faster than HBM3 delivers
            if r["pattern"] == "2:4" and r["tokens"] == 1:   # the select loop: its weight through shared memory
                assert r["loop_shared_bytes"] > 0 and r["shared_ceiling_tbs"] > 3.35, r   # once, in and out
            if r["pattern"] == "2:4":   # and faster than the dense weight could stream at HBM3's peak
                assert tuned(r["issue_ceiling_tbs"] * 2 / (1 + 2 / 16) > 3.35), r
            assert tuned(r["plan_per_sm"] <= r["programs_per_sm"]), r   # split-K never assumes more than reside
        if (r["impl"] == "decode" and r["tokens"] > SELECT_MAX_TOKENS) or r["impl"] == "gemm":
            assert r["tensor_core"], r
        if ("swap" in r["impl"]
                and r["impl"].removesuffix("_tiled") not in ("decode_swap_sync", "decode_swap_spread_sync", "decode_swap_tma")) \
                or r["impl"] == "decode_mapped":   # the weight
            # as the A operand: asynchronous wgmma (but the 32-row tile's synchronous mma, checked below)
            assert r["wgmma"] and r["widest_load_bytes"] == 16 and r["async_copies"], r
        if r["impl"] in ("decode_mapped", "decode_blockmap") or (r["impl"] == "decode" and not r["tensor_core"]):
            assert r["loop_sync_loads"] == 0, r   # the map's gather too is copied ahead by the pipeline (its
                                                  # 1-byte offsets read as 32-bit words)
        if r["impl"] == "decode_mapped":
            assert r["plan_per_sm"] <= r["programs_per_sm"], r
        if r["impl"].startswith("decode") and r["impl"].endswith(("_tall", "_wide", "_by_value")):   # the select
                                                                  # loop's other tiles and form stream as its own does
            assert r["widest_load_bytes"] == 16 and tuned(r["evict_first"]) and r["async_copies"], r
            assert not r["tensor_core"] and r["loop_sync_loads"] == 0, r
            assert r["issue_ceiling_tbs"] > 3.35 or r["tokens"] == 2, r
            assert r["plan_per_sm"] <= r["programs_per_sm"], r
        if r["impl"] == "decode_swap":
            assert tuned(r["evict_first"]) and tuned(r["plan_per_sm"] == r["programs_per_sm"]), r
        if r["impl"] == "decode_swap_narrow":   # the half step: no more programs planned than reside
            assert tuned(r["evict_first"]) and r["plan_per_sm"] <= r["programs_per_sm"], r
        if r["impl"] == "decode_swap_sync":   # 32 rows of 2 warps: tensor cores by the synchronous mma, not wgmma,
            assert tuned(r["evict_first"]) and r["tensor_core"] and not r["wgmma"], r   # more programs than the 64-row tile
            assert r["plan_per_sm"] <= r["programs_per_sm"] and r["programs_per_sm"] > 2, r
            assert r["widest_load_bytes"] == 16 and r["async_copies"] and r["loop_sync_loads"] == 0, r
        if r["impl"].removesuffix("_tiled") in ("decode_swap_spread", "decode_swap_spread_sync"):   # the tile expanded
            # by broadcasts (in either position layout): the expanded tile no longer goes through shared memory
            # to change layout (only the weight's and the inputs' copies do), on the same tile as its joined expansion
            joined = next((q for q in sixteen_bit if q["impl"] == r["impl"].replace("_spread", "")
                           and q["tokens"] == r["tokens"] and q["shape"] == r["shape"] and q["pattern"] == "2:4"), None)
            assert joined or r["tokens"] != 16, r   # both are compiled at 16 tokens
            assert r["constexprs"]["SPREAD"], r
            assert joined is None or r["loop_shared_bytes"] < 0.8 * joined["loop_shared_bytes"], (r, joined)
            assert (r["wgmma"] or r["impl"].startswith("decode_swap_spread_sync")) and r["tensor_core"], r
            assert tuned(r["evict_first"]) and r["async_copies"] and r["loop_sync_loads"] == 0, r
            assert r["plan_per_sm"] <= r["programs_per_sm"], r
        if r["impl"] == "decode_swap_tma":   # the weight's tiles by the Tensor Memory Accelerator, on its own tiles
            block_r, columns, _, per_sm = DOT_TILES_SWAP_TMA[max(16, next_pow2(r["tokens"]))]
            assert r["wgmma"] and r["bulk_copies"] and r["loop_sync_loads"] == 0, r
            assert tuned(r["plan_per_sm"] == r["programs_per_sm"] == per_sm), r
            assert (r["constexprs"]["BLOCK_R"], 2 * r["constexprs"]["BLOCK_K"]) == (block_r, columns), r
            swap = next((q for q in sixteen_bit if q["impl"] == "decode_swap" and q["tokens"] == r["tokens"]
                         and q["shape"] == r["shape"] and q["pattern"] == "2:4"), None)
            if r["tokens"] == 16:   # fewer registers, more programs per SM than decode_swap (2), the same loop
                assert per_sm > swap["programs_per_sm"] and r["registers"] < swap["registers"], r
                assert tuned(r["loop_instructions"] <= 1.02 * swap["loop_instructions"]), r
            elif swap is not None:   # 32-64 tokens: twice decode_swap's step, fewer instructions per byte
                assert r["issue_ceiling_tbs"] > swap["issue_ceiling_tbs"], r
        if r["impl"].startswith("experts"):   # the grouped MoE kernel streams each expert as decode streams a layer
            assert r["widest_load_bytes"] == 16 and tuned(r["evict_first"]) and r["async_copies"], r
            assert r["loop_sync_loads"] == 0, r   # an expert's map read as words the pipeline copies too
            assert r["tensor_core"] == r["wgmma"] == (r["tokens"] > 1), r   # blocks of ≥ 2 pairs: weight-as-A wgmma
            assert r["issue_ceiling_tbs"] > 3.35, r
        if r["impl"].startswith("gemm"):
            assert not r["evict_first"], r
        if r["impl"] in ("gemm_tile", "gemm_swap_tile", "gemm_swap_tall_tile"):   # the tables gemm_plan's cost model reads are the compiled ones
            assert tuned(r["programs_per_sm"] == r["table_per_sm"]), r
            assert tuned(abs(r["loop_instructions"] - r["table_loop"]) <= 0.1 * r["table_loop"]), r
    # the resident-input decode streams as the select loop does, its map read before the loop: the same loop
    # with the map and without, shorter per kept value than the select loop's through the map
    resident = {(r["impl"], r["tokens"]): r for r in sixteen_bit if r["impl"].startswith("decode_resident")
                and r["impl"] != "decode_resident_tma"}
    assert len(resident) == 5   # with the map at 1-2 tokens, without at one, launched as a dependent at 1-2
    for t in (1, 2):   # with its tiles by the Tensor Memory Accelerator: fewer registers, a loop within 3 %
        r, plain = next(q for q in sixteen_bit if (q["impl"], q["tokens"]) == ("decode_resident_tma", t)), \
            resident["decode_resident", t]
        assert r["bulk_copies"] and r["loop_sync_loads"] == 0 and r["plan_per_sm"] <= r["programs_per_sm"], r
        assert tuned(r["registers"] < plain["registers"] and r["loop_instructions"] <= 1.03 * plain["loop_instructions"]), r
    for r in resident.values():
        assert r["widest_load_bytes"] == 16 and tuned(r["evict_first"]) and r["async_copies"], r
        assert not r["tensor_core"] and r["loop_sync_loads"] == 0 and r["plan_per_sm"] <= r["programs_per_sm"], r
        assert r["constexprs"]["PREFETCH"] == 32 and r["constexprs"]["PREFETCH_WORDS"] > 0, r   # the head in L2 first
    assert resident[("decode_resident", 1)]["loop_instructions"] == resident[("decode_resident_nomap", 1)]["loop_instructions"]
    for t in (1, 2):   # "decode": the select loop reading the map itself
        select = next(r for r in sixteen_bit if (r["impl"], r["tokens"], r["dtype"], r["pattern"]) ==
                      ("decode", t, "bfloat16", "2:4"))
        assert resident[("decode_resident", t)]["issue_ceiling_tbs"] > max(3.35, select["issue_ceiling_tbs"]), t
    # the select loop by 2:4 group (the default) and by kept value (decode_mapped_by_value) are two loops
    loops = {(r["impl"], r["tokens"]): r["loop_instructions"] for r in sixteen_bit
             if r["dtype"] == "bfloat16" and r["pattern"] == "2:4"}
    for t in (1, 2):
        assert loops[("decode", t)] != loops[("decode_mapped_by_value", t)], t
    # programmatic dependents ("+pdl"): the decode or GEMM prefetches, then waits, then releases the next kernel,
    # reading nothing before the wait (the select loop's in-kernel map reads too; the resident decode reads its
    # map, which no kernel writes, before), its main loop no longer than launched plainly;
    # the gather reads only its map before the wait; the mapped norm releases the decode after it at once; nothing
    # else has any of it
    by_key = {(r["impl"], r["tokens"], r["kernel"]): r for r in rows if r["dtype"] == "bfloat16" and r["pattern"] == "2:4"}
    pdl_rows = [r for r in rows if "_pdl" in r["impl"]]   # the export's layout and cuSPARSELt's ("…_pdl_tiled")
    assert len(pdl_rows) == 18 and all(r["launch_pdl"] and r["grid_dependency"]["wait"]
                                      and r["grid_dependency"]["release"] for r in pdl_rows), pdl_rows
    for r in pdl_rows:
        dep = r["grid_dependency"]
        if r["kernel"] == "_gather_columns_kernel":
            assert dep["loads_before_wait"] and all(op.endswith("b32") for op in dep["loads_before_wait"]), r
        else:   # the resident decode its chunk's map (int32, one 16-byte load per thread), the others nothing
            early = ["ld.global.v4.b32"] if r["impl"] == "decode_resident_pdl" else []
            assert dep["prefetch_before_wait"] and dep["loads_before_wait"] == early, r
            if r["impl"] == "decode_resident_pdl":   # its pipeline's first tiles, whatever the token count
                assert dep["prefetches"] >= 2 and r["constexprs"]["PREFETCH"] == 32, r
            elif r["impl"].startswith("decode") and r["tokens"] == 1:   # a one-token decode prefetches nothing
                assert dep["prefetches"] == 0 and r["constexprs"]["PREFETCH"] == 0, r
            else:   # values and positions
                assert dep["prefetches"] >= 2 and r["constexprs"]["PREFETCH"] > 0 and r["constexprs"]["PREFETCH_WORDS"] > 0, r
            plain = {"decode_pdl": ("decode_nomap", 1), "decode_swap_pdl": ("decode_swap", 16),
                     "decode_mapped_pdl": ("decode_mapped" if r["tokens"] > 1 else "decode", r["tokens"]),
                     "decode_resident_pdl": ("decode_resident", r["tokens"]),
                     "gemm_pdl": ("gemm", 64), "gemm_swap_pdl": ("gemm_swap", 64)}.get(r["impl"])
            if plain and plain[1] == r["tokens"]:   # the same kernel launched plainly
                plain = by_key[(*plain, r["kernel"])]
            else:
                plain = None
            if plain:
                # the prologue lengthens the main loop by no more than the register allocator's 1 % (the GEMM's
                # is 3–7 % shorter: addresses computed once before it) and leaves as many programs per SM
                assert tuned(r["loop_instructions"] <= 1.01 * plain["loop_instructions"]), (r, plain)
                assert r["programs_per_sm"] == plain["programs_per_sm"], (r, plain)
    norm = [r for r in rows if r["impl"] == "rmsnorm_mapped"]
    assert norm and all(not r["launch_pdl"] and r["grid_dependency"]["release"] and not r["grid_dependency"]["wait"]
                        for r in norm)
    # the weight written in the input's order: whole rows reordered in shared memory, 16-byte loads, read once
    for r in (r for r in rows if r["impl"] == "scratch_mapped"):
        padded = 1 << (r["shape"][1] - 1).bit_length()
        assert r["shared_bytes"] >= padded * 2 and r["widest_load_bytes"] == 16 and tuned(r["evict_first"]), r
    # the row gather: whole rows read with 16-byte loads and staged in shared memory (its padded row), launched as
    # a dependent that reads only its map (32-bit words) before the wait
    staged = [r for r in rows if r["impl"] == "gather_rows"]
    assert {r["tokens"] for r in staged} == {16, 2048}, staged
    for r in staged:
        padded = 1 << (r["shape"][1] - 1).bit_length()
        assert r["widest_load_bytes"] == 16 and r["shared_bytes"] >= padded * 2 and r["launch_pdl"], r
        dep = r["grid_dependency"]
        assert dep["wait"] and dep["release"] and all(op.endswith("b32") for op in dep["loads_before_wait"]), r
    assert all(r["grid_dependency"] is None and not r["launch_pdl"] for r in rows
               if "_pdl" not in r["impl"] and r["impl"] not in ("rmsnorm_mapped", "gather_rows"))
    summed_here = [r for r in rows if r["constexprs"].get("SUM_HERE")]
    assert summed_here and all(r["grid"][1] > 1 and r["split_sum_fenced"] for r in summed_here), summed_here
    assert all(r["split_sum_fenced"] is None for r in rows if not r["constexprs"].get("SUM_HERE"))
    for impl in ("gemm_tile", "gemm_swap_tile", "gemm_swap_tall_tile"):
        tiles = [r for r in rows if r["impl"] == impl]
        assert {r["pattern"] for r in tiles} == {"2:4", "4:8"} and len(tiles) >= 6
        assert tiles[0]["tensor_share"] > 0.8, tiles   # 2:4's 256-token tile of long prompts
    swap, tall = (next(r for r in rows if r["impl"] == impl and r["pattern"] == "2:4")
                  for impl in ("gemm_swap_tile", "gemm_swap_tall_tile"))   # each table's 256-token tile
    # the 64-row tile needs operands faster than L2 handed them out on an H100 (5.9-6.5 TB/s); 128 rows, 0.56x
    assert swap["l2_operand_tbs"] > 6.5 and tall["l2_operand_tbs"] < 0.6 * swap["l2_operand_tbs"], (swap, tall)
    for r in (r for r in sixteen_bit if r["impl"].startswith("gemm_swap_tall")):   # 128 weight rows: two warpgroups' wgmma
        assert r["constexprs"]["BLOCK_R"] == 128 and r["num_warps"] == 8 and r["wgmma"], r
    if not tuned_triton:
        warnings.warn(f"Triton {triton.__version__}: the kernels compiled for sm_90a; the tile tables, residencies, "
                      "loop lengths, spill-free allocation and evict-first hints read off Triton 3.9 were not checked",
                      UserWarning)


def test_every_kernel_path_compiles_and_fits_an_ada_gpus_shared_memory(tmp_path):
    """Compiled for an L40S (sm_89, Ada: 99 KB of shared memory a program, no wgmma, no Tensor Memory
    Accelerator) as ``SparseLinear`` would launch them there: every kernel path compiles and fits (the
    compile-only launch refuses what Triton's loader would), the tensor-core decodes, the grouped experts
    kernel and the deepest GEMM tile by a shallower pipeline than on Hopper (they need 103–113 KB at
    Hopper's depth), mma.sync on the tensor cores, and none of the Hopper-only kernels offered."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from shuffleprune.kernels.decode_tiles import DECODE_STAGES

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = tmp_path / "compile_sm89.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "check_kernels_compile.py"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--gpu", "l40s", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    table = json.loads(out.read_text())
    rows = table["rows"]
    assert table["target"].startswith("L40S") and rows and all("error" not in r and r["fits"] for r in rows)
    assert all(r["shared_bytes"] <= 99 * 1024 for r in rows)
    assert not any(r["impl"].endswith("_tma") or r["bulk_copies"] or r["wgmma"] or r["launch_pdl"] for r in rows)
    shallower = {r["impl"] for r in rows if r["constexprs"].get("STAGES", DECODE_STAGES) < DECODE_STAGES
                 and r["impl"] not in ("decode_shallow", "decode_swap_narrow")}   # (3 stages by design)
    assert {"decode", "decode_swap", "experts", "experts_mapped"} <= shallower, shallower
    assert any(r["impl"] == "gemm_swap_tall_tile" and r["num_stages"] < 3 for r in rows)
    assert all(r["tensor_core"] for r in rows if r["impl"] in ("decode_swap", "gemm", "experts") and r["tokens"] >= 16
               and r["dtype"] != "float32")   # (float32 multiplies in full precision, off the tensor cores)


def test_fast_launches_pass_the_compiled_kernel_what_tritons_dispatch_passes(tmp_path):
    """``kernels/launch.py`` (compile-only, no GPU: ``scripts/check_fast_launch.py``): for every kernel an
    eager decode or prefill launches (the decodes plain, mapped, split-K summed either way, as dependent
    launches, with their weight tiles by TMA descriptors; the resident decode; the GEMM; both scratch fills; both gathers; the mapped norm; the MoE experts kernel and its pairs' gather), the
    launcher call of the fast path is Triton's own for the same arguments, argument for argument; a call
    of a kind seen before goes fast; the fast path's key never joins two calls Triton specializes apart; and every launch of a
    warmed-up eager decode step of a model laid out as ``load`` serves it goes fast."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = tmp_path / "fast_launch.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "check_fast_launch.py"
    proc = subprocess.run([sys.executable, str(script), "--calls", "20", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    launches = [r for r in result["rows"] if "call" in r]
    assert result["ok"] and all(r["identical"] and r["key_refines"] for r in launches)
    assert {r["kernel"] for r in launches} == {
        "_nm_decode_kernel", "_sum_partials_kernel", "_nm_gemm_kernel", "_nm_decompress_kernel",
        "_nm_decompress_mapped_kernel", "_gather_columns_kernel", "_gather_rows_kernel", "_rmsnorm_mapped_kernel",
        "_nm_experts_kernel", "_route_blocks_kernel", "_gather_pairs_kernel", "_nm_resident_kernel"}
    assert all(r["fast"] for r in launches if r["call"] == 3)   # the TMA decodes too (descriptors keyed)
    assert {r["case"] for r in launches if "TMA" in r["case"]} >= {
        "nm_decode 16 tokens, weight tiles by TMA (tensor descriptors)", "nm_decode_resident 1 token, map, weight tiles by TMA"}
    assert not any(r["fast"] for r in launches if r["call"] == 1)   # the first of each kind goes through Triton
    step = next(r for r in result["rows"] if "launches_per_step" in r)   # a whole eager decode step, as load serves
    assert step["launches_per_step"] >= 6 * 4 and step["fast_launches_per_step"] == step["launches_per_step"]


def test_fast_launch_keys_tell_apart_what_triton_specializes_on():
    """A launch's key (``kernels/launch.arg_key``) changes with a pointer's 16-byte alignment and dtype, an
    integer's being 1, divisible by 16 or past 32 bits, a tensor descriptor's dtype and block; a float's
    value and a descriptor's shape do not enter it; an argument of another kind is refused (that call
    goes through Triton's dispatch)."""
    from shuffleprune.kernels.launch import arg_key, args_key

    t = torch.zeros(64, dtype=torch.bfloat16)
    assert arg_key(t) != arg_key(t[1:])                       # 2 bytes off: not 16-byte aligned
    assert arg_key(t) == arg_key(t[8:])                       # 16 bytes off: aligned
    assert arg_key(t) != arg_key(t.float())
    assert arg_key(torch.nn.Parameter(t, requires_grad=False)) == arg_key(t)
    keys = [arg_key(v) for v in (1, 16, 17, 32, (1 << 31) + 16, 1 << 63)]
    assert len(set(keys)) == 5 and keys[1] == keys[3]
    assert arg_key(True) != arg_key(False) != arg_key(0)
    assert arg_key(1e-5) == arg_key(0.5) and arg_key(None) is None
    with pytest.raises(TypeError):
        arg_key("a string")
    from triton.tools.tensor_descriptor import TensorDescriptor

    w = torch.zeros(128, 64, dtype=torch.int32)
    d = TensorDescriptor.from_tensor(w, [64, 32])   # a tensor descriptor: its dtype and block shape (and padding)
    assert arg_key(d) == arg_key(TensorDescriptor.from_tensor(w[:96], [64, 32]))   # not its shape or address
    assert arg_key(d) != arg_key(TensorDescriptor.from_tensor(w, [32, 32]))
    assert arg_key(d) != arg_key(TensorDescriptor.from_tensor(w.view(torch.float32), [64, 32]))
    values = (t, t[1:], torch.nn.Parameter(t.float(), requires_grad=False), 1, 16, 17, -5, 1 << 40, True, 0.5, None, d)
    assert args_key(values) == tuple(map(arg_key, values))   # the one-pass key of a launch's arguments
    with pytest.raises(TypeError):
        args_key((t, "a string"))


def _capture_probe():
    """``scripts/capture_probe.py`` as a module of its own (a script, not part of the package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "capture_probe.py"
    spec = importlib.util.spec_from_file_location("capture_probe_for_test", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    return probe


def test_the_eager_profile_counts_every_call_of_a_fast_wrapped_kernel():
    """``scripts/capture_probe.python_profile`` (the eager decode's profile on a GPU) counts each call of a
    kernel through ``kernels/launch.py`` once per step, whether it goes through ``fast(k)[grid]`` (the
    gathers, the norm) or a bound launch held by its caller (``nm_decode``)."""
    from shuffleprune.deploy.format import compress
    from shuffleprune.kernels.gather import gather_columns
    from shuffleprune.kernels.nm_decode import nm_decode
    from shuffleprune.kernels.nm_words import position_words

    probe = _capture_probe()
    w = torch.randn(16, 64)
    values, meta = compress(w * nm_keep_mask(w.abs(), 2, 4), 2, 4)
    words, x, perm = position_words(meta), torch.randn(1, 64), torch.randperm(64).to(torch.int32)

    def step() -> None:
        nm_decode(gather_columns(x, perm), values, words, 2, 4, 2)

    step()
    assert probe.python_profile(step, steps=2)["calls_per_step"]["fast_kernel_calls"] == 2


def test_the_capture_probes_waits_have_a_hang_limit_and_spin(monkeypatch):
    """``scripts/capture_probe``'s waits (around a profiled prompt, after a failed capture) go through the hang
    limit: a wait that ends is spun (no sleep, so the host's timings end with the GPU) and then synchronises the
    device; a step that never ends is a DeviceFault naming the step and the way to leave a suspect out, and no
    device synchronise follows (that would hang)."""
    import time

    from shuffleprune.runtime.faults import DeviceFault

    probe = _capture_probe()
    busy = {"queries": 50, "synced": 0, "streams": []}

    class Event:
        def record(self, stream=None):
            self.asked = 0
            busy["streams"].append(stream)

        def query(self):
            self.asked += 1
            return self.asked > busy["queries"]

    slept: list = []
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(s))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: busy.__setitem__("synced", busy["synced"] + 1))
    side = object()
    probe.wait("a probed prompt", stream=side)
    assert slept == [] and busy["synced"] == 1 and busy["streams"] == [side]
    busy["queries"] = 10**12
    monkeypatch.setattr(probe, "E2E_HANG_LIMIT_S", 0.02)
    with pytest.raises(DeviceFault, match=r"^the work queued before a profiled step did not finish in 0.02 s.*"
                                          r"SHUFFLEPRUNE_SKIP_IMPLS=<implementation> leaves a suspect out of auto$"):
        probe.step_profile(lambda: None)
    assert busy["synced"] == 1


def test_fast_launch_runs_tritons_own_dispatch_under_the_interpreter():
    """Under ``TRITON_INTERPRET=1`` (CI) a wrapped kernel is launched by Triton as before: the same
    output, nothing launched fast."""
    from shuffleprune.kernels import launch
    from shuffleprune.kernels.gather import _gather_columns_kernel, gather_columns

    x = torch.randn(3, 96)
    perm = torch.randperm(96).to(torch.int32)
    before = launch.fast(_gather_columns_kernel).fast_launches
    for _ in range(3):
        assert torch.equal(gather_columns(x, perm), x[:, perm.long()])
    assert launch.fast(_gather_columns_kernel).fast_launches == before


def test_a_triton_too_old_for_the_kernels_leaves_every_layer_to_pytorch_with_one_warning(monkeypatch):
    """Under Triton 3.2 and 3.3 (PyTorch 2.6, 2.7) most kernels do not compile (chained conditions, no
    ``tl.gather``): the runtime then offers none of them — a sparse layer's only candidate is PyTorch's
    ``scratch``, and the Triton gathers are not used — and says so once. 3.4 and later (local builds'
    ``+git`` suffixes too) build them, and this machine's Triton has working grid dependency control
    (Triton 3.4.0's does not compile: ``overlap.HAS_GDC`` is false there)."""
    import triton

    from shuffleprune.deploy import input_gather
    from shuffleprune.kernels import gpu, overlap

    assert overlap.HAS_GDC
    for version, builds in (("3.3.1", False), ("3.2.0", False), ("3.4.0", True), ("3.5.1+git9a3f", True),
                            ("3.9.0", True)):
        monkeypatch.setattr(triton, "__version__", version)
        gpu.kernels_build.cache_clear()
        if builds:
            assert gpu.kernels_build()
            continue
        with pytest.warns(RuntimeWarning, match=f"Triton {version} cannot build .* 3.4 or later"):
            assert not gpu.kernels_build()
        assert not gpu.kernels_build()   # once: the answer is kept
        w, values, meta, x, perm, bias = _case(40, 64, 2, 4, 1, torch.bfloat16)
        layer = SparseLinear(values, meta, 64, 2, 4, perm=perm, bias=bias)
        assert layer.candidates(x) == ["scratch"]
    monkeypatch.setattr(triton, "__version__", "3.3.1")
    gpu.kernels_build.cache_clear()
    with pytest.warns(RuntimeWarning):
        assert not input_gather._triton_gathers(x)
    gpu.kernels_build.cache_clear()


def test_bench_kernels_times_the_targets_rows_on_every_shape_before_the_other_candidates(monkeypatch, tmp_path):
    """``bench_kernel`` times dense and auto's rows on every shape first, then the sparse tensor-core kernels on every
    shape, then the other candidates, all on the same seeded layer and inputs: a run cut short in the last pass
    (here a fault on the second shape) still holds the target table and the newest kernels' rows, and the later
    passes' rows are read against the first pass's dense times."""
    import json
    import sys

    from shuffleprune.deploy.impls import SKIP_ENV
    from shuffleprune.runtime.faults import DeviceFault

    bench = _bench_kernel_script(monkeypatch)
    run, inputs = SparseLinear.run, {}

    def faulting(self, impl, x):
        if impl == "decode_swap" and self.in_features == 96:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        inputs.setdefault((self.out_features, x.shape[0], self.policy), x.clone())
        return run(self, impl, x)

    monkeypatch.setattr(SparseLinear, "run", faulting)
    monkeypatch.setenv(SKIP_ENV, "")
    monkeypatch.setenv("SHUFFLEPRUNE_AUTO_STORE", "0")
    monkeypatch.setattr(sys, "argv", ["bench_kernel.py", "--smoke", "--impls", "decode_swap", "gemm_sparse_wgmma",
                                      "auto", "--tokens", "5", "--out", str(tmp_path / "bench_kernel.json")])
    with pytest.raises(DeviceFault, match="decode_swap .40x96, 5 tokens. failed"):
        bench.main()
    rows = json.loads((tmp_path / "bench_kernel_smoke.json").read_text())["rows"]
    assert [(r["shape"], r["impl"]) for r in rows] == [
        ([48, 64], "dense"), ([48, 64], "auto"), ([40, 96], "dense"), ([40, 96], "auto"),
        ([48, 64], "gemm_sparse_wgmma"), ([40, 96], "gemm_sparse_wgmma"), ([48, 64], "decode_swap")]
    swap = rows[-1]
    assert swap["speedup_vs_dense"] == pytest.approx(rows[0]["ms"] / swap["ms"]) and swap["max_rel_err"] < 1e-2
    assert torch.equal(inputs[(48, 5, "auto")], inputs[(48, 5, "decode_swap")])   # one seeded input, both passes


def test_bench_kernels_timed_run_ends_naming_a_kernel_that_never_finishes(monkeypatch, tmp_path):
    """A candidate still running long after its launch (a kernel that never returns) ends ``bench_kernel``'s run
    with a ``DeviceFault`` naming it, its rows so far kept and the kernel in ``skipped_impls``, as a fault does,
    instead of hanging the step until its time limit."""
    import json
    import sys
    from types import SimpleNamespace

    from shuffleprune.deploy.impls import SKIP_ENV
    from shuffleprune.runtime.faults import DeviceFault

    bench = _bench_kernel_script(monkeypatch)
    run = SparseLinear.run

    monkeypatch.setattr(SparseLinear, "run", lambda self, impl, x: SimpleNamespace(is_cuda=True)
                        if impl == "decode_swap" else run(self, impl, x))
    _gpu_that_never_finishes(monkeypatch)
    monkeypatch.setenv(SKIP_ENV, "")
    monkeypatch.setenv("SHUFFLEPRUNE_AUTO_STORE", "0")
    monkeypatch.setattr(sys, "argv", ["bench_kernel.py", "--smoke", "--impls", "decode", "decode_swap", "--tokens", "5",
                                      "--out", str(tmp_path / "bench_kernel.json")])
    with pytest.raises(DeviceFault, match=r"decode_swap .48x64, 5 tokens. did not finish in 0.05 s.*"
                                          r"SHUFFLEPRUNE_SKIP_IMPLS=decode_swap"):
        bench.main()
    written = json.loads((tmp_path / "bench_kernel_smoke.json").read_text())
    assert written["skipped_impls"] == ["decode_swap"] and not written["complete"]
    assert [(r["tokens"], r["impl"]) for r in written["rows"]] == [(5, "dense"), (5, "decode")]
