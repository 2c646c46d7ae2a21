"""The prompt GEMM on the sparse tensor cores (``kernels/nm_sparse_gemm.cu``) run on the CPU by the decode's emulator,
against float64; its plans, its bank-conflict-free staging, and how a layer weighs and runs it."""
from __future__ import annotations

import itertools
import shutil

import pytest
import torch

from shuffleprune.deploy.cslt_layout import cslt_words
from shuffleprune.deploy.format import compress
from shuffleprune.kernels.nm_sparse_gemm import nm_sparse_gemm
from shuffleprune.kernels.sparse_gemm_tiles import (GEMM_TILES, SparseGemmPlan, check_gemm_plan, gemm_traffic,
                                                    sparse_gemm_applies, sparse_gemm_plan, whole_splits)
from shuffleprune.masks import nm_keep_mask

from test_sparse_mma import _case, _check

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator is built by g++")


def _run(*args, **kwargs):
    from sparse_gemm_cpu import run_gemm_cpu

    return run_gemm_cpu(*args, **kwargs)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("rows,cols,tokens,plan,dtype", [
    (64, 128, 5, (2, 4, 2, 2, 3), torch.bfloat16),      # fewer K stages (2) than the pipeline holds, 5 of 64 tokens
    (128, 640, 70, (4, 4, 2, 2, 3), torch.bfloat16),    # 10 K stages, two token blocks, the second ragged
    (128, 256, 33, (2, 2, 2, 2, 2), torch.float16),     # two row blocks, two stages in flight
    (64, 384, 17, (2, 4, 2, 2, 4), torch.float16),      # four stages in flight over six
    (128, 192, 130, (4, 8, 2, 2, 3), torch.bfloat16),   # the largest tile: 64 x 64 a warp, 2 token blocks
    (128, 256, 40, (4, 4, 2, 4, 3), torch.bfloat16),    # 8 warps
    (256, 128, 20, (4, 8, 4, 2, 2), torch.bfloat16),    # 256 rows x 128 tokens (Hopper's opt-in with 3 stages)
    # split-K: 3 splits of 4 stages, the last of 2; 2 splits over 2 token blocks x 2 row blocks; a split shorter
    # than the pipeline
    (64, 640, 21, (2, 4, 2, 2, 3, 3), torch.bfloat16),
    (128, 512, 70, (2, 4, 2, 2, 3, 2), torch.float16),
    (128, 192, 9, (4, 4, 2, 2, 4, 3), torch.bfloat16),
])
def test_sparse_gemm_matches_float64(rows, cols, tokens, plan, dtype, tiled):
    w, values, words, x, bias = _case(rows, cols, tokens, dtype, seed=tokens)
    plan = SparseGemmPlan(*plan)
    check_gemm_plan(plan, rows, cols)
    y = _run(x, values, cslt_words(words) if tiled else words, bias, tiled, plan, seed=rows + tokens)
    _check(y, x.double() @ w.double().t() + bias.double(), dtype)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("rows,cols,tokens,plan,dtype", [
    (64, 256, 5, (1, 4, 4, 1, 3), torch.bfloat16),       # one warpgroup, N 32; 4 stages over 3 slots (one reused)
    (128, 640, 70, (1, 8, 8, 1, 4), torch.bfloat16),     # two warpgroups, 10 stages, two token blocks, the second ragged
    (64, 384, 17, (1, 16, 4, 1, 3), torch.float16),      # N 128, three slots, one stage of copies ahead
    (128, 128, 3, (1, 4, 8, 1, 3), torch.float16),       # fewer stages (2) than the pipeline holds; N 32
    (128, 512, 33, (1, 4, 8, 1, 3, 2), torch.bfloat16),  # split-K: 2 splits of 4 stages
    (64, 192, 40, (1, 32, 4, 1, 5), torch.bfloat16),     # N 256, the largest wgmma; more slots than stages
    # the decode's tiles: 64 rows x 8 tokens at 1 and 5 tokens (64 input chunks copied by half the threads), 16 tokens
    # at 12 (the 4 warps' 128 chunks), split-K over 5 and 2 splits
    (64, 640, 1, (1, 1, 4, 1, 4, 5), torch.bfloat16),
    (128, 320, 5, (1, 1, 4, 1, 3), torch.float16),
    (64, 512, 12, (1, 2, 4, 1, 4, 2), torch.bfloat16),
])
def test_sparse_gemm_on_wgmma_matches_float64(rows, cols, tokens, plan, dtype, tiled):
    """The Hopper form (``wgmma.mma_async.sp``, both operands read from the stage through descriptors) under the
    emulator, which runs each wgmma as loosely as the PTX ISA lets it (operands read at the issue, checked unchanged
    and added in at its retirement)."""
    w, values, words, x, bias = _case(rows, cols, tokens, dtype, seed=tokens + 1)
    plan = SparseGemmPlan(*plan, wgmma=True)
    check_gemm_plan(plan, rows, cols, shared_limit=227 * 1024)   # Hopper's opt-in: the only GPU that runs it
    y = _run(x, values, cslt_words(words) if tiled else words, bias, tiled, plan, seed=rows + tokens)
    _check(y, x.double() @ w.double().t() + bias.double(), dtype)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("rows,cols,tokens,plan,dtype", [
    (64, 256, 1, (1, 1, 4, 1, 3), torch.bfloat16),        # one token, the whole K in one CTA
    (128, 640, 5, (1, 1, 4, 1, 4, 3), torch.float16),     # 3 splits: each gathers only its own columns
    (64, 384, 12, (1, 2, 4, 1, 3, 2), torch.bfloat16),    # 16 tokens a CTA, 4 of them past T (zeros)
])
def test_the_wgmma_decode_reading_the_map_itself_matches_float64(rows, cols, tokens, plan, dtype, tiled):
    """``mapped``: each CTA gathers its split's columns of its tokens through the map into shared memory once (the
    input given in its original order), the stages then holding only the weight."""
    w, values, words, x, bias = _case(rows, cols, tokens, dtype, seed=tokens + 2)
    perm = torch.randperm(cols, generator=torch.Generator().manual_seed(tokens)).to(torch.int32)
    plan = SparseGemmPlan(*plan, wgmma=True, mapped=True)
    check_gemm_plan(plan, rows, cols, shared_limit=227 * 1024)
    y = _run(x, values, cslt_words(words) if tiled else words, bias, tiled, plan, seed=tokens, perm=perm)
    _check(y, x.double()[:, perm.long()] @ w.double().t() + bias.double(), dtype)


def test_a_mapped_plan_stages_its_split_within_the_limit_and_bad_maps_are_refused():
    from shuffleprune.kernels.nm_sparse_gemm import check_map
    from shuffleprune.kernels.sparse_gemm_tiles import MAPPED_STAGED_LIMIT

    for (rows, cols), tokens in itertools.product([(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)],
                                                  (1, 8, 16)):
        plan = sparse_gemm_plan(tokens, rows, cols, 132, shared_limit=227 * 1024, wgmma=True, mapped=True)
        assert plan.mapped and plan.bn <= 16 and 0 < plan.staged_bytes(cols) <= MAPPED_STAGED_LIMIT
        assert plan.dynamic_shared(cols) == plan.stages * plan.stage_bytes() + plan.staged_bytes(cols) + 1024
    with pytest.raises(ValueError, match="layer's columns"):
        SparseGemmPlan(1, 1, 4, 1, 4, wgmma=True, mapped=True).dynamic_shared()
    with pytest.raises(ValueError, match="wgmma decode only"):
        sparse_gemm_plan(17, 4096, 4096, 132, shared_limit=227 * 1024, wgmma=True, mapped=True)
    with pytest.raises(ValueError, match="wgmma form's CTAs of 16 tokens"):
        check_gemm_plan(SparseGemmPlan(2, 4, 2, 2, mapped=True), 128, 256)   # mma.sp reads no map
    perm = torch.randperm(256).to(torch.int32)
    check_map(perm, 256, 16, True)
    for bad, match in (((perm, 256, 17, True), "up to 16 tokens"), ((perm, 256, 4, False), "on mma.sp"),
                       ((perm.long(), 256, 4, True), "contiguous int32"), ((perm[:128], 256, 4, True), "int32 \\[256\\]")):
        with pytest.raises(ValueError, match=match):
            check_map(*bad)


@pytest.mark.parametrize("mutation,error", [
    # the metadata registers written before the step before's wgmmas are waited for (they still read them)
    ((("  sp_wgmma_wait<0>(acc);\n  unsigned e[2];\n#pragma unroll\n"
       "  for (int kk = 0; kk < 2; ++kk) e[kk] = sp_gemm_meta_join(words[kk], lane);",
       "  unsigned e[2];\n#pragma unroll\n"
       "  for (int kk = 0; kk < 2; ++kk) e[kk] = sp_gemm_meta_join(words[kk], lane);\n  sp_wgmma_wait<0>(acc);"),),
     "metadata register was written while it ran"),
    # the next stage copied into the slot the step before's wgmmas still read
    ((("sp_gemm_copy_stage(smem + ((kt + STAGES - 2) % STAGES) * STAGE_HALVES",
       "sp_gemm_copy_stage(smem + ((kt + STAGES - 1) % STAGES) * STAGE_HALVES"),),
     "copy into a wgmma's operands was issued after the barrier before it"),
    # the stage's copies not waited for: the wgmma reads a slot before they land
    ((("  sp_cp_async_wait<STAGES - 3>();\n  sp_fence_proxy_async();", "  sp_fence_proxy_async();"),),
     "shared-memory operands were written while it ran"),
])
def test_the_emulator_refuses_a_wgmma_pipeline_that_races(mutation, error, monkeypatch):
    """Three broken pipelines, made from the kernel's own text, each a race on a GPU that the emulator must refuse: a
    wgmma's metadata registers written while it runs, a slot copied into while a wgmma reading it runs (each step's
    wgmmas run on through the next step's barrier and copies), and a wgmma reading a slot whose copies have not landed
    (the tests above would have caught any of them)."""
    import sparse_gemm_cpu
    from shuffleprune.kernels import nm_sparse_gemm as sg

    text = sg.SOURCE.read_text()
    for before, after in mutation:
        assert before in text
        text = text.replace(before, after)
    monkeypatch.setattr(sg, "SOURCE", type("Text", (), {"read_text": staticmethod(lambda: text)})())
    _, values, words, x, bias = _case(64, 384, 20, torch.bfloat16, seed=5)
    with pytest.raises(RuntimeError, match=error):
        sparse_gemm_cpu.run_gemm_cpu(x, values, words, bias, False, SparseGemmPlan(1, 4, 4, 1, 3, wgmma=True))


def test_wgmma_plans_fill_the_gpu_and_their_stages_sit_on_the_swizzle_period():
    """The wgmma plans: warpgroups of 64 rows, each stage a multiple of 1024 bytes (its input tile on the 128-byte
    swizzle's period) with 1024 bytes spare for the kernel to align them, grids filling 90 % of 132 SMs; plans the
    instruction cannot take are refused in one line."""
    for (rows, cols), tokens in itertools.product([(4096, 4096), (14336, 4096), (4096, 14336), (1024, 4096)],
                                                  (64, 512, 2048)):
        plan = sparse_gemm_plan(tokens, rows, cols, 132, shared_limit=227 * 1024, wgmma=True)
        gx, gy, gz = plan.grid(tokens, rows)
        assert plan.wgmma and plan.mt == 1 and plan.wn == 1 and plan.wm % 4 == 0 and plan.bn <= 256
        assert plan.stage_bytes() % 1024 == 0 and plan.dynamic_shared() >= plan.stages * plan.stage_bytes() + 1024
        assert plan.dynamic_shared() <= 227 * 1024 and gx * gy * gz >= 0.9 * 132
    assert SparseGemmPlan(1, 8, 4, 1, wgmma=True).stage_bytes() == 4096 + 8192 + 1024   # 13056 rounded up
    # up to 64 tokens: the decode's tile, the fewest of 8-64 tokens that hold the input, split to 4 CTAs an SM (each
    # split 4 stages or more)
    for tokens, bn in ((1, 8), (8, 8), (9, 16), (17, 32), (64, 64)):
        plan = sparse_gemm_plan(tokens, 4096, 4096, 132, shared_limit=227 * 1024, wgmma=True)
        assert (plan.bm, plan.bn, plan.splits) == (64, bn, 8) and plan.grid(tokens, 4096) == (1, 64, 8)
    assert sparse_gemm_plan(1, 14336, 4096, 132, shared_limit=227 * 1024, wgmma=True).splits == 3   # 224 row blocks
    assert sparse_gemm_plan(1, 1024, 4096, 132, shared_limit=227 * 1024, wgmma=True).splits == 16   # 4 stages a split
    assert sparse_gemm_plan(65, 4096, 4096, 132, shared_limit=227 * 1024, wgmma=True).bm == 128   # a GEMM tile again
    for bad in (SparseGemmPlan(2, 8, 4, 1, wgmma=True), SparseGemmPlan(1, 8, 2, 2, wgmma=True),
                SparseGemmPlan(1, 33, 4, 1, wgmma=True), SparseGemmPlan(1, 8, 6, 1, wgmma=True)):
        with pytest.raises(ValueError, match="wgmma plan takes|whole CTAs"):
            check_gemm_plan(bad, 384, 256)
    with pytest.raises(ValueError, match="16-byte chunks"):   # 48 tokens' 384 chunks over 256 threads
        check_gemm_plan(SparseGemmPlan(1, 6, 8, 1, wgmma=True), 128, 256)
    check_gemm_plan(SparseGemmPlan(1, 2, 8, 1, wgmma=True), 128, 256)   # 128 chunks: half the threads copy one
    with pytest.raises(ValueError, match="3 or more stages"):   # a slot is copied into two steps after its own
        check_gemm_plan(SparseGemmPlan(1, 8, 4, 1, stages=2, wgmma=True), 128, 256)


def test_split_k_adds_the_splits_in_their_order_and_leaves_its_counters_at_zero():
    w, values, words, x, bias = _case(128, 768, 40, torch.bfloat16, seed=4)
    plan = SparseGemmPlan(2, 4, 2, 2, 3, splits=5)   # 12 stages in 5 splits of 3 (the last empty: refused)
    with pytest.raises(ValueError, match="empty"):
        check_gemm_plan(plan, 128, 768)
    plan = SparseGemmPlan(2, 4, 2, 2, 3, splits=4)
    counters = torch.zeros(2, dtype=torch.int32)
    y = _run(x, values, words, bias, False, plan, seed=1, counters=counters)
    _check(y, x.double() @ w.double().t() + bias.double(), torch.bfloat16)
    assert not counters.any()   # every tile's count back at zero for the next call
    assert torch.equal(_run(x, values, words, bias, False, plan, seed=9), y)   # another finishing order, the same bits


def test_sparse_gemm_without_bias_on_spaced_rows_is_the_same_in_any_order():
    w, values, words, x, _ = _case(128, 256, 45, torch.bfloat16, seed=2)
    plan = SparseGemmPlan(2, 4, 2, 2, 3)
    spaced = torch.zeros(45, 256 + 64, dtype=torch.bfloat16)
    spaced[:, :256] = x
    view = spaced[:, :256]   # rows 640 bytes apart: each still 16-byte aligned for the copies
    y = _run(view, values, words, None, False, plan, seed=1)
    _check(y, x.double() @ w.double().t(), torch.bfloat16)
    assert torch.equal(_run(x, values, words, None, False, plan, seed=5), y)   # no sum depends on the CTAs' order


@pytest.mark.parametrize("knob", ["A_SWAP", "META_HALF_SWAP", "META_ROLE_SWAP", "B_SWAP"])
def test_each_other_reading_of_the_fragments_computes_something_else(knob, monkeypatch):
    # the decode's probe on a GPU hands its finding to this kernel too: each flip must change what it computes
    w, values, words, x, _ = _case(64, 128, 9, torch.bfloat16, seed=9)
    plan = SparseGemmPlan(2, 4, 2, 2, 2)
    monkeypatch.setenv("SHUFFLEPRUNE_SPARSE_MMA_READING", knob.lower())
    try:
        y = _run(x, values, cslt_words(words), None, True, plan)
    except RuntimeError as exc:   # the emulator refused it (a metadata code that is no ordered pair)
        assert "ordered pair" in str(exc)
        return
    assert (y.double() - x.double() @ w.double().t()).abs().max() > 0.1


@pytest.mark.parametrize("knob", ["A_SWAP", "META_HALF_SWAP", "META_ROLE_SWAP", "B_SWAP"])
def test_a_probes_finding_makes_both_kernels_right_on_a_gpu_that_reads_that_way(knob, monkeypatch):
    """On an emulated GPU that reads the MMA's fragments with ``knob`` flipped, the decode and the prompt GEMM are both
    wrong as written, and both right built with that knob: what ``gpu_run.sh sparse_mma``'s probe hands to the steps
    after it (``SHUFFLEPRUNE_SPARSE_MMA_READING``) serves both kernels."""
    from shuffleprune.kernels.sparse_mma_tiles import SparseMmaPlan

    from sparse_mma_cpu import run_cpu

    w, values, words, x, bias = _case(64, 256, 9, torch.bfloat16, seed=11)
    want = x.double() @ w.double().t() + bias.double()
    decode_plan = SparseMmaPlan(nt=2, mt=1, rw=1, kw=2, ks=256, splits=1, bpre=True)
    gemm_plan = SparseGemmPlan(2, 4, 2, 2, 2)
    for tiled in (False, True):
        lw = cslt_words(words) if tiled else words
        wrong = []
        for run in (lambda: run_cpu(x, values, lw, bias, tiled, decode_plan, hardware=(knob,))[0],
                    lambda: _run(x, values, lw, bias, tiled, gemm_plan, hardware=(knob,))):
            try:
                wrong.append((run().double() - want).abs().max().item() > 0.5)
            except RuntimeError as exc:   # a metadata code that is no ordered pair
                wrong.append("ordered pair" in str(exc))
        assert wrong == [True, True]
        monkeypatch.setenv("SHUFFLEPRUNE_SPARSE_MMA_READING", knob.lower())
        _check(run_cpu(x, values, lw, bias, tiled, decode_plan, hardware=(knob,))[0], want, torch.bfloat16)
        _check(_run(x, values, lw, bias, tiled, gemm_plan, hardware=(knob,)), want, torch.bfloat16)
        monkeypatch.delenv("SHUFFLEPRUNE_SPARSE_MMA_READING")


def test_each_ldmatrix_phase_reads_32_banks():
    """The 8 rows of 16 bytes an ldmatrix phase reads lie in 8 different 16-byte bank groups, by the kernel's own
    swizzles (a staged kept-value row is 64 bytes, an input row 128: unswizzled, 2 and 8 of those rows share banks)."""
    import ctypes

    from sparse_gemm_cpu import build
    from shuffleprune.kernels.nm_sparse_gemm import kernel_defines

    lib = build(kernel_defines(SparseGemmPlan(4, 8, 2, 2, 3), torch.bfloat16, False, False, True))
    for fn in (lib.spemu_a_offset, lib.spemu_x_offset):
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int, ctypes.c_int]
    for base in range(0, 128, 16):   # an m-tile's first row
        for kk in (0, 1):
            for j in range(4):       # matrix j: rows +8 for j odd, the next 8 kept values for j >= 2
                units = {lib.spemu_a_offset(base + r + 8 * (j & 1), 2 * kk + (j >> 1)) // 8 % 8 for r in range(8)}
                assert len(units) == 8
    for base in range(0, 128, 8):    # an n-tile's first token
        for chunk in range(8):
            assert len({lib.spemu_x_offset(base + r, chunk) // 8 % 8 for r in range(8)}) == 8
    # and each row's chunks land on distinct places (a permutation of the row)
    assert sorted(lib.spemu_a_offset(5, c) for c in range(4)) == [5 * 32 + 8 * c for c in range(4)]
    assert sorted(lib.spemu_x_offset(11, c) for c in range(8)) == [11 * 64 + 8 * c for c in range(8)]


def test_the_plan_fills_the_gpu_with_the_tile_that_moves_the_fewest_bytes():
    """Each plan's grid (row blocks × token blocks × splits of K) fills 90 % of 132 SMs, and no other tile that fits
    (split to fill the GPU too) moves 10 % fewer bytes by :func:`gemm_traffic`: large prompts take the largest tile
    the GPU's shared memory holds, unsplit; short ones split K."""
    shapes = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (1024, 4096)]
    for limit in (99 * 1024, 227 * 1024):
        for (rows, cols), tokens in itertools.product(shapes, (64, 512, 2048)):
            plan = sparse_gemm_plan(tokens, rows, cols, 132, shared_limit=limit)
            gx, gy, gz = plan.grid(tokens, rows)
            assert gx * gy * gz >= 0.9 * 132 and plan.k_split(cols) * (gz - 1) < cols
            for tile in GEMM_TILES:
                other = SparseGemmPlan(*tile)
                if rows % other.bm or other.dynamic_shared() > limit or -tokens % other.bn >= other.bn // 2:
                    continue
                blocks = (tokens + other.bn - 1) // other.bn * (rows // other.bm)
                other = whole_splits(SparseGemmPlan(*tile, splits=max(1, min(cols // 256, -(-119 // blocks)))), cols)
                assert gemm_traffic(other, tokens, rows, cols) > 0.9 * gemm_traffic(plan, tokens, rows, cols)
    big = sparse_gemm_plan(2048, 4096, 4096, 132)   # 99 KB a CTA: 256 x 128's three stages (104 KB) do not fit
    assert (big.bm, big.bn, big.warps, big.splits) == (128, 128, 4, 1)
    hopper = sparse_gemm_plan(2048, 4096, 4096, 132, shared_limit=227 * 1024)
    assert (hopper.bm, hopper.bn, hopper.warps, hopper.splits) == (256, 128, 8, 1)
    assert hopper.dynamic_shared() > 99 * 1024
    with pytest.raises(ValueError, match="shared memory a CTA"):
        check_gemm_plan(hopper, 4096, 4096)
    short = sparse_gemm_plan(64, 4096, 4096, 132)   # 32 row blocks of 128 x 64 tokens, K split 4 ways
    assert (short.bm, short.bn, short.splits) == (128, 64, 4)
    assert sparse_gemm_plan(512, 1024, 4096, 132).splits > 1   # 1024 rows: the row blocks alone leave SMs idle


def test_a_plan_or_input_the_gemm_cannot_run_is_refused_in_one_line():
    with pytest.raises(ValueError, match="rows in 64s"):
        sparse_gemm_plan(64, 96, 256, 132)
    with pytest.raises(ValueError, match="whole CTAs of 128"):
        check_gemm_plan(SparseGemmPlan(4, 4, 2, 2), 192, 256)
    with pytest.raises(ValueError, match="stages=1"):
        check_gemm_plan(SparseGemmPlan(2, 4, 2, 2, stages=1), 64, 256)
    with pytest.raises(ValueError, match="fewer stages"):
        check_gemm_plan(SparseGemmPlan(4, 8, 2, 2, stages=4), 128, 256)   # 100 KB: past 99 KB, within Hopper's
    check_gemm_plan(SparseGemmPlan(4, 8, 2, 2, stages=4), 128, 256, shared_limit=227 * 1024)
    assert sparse_gemm_applies(64, 128, 256, 2, 4, torch.bfloat16)
    assert not sparse_gemm_applies(64, 128, 256, 4, 8, torch.bfloat16)
    assert not sparse_gemm_applies(64, 128, 256, 2, 4, torch.float32)
    assert not sparse_gemm_applies(64, 96, 256, 2, 4, torch.bfloat16)
    assert not sparse_gemm_applies(64, 128, 224, 2, 4, torch.bfloat16)
    _, values, words, x, bias = _case(64, 256, 40, torch.bfloat16)
    with pytest.raises(ValueError, match="16-bit weights of the input's dtype"):
        nm_sparse_gemm(x.float(), values, words)
    with pytest.raises(ValueError, match="int32 position words"):
        nm_sparse_gemm(x, values, words.long())
    with pytest.raises(ValueError, match="contiguous bias"):
        nm_sparse_gemm(x, values, words, bias.float())


def test_auto_weighs_the_sparse_gemm_from_32_tokens_where_it_runs(monkeypatch):
    from shuffleprune.deploy.sparse_linear import SparseLinear
    from shuffleprune.kernels import nm_sparse_gemm

    def layer(rows: int, cols: int, n: int, m: int, dtype: torch.dtype) -> SparseLinear:
        w = torch.randn(rows, cols)
        w = (w * nm_keep_mask(w.abs(), n, m)).to(dtype)
        values, meta = compress(w, n, m)
        return SparseLinear(values, meta, cols, n, m, torch.randperm(cols))

    x = torch.randn(32, 256, dtype=torch.bfloat16)
    plain = layer(128, 256, 2, 4, torch.bfloat16)
    assert "gemm_sparse_mma" not in plain.candidates(x)   # the CPU has no sparse MMA
    monkeypatch.setattr(nm_sparse_gemm, "sparse_gemm_available", lambda device: True)   # as on a GPU that has it
    assert "gemm_sparse_mma" in plain.candidates(x) and "gemm_sparse_mma" in plain.candidates(x.repeat(64, 1))
    assert "gemm_sparse_wgmma" not in plain.candidates(x)   # not a Hopper GPU
    monkeypatch.setattr(nm_sparse_gemm, "sparse_wgmma_available", lambda device: True)   # as on Hopper
    assert "gemm_sparse_wgmma" in plain.candidates(x) and "gemm_sparse_wgmma" in plain.candidates(x[:1])   # a decode too
    # the map read by the wgmma decode itself: a mapped layer, up to 16 tokens
    assert "gemm_sparse_wgmma_mapped" in plain.candidates(x[:16]) and "gemm_sparse_wgmma_mapped" not in plain.candidates(x[:17])
    unmapped = layer(128, 256, 2, 4, torch.bfloat16)
    unmapped.perm = None
    assert "gemm_sparse_wgmma" in unmapped.candidates(x[:1]) and "gemm_sparse_wgmma_mapped" not in unmapped.candidates(x[:1])
    assert "gemm_sparse_mma" not in plain.candidates(x[:31])   # below 32 tokens the decodes take it
    for other, inp in ((layer(96, 256, 2, 4, torch.bfloat16), x),              # rows not whole 64-row bands
                       (layer(128, 224, 2, 4, torch.bfloat16), x[:, :224]),   # columns not whole stages
                       (layer(128, 256, 4, 8, torch.bfloat16), x),            # 4:8
                       (layer(128, 256, 2, 4, torch.float32), x.float())):    # 32-bit
        assert "gemm_sparse_mma" not in other.candidates(inp) and "gemm_sparse_wgmma" not in other.candidates(inp)


@pytest.mark.parametrize("impl", ["gemm_sparse_mma", "gemm_sparse_wgmma", "gemm_sparse_wgmma_mapped"])
@pytest.mark.parametrize("tiled", [False, True])
def test_a_layer_runs_the_sparse_gemm_policy_on_its_gathered_input(monkeypatch, tiled, impl):
    """``SparseLinear.run("gemm_sparse_mma")`` (and ``"gemm_sparse_wgmma"``) hands the kernel (here its text under the
    emulator, in its form) the gathered input, the layer's one buffer in its layout and its bias, and returns the
    layer's output; ``"gemm_sparse_wgmma_mapped"`` hands it the input as it is and the layer's map."""
    from shuffleprune.deploy import impl_rules
    from shuffleprune.deploy.sparse_linear import SparseLinear
    from shuffleprune.kernels import nm_sparse_gemm as sg

    g = torch.Generator().manual_seed(3)
    w = torch.randn(128, 256, generator=g)
    w = (w * nm_keep_mask(w.abs(), 2, 4)).to(torch.bfloat16)
    values, meta = compress(w, 2, 4)
    bias = torch.randn(128, generator=g).to(torch.bfloat16)
    layer = SparseLinear(values, meta, 256, 2, 4, torch.randperm(256, generator=g), bias=bias)
    if tiled:
        layer.use_cslt_layout()
    x = torch.randn(2, 20 if impl != "gemm_sparse_wgmma_mapped" else 6, 256, generator=g).to(torch.bfloat16)
    seen = []

    def on_the_emulator(inp, values, words, bias=None, tiled=False, wgmma=False, perm=None):
        seen.append((tiled, wgmma, perm is not None))
        plan = sparse_gemm_plan(inp.numel() // inp.shape[-1], values.shape[0], 2 * values.shape[1], 4,
                                227 * 1024, wgmma=wgmma, **({"mapped": True} if perm is not None else {}))
        return _run(inp.reshape(-1, inp.shape[-1]), values, words, bias, tiled, plan,
                    perm=perm).reshape(*inp.shape[:-1], -1)

    monkeypatch.setattr(sg, "nm_sparse_gemm", on_the_emulator)
    monkeypatch.setattr(impl_rules, "sparse_gemm_applies", lambda layer, x, wgmma=False: True)
    y = layer.run(impl, x)
    assert seen == [(tiled, impl != "gemm_sparse_mma", impl == "gemm_sparse_wgmma_mapped")]
    assert y.shape == (*x.shape[:-1], 128)
    _check(y, x.double()[..., layer.perm.long()] @ w.double().t() + bias.double(), torch.bfloat16)


def test_bench_kernel_times_the_wgmma_rows_where_auto_weighs_them(monkeypatch):
    """``bench_kernel`` times ``gemm_sparse_wgmma_tiled`` at every token count (a decode up to 64), its no-map row at one
    token (the map's cost there, the 2 % target) and the decode reading the map itself to 16 tokens, and counts the
    gathered input's bytes for the first only."""
    import importlib.util
    from pathlib import Path

    scripts = Path(__file__).resolve().parents[1] / "scripts"
    monkeypatch.syspath_prepend(str(scripts))
    spec = importlib.util.spec_from_file_location("bench_kernel_wgmma", scripts / "bench_kernel.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert all(bench.runs_at("gemm_sparse_wgmma_tiled", t) for t in (1, 2, 16, 64, 512, 2048))
    assert bench.runs_at("gemm_sparse_wgmma_nomap_tiled", 1) and not bench.runs_at("gemm_sparse_wgmma_nomap_tiled", 2)
    assert bench.runs_at("gemm_sparse_wgmma_mapped_tiled", 16) and not bench.runs_at("gemm_sparse_wgmma_mapped_tiled", 17)
    assert not bench.runs_at("gemm_sparse_mma_tiled", 16) and bench.runs_at("gemm_sparse_mma_tiled", 32)
    gathered = bench.bytes_moved("gemm_sparse_wgmma_tiled", 4096, 4096, 1)
    in_kernel = bench.bytes_moved("gemm_sparse_wgmma_mapped_tiled", 4096, 4096, 1)
    assert gathered - in_kernel == 2 * 4096 * 2   # the gathered copy written and read back


@pytest.mark.parametrize("plan,mapped", [((2, 4, 2, 2, 2), False), ((1, 4, 8, 1, 3), False), ((1, 1, 4, 1, 3), True)])
def test_the_layout_probe_finds_nothing_wrong_in_a_right_kernel_and_names_what_a_misread_pairs(plan, mapped,
                                                                                                 monkeypatch):
    """``scripts/layout_probe.py``: with one-hot inputs and integer weights every output is one weight element, so a
    kernel read as its text assumes (the emulator) has no wrong output, and one run on a GPU reading the metadata's
    roles the other way round (``META_ROLE_SWAP``) has wrong outputs whose values name the columns it paired."""
    from shuffleprune.deploy.format import compress
    from shuffleprune.kernels.nm_words import position_words

    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    from layout_probe import layout_probe

    plan = SparseGemmPlan(*plan, wgmma=plan[0] == 1, mapped=mapped)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(3)).to(torch.int32) if mapped else None

    def run_on(hardware):
        def run(w, x):
            values, meta = compress(w, 2, 4)
            return _run(x, values, cslt_words(position_words(meta)), None, True, plan, hardware=hardware, perm=perm)
        return run

    right = layout_probe(run_on(()), plan.bm, 128, min(plan.bn, 128), torch.bfloat16, perm)
    assert right["rows"]["wrong"] == 0 and right["cols"]["wrong"] == 0 and right["kept_at_probe"] > 0
    try:
        misread = layout_probe(run_on(("META_ROLE_SWAP",)), plan.bm, 128, min(plan.bn, 128), torch.bfloat16, perm)
    except RuntimeError as exc:   # the emulator refused a code that is no ordered pair: also a finding
        assert "ordered pair" in str(exc)
        return
    # the roles swapped move kept values between a row's column groups, never between rows: the column probe has wrong
    # outputs (naming the column paired instead), the row probe's outputs are each 0 or the output's own row + 1
    assert misread["cols"]["wrong"] > 0
    assert all(got in (0.0, r + 1) for t, r, want, got in misread["rows"]["examples"])
    assert any(got not in (0.0, want) for t, r, want, got in misread["cols"]["examples"])
