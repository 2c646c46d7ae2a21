"""The sparse-tensor-core decode (``kernels/nm_sparse_mma.cu``) run on the CPU by its emulator, against float64."""
from __future__ import annotations

import ctypes
import itertools
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from shuffleprune.deploy.cslt_layout import cslt_words
from shuffleprune.deploy.format import compress
from shuffleprune.kernels.cuda_rtc import KernelLaunch
from shuffleprune.kernels.nm_sparse_mma import ARG_INTS, ARG_POINTERS, kernel_defines, nm_sparse_mma, sparse_mma_available
from shuffleprune.kernels.sparse_mma_tiles import (TALL_MAX_THREADS, SparseMmaPlan, check_plan, side_traffic,
                                                   sparse_mma_applies, sparse_mma_plan, tall_plan, tall_worth_weighing)
from shuffleprune.kernels.nm_words import position_words
from shuffleprune.masks import nm_keep_mask

from sparse_mma_cpu import run_cpu

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator is built by g++")


def _case(rows: int, cols: int, tokens: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    w = w * nm_keep_mask(w.abs(), 2, 4)
    w[0, :4] = 0          # a group with no non-zero: its positions are the zeros' (still an ordered pair)
    w[1, 4:8] = 0
    w[1, 5] = 1.5         # one non-zero
    w = w.to(dtype)
    values, meta = compress(w, 2, 4)
    x = torch.randn(tokens, cols, generator=g).to(dtype)
    bias = torch.randn(rows, generator=g).to(dtype)
    return w, values, position_words(meta), x, bias


def _check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    # fp32 sums of 16-bit products, then one rounding to the output's dtype
    tol = (1e-2 if dtype == torch.float16 else 3e-2) * max(1.0, ref.abs().max().item())
    assert y.dtype == dtype and not y.isnan().any()
    assert (y.double() - ref).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("rows,cols,tokens,plan", [
    (64, 256, 1, dict(nt=1, mt=1, rw=1, kw=1, ks=256, splits=1, bpre=True)),    # one warp, two steps
    (64, 384, 3, dict(nt=1, mt=1, rw=2, kw=2, ks=384, splits=1, bpre=False)),   # 2x2 warps, odd step count
    (128, 512, 8, dict(nt=1, mt=2, rw=1, kw=2, ks=256, splits=2, bpre=True)),   # split-K, two m-tiles a warp
    (64, 640, 11, dict(nt=2, mt=1, rw=1, kw=2, ks=256, splits=3, bpre=True)),   # last split shorter (128 of 256)
    (128, 256, 29, dict(nt=4, mt=2, rw=2, kw=1, ks=128, splits=2, bpre=False)),  # 4 n-tiles, tokens ragged
    (64, 256, 64, dict(nt=8, mt=1, rw=1, kw=2, ks=256, splits=1, bpre=False)),   # 64 tokens
    (64, 1152, 2, dict(nt=1, mt=1, rw=1, kw=2, ks=1152, splits=1, bpre=True, stages=3)),   # 3 steps in registers,
    (128, 896, 12, dict(nt=2, mt=2, rw=1, kw=1, ks=512, splits=2, bpre=False, stages=4)),  # 4; steps not whole rounds
    (128, 512, 40, dict(nt=8, mt=1, rw=8, kw=1, ks=256, splits=2, bpre=False)),  # a tall plan's CTA: 8 row warps
    (64, 896, 11, dict(nt=2, mt=1, rw=2, kw=1, ks=128, splits=7, bpre=False)),   # 7 splits summed 4 deep, then 3
    # the input staged in a ring of two rounds in shared memory (swizzled rows, copies landing only at their wait):
    # one K group (sums written from registers), two K groups with the last split shorter, 64 tokens over 3 rounds,
    # 3 register stages over 9 steps of 2 K groups (the last round one step)
    (128, 512, 13, dict(nt=2, mt=1, rw=4, kw=1, ks=256, splits=2, bpre=False, stage=True)),
    (64, 640, 11, dict(nt=2, mt=1, rw=2, kw=2, ks=256, splits=3, bpre=False, stage=True)),
    (64, 384, 64, dict(nt=8, mt=1, rw=4, kw=1, ks=384, splits=1, bpre=False, stage=True)),
    (64, 1152, 5, dict(nt=1, mt=1, rw=1, kw=2, ks=1152, splits=1, bpre=False, stages=3, stage=True)),
])
def test_sparse_mma_decode_matches_float64(rows, cols, tokens, plan, tiled, dtype):
    w, values, words, x, bias = _case(rows, cols, tokens, dtype)
    plan = SparseMmaPlan(**plan)
    check_plan(plan, tokens, rows, cols)
    ref = x.double() @ w.double().t()
    y, counters = run_cpu(x, values, cslt_words(words) if tiled else words, bias, tiled, plan, seed=rows + tokens)
    _check(y, ref + bias.double(), dtype)
    assert not counters.any()   # every row block's counter back at zero for the next call
    y2, _ = run_cpu(x, values, cslt_words(words) if tiled else words, None, tiled, plan, seed=7)
    _check(y2, ref, dtype)
    if plan.splits > 1:   # the last CTA adds the splits in their order: another finishing order, the same bits
        assert torch.equal(run_cpu(x, values, cslt_words(words) if tiled else words, None, tiled, plan, seed=8)[0], y2)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("rows,cols,tokens,plan", [
    (64, 256, 1, dict(nt=1, mt=1, rw=1, kw=2, ks=256, splits=1, bpre=True)),     # the map staged, input ahead
    (128, 512, 5, dict(nt=1, mt=1, rw=2, kw=2, ks=256, splits=2, bpre=False)),   # split-K: each CTA its columns
    (64, 640, 16, dict(nt=2, mt=1, rw=1, kw=2, ks=256, splits=3, bpre=True)),    # last split shorter, 16 tokens
    (64, 1024, 3, dict(nt=1, mt=1, rw=1, kw=2, ks=1024, splits=1, bpre=True, stages=3)),   # 3 stages' weights first
    (64, 512, 13, dict(nt=2, mt=1, rw=4, kw=2, ks=256, splits=2, bpre=False)),   # tall: 4 row warps share the staging
    # the map read inline by each B load (nothing staged): a step ahead with the weight, at the step, split-K over 3
    (64, 256, 1, dict(nt=1, mt=1, rw=1, kw=2, ks=256, splits=1, bpre=True, inline_map=True)),
    (128, 512, 7, dict(nt=1, mt=2, rw=1, kw=2, ks=256, splits=2, bpre=False, inline_map=True)),
    (64, 640, 16, dict(nt=2, mt=1, rw=2, kw=1, ks=256, splits=3, bpre=True, stages=3, inline_map=True)),
])
def test_sparse_mma_reading_the_map_itself_matches_float64(rows, cols, tokens, plan, tiled):
    w, values, words, x, bias = _case(rows, cols, tokens, torch.bfloat16, seed=3)
    perm = torch.randperm(cols, generator=torch.Generator().manual_seed(4)).to(torch.int32)
    plan = SparseMmaPlan(**plan)
    check_plan(plan, tokens, rows, cols, mapped=True)
    y, counters = run_cpu(x, values, cslt_words(words) if tiled else words, bias, tiled, plan, perm=perm, seed=tokens)
    _check(y, x.double()[:, perm.long()] @ w.double().t() + bias.double(), torch.bfloat16)
    assert not counters.any()


@pytest.mark.parametrize("mapped", [False, True])
def test_sparse_mma_as_a_programmatic_dependent_computes_the_same(mapped):
    w, values, words, x, bias = _case(64, 512, 3, torch.bfloat16, seed=5)
    perm = torch.randperm(512, generator=torch.Generator().manual_seed(6)).to(torch.int32) if mapped else None
    plan = SparseMmaPlan(nt=1, mt=1, rw=1, kw=2, ks=256, splits=2, bpre=True, stages=3)
    plain, _ = run_cpu(x, values, words, bias, False, plan, perm=perm)
    dependent, _ = run_cpu(x, values, words, bias, False, plan, perm=perm, pdl=True)
    assert torch.equal(plain, dependent)   # the weight loads moved before the wait: the same sums, in the same order
    xin = x if perm is None else x[:, perm.long()]
    _check(dependent, xin.double() @ w.double().t() + bias.double(), torch.bfloat16)


@pytest.mark.parametrize("knob", ["A_SWAP", "META_HALF_SWAP", "META_ROLE_SWAP", "B_SWAP"])
def test_each_other_reading_of_the_fragments_computes_something_else(knob, monkeypatch):
    # what a GPU probe flips if the first reading of the PTX ISA is wrong: under the emulator (that reading) each
    # flip must change the result, or the probe could not tell the readings apart
    w, values, words, x, bias = _case(64, 256, 3, torch.bfloat16, seed=9)
    plan = SparseMmaPlan(nt=1, mt=1, rw=1, kw=1, ks=256, splits=1, bpre=True)
    monkeypatch.setenv("SHUFFLEPRUNE_SPARSE_MMA_READING", knob.lower())
    try:
        y, _ = run_cpu(x, values, cslt_words(words), None, True, plan)
    except RuntimeError as exc:   # the emulator refused it (a metadata code that is no ordered pair)
        assert "ordered pair" in str(exc)
        return
    assert (y.double() - x.double() @ w.double().t()).abs().max() > 0.5


def test_an_unknown_reading_is_refused(monkeypatch):
    from shuffleprune.kernels.nm_sparse_mma import fragment_reading

    monkeypatch.setenv("SHUFFLEPRUNE_SPARSE_MMA_READING", "a_swap,c_swap")
    with pytest.raises(ValueError, match="C_SWAP: use some of A_SWAP"):
        fragment_reading()


def test_sparse_mma_reads_an_input_whose_rows_are_apart():
    w, values, words, x, bias = _case(64, 256, 5, torch.bfloat16)
    wide = torch.zeros(5, 256 + 64, dtype=torch.bfloat16)
    wide[:, 32:288] = x
    view = wide[:, 32:288]
    for stage in (False, True):   # staged by 8-byte copies from rows 640 bytes apart
        plan = SparseMmaPlan(nt=1, mt=1, rw=1, kw=2, ks=256, splits=1, bpre=not stage, stage=stage)
        y, _ = run_cpu(view, values, words, bias, False, plan, x_stride=view.stride(0))
        _check(y, x.double() @ w.double().t() + bias.double(), torch.bfloat16)


def test_the_default_plans_fit_the_kernel_on_the_benchmark_shapes():
    for rows, cols in [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (1024, 4096),
                       (576, 1536), (64, 128)]:
        for tokens in (1, 2, 4, 8, 16, 33, 64):
            plan = sparse_mma_plan(tokens, rows, cols, sms=132)   # raises where it would not run
            assert 8 * plan.nt >= tokens and rows % plan.rows_per_cta == 0
            assert plan.splits == -(-cols // plan.ks) and plan.ks % 128 == 0
    for cols in range(128, 20000, 128 * 7):   # reading the map: every token's columns of a CTA fit its shared memory
        for tokens in range(1, 17):
            plan = sparse_mma_plan(tokens, 4096, cols, sms=132, mapped=True)
            assert plan.staged_bytes(tokens) <= 32 * 1024 and plan.splits == -(-cols // plan.ks)


def test_the_tall_plan_shares_the_input_among_more_rows_where_its_reads_weigh():
    weight = int(1.125 * 4096 * 4096)   # bf16 values and 2-bit positions
    for tokens in (16, 64):
        base, tall = sparse_mma_plan(tokens, 4096, 4096, sms=132), tall_plan(tokens, 4096, 4096, sms=132)
        check_plan(tall, tokens, 4096, 4096)
        assert tall.rows_per_cta > base.rows_per_cta == 16 and 32 * tall.warps <= TALL_MAX_THREADS
        # the default CTA reads the input once per 16 rows: more than the weight itself from 16 tokens on
        assert side_traffic(base, tokens, 4096, 4096) > weight
        assert side_traffic(tall, tokens, 4096, 4096) < side_traffic(base, tokens, 4096, 4096) / 2.5
        assert tall_worth_weighing(tokens, 4096, 4096, sms=132)
    assert not tall_worth_weighing(1, 4096, 4096, sms=132)     # one token: 2 MB of input reads, 19 MB of weight
    assert tall_worth_weighing(1, 4096, 4096, sms=132, mapped=True)   # through a map: 1M gathers of a sector each
    for tokens in range(1, 17):   # reading the map: the staged input still fits
        plan = tall_plan(tokens, 4096, 4096, sms=132, mapped=True)
        check_plan(plan, tokens, 4096, 4096, mapped=True)
    # split-K's partial sums count: CTAs of 64 rows split 32 ways write more than they save on input reads
    many_splits = SparseMmaPlan(nt=8, mt=1, rw=4, kw=1, ks=128, splits=32, bpre=False)
    assert side_traffic(many_splits, 64, 4096, 4096) > side_traffic(SparseMmaPlan(nt=8, mt=1, rw=4, kw=1, ks=1024,
                                                                                 splits=4, bpre=False), 64, 4096, 4096)
    pinned = tall_plan(16, 4096, 4096, sms=132, rw=2, kw=2)   # both given: that plan, no search
    assert (pinned.rw, pinned.kw) == (2, 2)
    weighed = 0   # wherever auto weighs it, on rows of any multiple of 16, the tall plan is one the kernel runs
    for rows, cols, tokens, mapped in itertools.product((16, 48, 80, 1040, 4096), (128, 384, 4096, 11264),
                                                        range(1, 65), (False, True)):
        if (not mapped or tokens <= 16) and tall_worth_weighing(tokens, rows, cols, sms=132, mapped=mapped):
            check_plan(tall_plan(tokens, rows, cols, sms=132, mapped=mapped), tokens, rows, cols, mapped)
            weighed += 1
    assert weighed > 1000


def test_a_plan_the_kernel_cannot_run_is_refused_in_one_line():
    with pytest.raises(ValueError, match="take nt >= 2"):
        check_plan(SparseMmaPlan(nt=1, mt=1, rw=1, kw=1, ks=256, splits=1, bpre=True), 9, 64, 256)
    with pytest.raises(ValueError, match="whole CTAs"):
        check_plan(SparseMmaPlan(nt=1, mt=2, rw=2, kw=1, ks=256, splits=1, bpre=True), 1, 96, 256)
    with pytest.raises(ValueError, match="does not cover"):
        check_plan(SparseMmaPlan(nt=1, mt=1, rw=1, kw=1, ks=192, splits=2, bpre=True), 1, 64, 384)
    with pytest.raises(ValueError, match="shared memory"):
        check_plan(SparseMmaPlan(nt=8, mt=2, rw=1, kw=8, ks=1024, splits=1, bpre=False), 64, 64, 1024)
    with pytest.raises(ValueError, match="2, 3 or 4 steps"):
        check_plan(SparseMmaPlan(nt=1, mt=1, rw=1, kw=1, ks=256, splits=1, bpre=True, stages=5), 1, 64, 256)
    with pytest.raises(ValueError, match="bpre=False"):   # the ring's input is not there a step ahead
        check_plan(SparseMmaPlan(nt=1, mt=1, rw=1, kw=1, ks=256, splits=1, bpre=True, stage=True), 1, 64, 256)
    with pytest.raises(ValueError, match="fewer K groups"):   # 64 tokens × 4 K groups: a 128 KB ring
        check_plan(SparseMmaPlan(nt=8, mt=1, rw=1, kw=4, ks=1024, splits=1, bpre=False, stage=True), 64, 64, 1024)
    with pytest.raises(ValueError, match="take more splits"):   # 16 tokens of 2048 columns: 64 KB staged
        check_plan(SparseMmaPlan(nt=2, mt=1, rw=1, kw=4, ks=2048, splits=1, bpre=False), 16, 64, 2048, mapped=True)
    plan = sparse_mma_plan(16, 4096, 4096, sms=132, mapped=True)   # the plan splits until every token fits
    assert plan.staged_bytes(16) <= 32 * 1024 and plan.splits >= 4
    with pytest.raises(ValueError, match="stage=False"):   # the inline map stages nothing
        check_plan(SparseMmaPlan(nt=1, mt=1, rw=1, kw=1, ks=256, splits=1, bpre=False, stage=True, inline_map=True),
                   1, 64, 256, mapped=True)
    inline = sparse_mma_plan(16, 4096, 4096, sms=132, mapped=True, inline_map=True)   # no staging: no split for it,
    assert inline.dynamic_shared(16, True) == 0 and not inline.prefetch             # and no gather to prefetch over
    assert inline.splits <= plan.splits
    with pytest.raises(ValueError, match="at most 16 CTAs of 4 warps"):   # 17 × 128 threads > 2048 an SM
        check_plan(SparseMmaPlan(nt=1, mt=1, rw=1, kw=4, ks=256, splits=1, bpre=True, min_ctas=17), 1, 64, 256)


def test_the_register_bound_is_the_tiles_and_reaches_the_kernels_text():
    """1–8 tokens: at least 5 CTAs an SM (ptxas then caps the registers); 16 tokens: no bound; an override (tuning)
    sets it either way, and the kernel's text names it in __launch_bounds__ only where it is set."""
    from shuffleprune.kernels.nm_sparse_mma import kernel_source

    assert sparse_mma_plan(1, 4096, 4096, sms=132).min_ctas == 5
    assert sparse_mma_plan(8, 4096, 4096, sms=132, mapped=True, inline_map=True).min_ctas == 5
    assert sparse_mma_plan(16, 4096, 4096, sms=132).min_ctas == 0
    assert sparse_mma_plan(16, 4096, 4096, sms=132, min_ctas=6).min_ctas == 6
    assert sparse_mma_plan(1, 4096, 4096, sms=132, min_ctas=0).min_ctas == 0
    for min_ctas in (0, 5):
        plan = sparse_mma_plan(1, 4096, 4096, sms=132, min_ctas=min_ctas)
        text = kernel_source(kernel_defines(plan, torch.bfloat16, True, False, True))
        assert f"#define MIN_CTAS {min_ctas}\n" in text
        assert "__launch_bounds__(n, ctas)" in text and "SP_BOUNDS_MIN(32 * WARPS, MIN_CTAS)" in text


def test_sparse_mma_takes_only_what_it_runs():
    assert sparse_mma_applies(16, 4096, 4096, 2, 4, torch.bfloat16)
    assert not sparse_mma_applies(65, 4096, 4096, 2, 4, torch.bfloat16)       # beyond 8 n-tiles
    assert not sparse_mma_applies(1, 4096, 4096, 4, 8, torch.float16)         # 4:8: no sparse MMA
    assert not sparse_mma_applies(1, 4096, 4096, 2, 4, torch.float32)         # 32-bit: another MMA shape
    assert not sparse_mma_applies(1, 4096, 4032, 2, 4, torch.bfloat16)        # columns not whole steps of 128
    assert not sparse_mma_applies(1, 4100, 4096, 2, 4, torch.bfloat16)        # rows not whole m-tiles
    assert sparse_mma_applies(16, 4096, 4096, 2, 4, torch.bfloat16, mapped=True)
    assert not sparse_mma_applies(17, 4096, 4096, 2, 4, torch.bfloat16, mapped=True)   # the map staged: to 16
    assert not sparse_mma_available(torch.device("cpu"))
    w, values, words, x, bias = _case(64, 192, 1, torch.bfloat16)
    with pytest.raises(ValueError, match="steps of 128"):
        nm_sparse_mma(x, values, words, bias)
    w, values, words, x, bias = _case(64, 256, 1, torch.bfloat16)
    with pytest.raises(ValueError, match="int32 position words"):
        nm_sparse_mma(x, values, words.view(torch.uint8), bias)   # the export's bytes, not its words
    with pytest.raises(ValueError, match="index map as int32"):
        nm_sparse_mma(x, values, words, bias, perm=torch.arange(256))   # int64


class _RecordingDriver:
    """A CUDA driver stand-in: records cuLaunchKernel's arguments, reading the argument block as the driver does."""

    def __init__(self, status: int = 0):
        self.status, self.calls = status, []

    def cuLaunchKernel(self, func, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        pointers = [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_void_p))[0] for i in range(ARG_POINTERS)]
        ints = [ctypes.cast(params[ARG_POINTERS + i], ctypes.POINTER(ctypes.c_int))[0]
                for i in range(ARG_INTS)]
        self.calls.append(dict(func=func.value, grid=(gx, gy, gz), block=(bx, by, bz), shared=shared,
                               stream=stream.value, pointers=pointers, ints=ints, extra=extra))
        return self.status

    def cuLaunchKernelEx(self, config, func, params, extra):
        c = config._obj
        attr = c.attrs[0]
        self.calls.append(dict(func=func.value, grid=(c.grid_x, c.grid_y, c.grid_z),
                               block=(c.block_x, c.block_y, c.block_z), shared=c.shared_bytes, stream=c.stream,
                               attrs=[(attr.id, attr.value.programmatic_stream_serialization_allowed)][:c.num_attrs],
                               pointers=[ctypes.cast(params[i], ctypes.POINTER(ctypes.c_void_p))[0]
                                         for i in range(ARG_POINTERS)], extra=extra))
        return self.status

    def cuGetErrorString(self, status, out):
        out._obj.value = b"an illegal memory access was encountered"
        return 0


def test_a_bound_launch_passes_each_calls_tensors_and_integers_in_the_kernels_order():
    kernel = type("Compiled", (), {"func": ctypes.c_void_p(0xBEEF)})()
    driver = _RecordingDriver()
    launch = KernelLaunch(kernel, (64, 2, 1), (128, 1, 1), 4096, driver, ARG_POINTERS, ARG_INTS)
    for tokens in (1, 3):   # the block is built once; each call writes its own addresses and integers
        tensors = [torch.empty(4) for _ in range(ARG_POINTERS)]
        launch(tensors, [tokens, 4096, 4096, 4096 * tokens, 2048], stream=0x1234)
        call = driver.calls[-1]
        assert call["pointers"] == [t.data_ptr() for t in tensors]
        assert call["ints"] == [tokens, 4096, 4096, 4096 * tokens, 2048]
        assert (call["func"], call["grid"], call["block"], call["shared"], call["stream"], call["extra"]) == \
            (0xBEEF, (64, 2, 1), (128, 1, 1), 4096, 0x1234, None)
    dependent = KernelLaunch(kernel, (32, 4, 1), (256, 1, 1), 0, driver, ARG_POINTERS, ARG_INTS, pdl=True)
    tensors = [torch.empty(2) for _ in range(ARG_POINTERS)]
    dependent(tensors, [1, 4096, 4096, 4096, 1024], stream=0x99)
    call = driver.calls[-1]   # cuLaunchKernelEx with programmatic stream serialization allowed (attribute 6)
    assert (call["grid"], call["block"], call["shared"], call["stream"], call["attrs"]) == \
        ((32, 4, 1), (256, 1, 1), 0, 0x99, [(6, 1)])
    assert call["pointers"] == [t.data_ptr() for t in tensors]
    assert ctypes.sizeof(type(dependent.attribute)) == 72   # cuda.h's CUlaunchAttribute: id, pad, a 64-byte union
    failing = KernelLaunch(kernel, (1, 1, 1), (32, 1, 1), 0, _RecordingDriver(status=700), ARG_POINTERS, ARG_INTS)
    with pytest.raises(RuntimeError, match="an illegal memory access was encountered"):   # a DeviceFault's words
        failing([torch.empty(1)] * ARG_POINTERS, [1, 16, 128, 128, 128], stream=0)


class _ContextDriver:
    """The driver's context calls: ``current`` is the context bound to this thread (None: none), ``devices`` maps
    each context to its GPU; records what was retained, set current and loaded."""

    def __init__(self, current=None, devices=None, status=0):
        self.current, self.devices, self.status, self.calls = current, devices or {}, status, []

    def cuDeviceGet(self, out, ordinal):
        out._obj.value = ordinal
        return self.status

    def cuCtxGetCurrent(self, out):
        out._obj.value = self.current
        return 0

    def cuCtxGetDevice(self, out):
        out._obj.value = self.devices[self.current]
        return 0

    def cuDevicePrimaryCtxRetain(self, out, device):
        out._obj.value = 0x1000 + device.value
        self.devices[out._obj.value] = device.value
        self.calls.append(("retain", device.value))
        return 0

    def cuCtxSetCurrent(self, ctx):
        self.current = ctx.value
        self.calls.append(("set", ctx.value))
        return 0

    def cuModuleLoadData(self, module, cubin):
        self.calls.append(("load", self.current))
        module._obj.value = 0x77
        return 0

    def cuModuleGetFunction(self, func, module, name):
        func._obj.value = 0x88
        return 0


def test_the_driver_loads_and_launches_in_the_gpus_primary_context_on_any_thread(monkeypatch):
    """A thread whose CUDA work went only through PyTorch may have no context bound: the driver's module load and
    launch then fail with CUDA_ERROR_INVALID_CONTEXT (201) unless the primary context is made current first."""
    import contextlib

    from shuffleprune.kernels import cuda_rtc

    unbound = _ContextDriver()                        # no context on this thread: GPU 1's primary one bound, then loaded
    monkeypatch.setattr(cuda_rtc, "driver", lambda: unbound)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    kernel = cuda_rtc.load_cubin(b"\x7fELF", "k", 1)
    assert unbound.calls == [("retain", 1), ("set", 0x1001), ("load", 0x1001)] and kernel.func.value == 0x88
    bound = _ContextDriver(current=0x5, devices={0x5: 1})   # already bound to that GPU: left as it is
    cuda_rtc.bind_context(bound, 1)
    assert bound.calls == []
    other = _ContextDriver(current=0x5, devices={0x5: 0})   # bound to another GPU: this one's made current
    cuda_rtc.bind_context(other, 1)
    assert other.calls == [("retain", 1), ("set", 0x1001)]
    cuda_rtc.bind_context(no_gpu := _ContextDriver(status=101), 3)   # no such GPU: the load says so itself
    assert no_gpu.calls == []

    class LaunchDriver(_RecordingDriver, _ContextDriver):   # refuses a launch until a context is bound
        def __init__(self):
            _RecordingDriver.__init__(self)
            self.current, self.devices = None, {}

        def cuLaunchKernel(self, *args):
            _RecordingDriver.cuLaunchKernel(self, *args)
            return 0 if self.current else cuda_rtc.CUDA_ERROR_INVALID_CONTEXT

    driver = LaunchDriver()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    launch = KernelLaunch(type("Compiled", (), {"func": ctypes.c_void_p(0xBEEF)})(), (1, 1, 1), (32, 1, 1), 0,
                          driver, ARG_POINTERS, ARG_INTS)
    launch([torch.empty(1)] * ARG_POINTERS, [1, 16, 128, 128, 128], stream=0)   # bound, launched again: no error
    assert len([c for c in driver.calls if isinstance(c, dict)]) == 2 and ("set", 0x1000) in driver.calls
    launch([torch.empty(1)] * ARG_POINTERS, [1, 16, 128, 128, 128], stream=0)   # bound now: one launch
    assert len([c for c in driver.calls if isinstance(c, dict)]) == 3


def test_auto_weighs_the_sparse_mma_decode_where_it_runs(monkeypatch):
    from shuffleprune.deploy.sparse_linear import SparseLinear
    from shuffleprune.kernels import nm_sparse_mma

    def layer(cols: int, n: int, m: int, dtype: torch.dtype, perm: bool) -> SparseLinear:
        w = torch.randn(64, cols)
        w = (w * nm_keep_mask(w.abs(), n, m)).to(dtype)
        values, meta = compress(w, n, m)
        return SparseLinear(values, meta, cols, n, m, torch.randperm(cols) if perm else None)

    x = torch.randn(1, 256, dtype=torch.bfloat16)
    mapped = layer(256, 2, 4, torch.bfloat16, True)
    assert not any(c.startswith("decode_sparse_mma") for c in mapped.candidates(x))   # the CPU has no sparse MMA
    monkeypatch.setattr(nm_sparse_mma, "sparse_mma_available", lambda device: True)   # as on a GPU that has it
    weighed = set(mapped.candidates(x))
    assert {"decode_sparse_mma", "decode_sparse_mma_mapped", "decode_sparse_mma_mapped_inline"} <= weighed
    # one token: the input read per 16 rows is small beside the weight, the map's gathers value by value are not
    assert "decode_sparse_mma_tall" not in mapped.candidates(x) and "decode_sparse_mma_mapped_tall" in mapped.candidates(x)
    assert {"decode_sparse_mma_tall", "decode_sparse_mma_mapped_tall"} <= set(mapped.candidates(x.repeat(16, 1)))
    many = x.repeat(17, 1)   # 17 tokens: past the map's staging, not past the kernel
    assert "decode_sparse_mma" in mapped.candidates(many)
    assert not {"decode_sparse_mma_mapped", "decode_sparse_mma_mapped_inline"} & set(mapped.candidates(many))
    assert not {"decode_sparse_mma", "decode_sparse_mma_mapped"} & set(mapped.candidates(x.repeat(65, 1)))
    plain = layer(256, 2, 4, torch.bfloat16, False)
    assert "decode_sparse_mma" in plain.candidates(x) and "decode_sparse_mma_mapped" not in plain.candidates(x)
    for other, inp in ((layer(192, 2, 4, torch.bfloat16, False), x[:, :192]),   # columns not whole steps
                       (layer(256, 4, 8, torch.bfloat16, False), x),             # 4:8
                       (layer(256, 2, 4, torch.float32, False), x.float())):      # 32-bit
        assert not any(c.startswith("decode_sparse_mma") for c in other.candidates(inp))


def test_a_variant_that_compiles_nowhere_is_refused_once_then_at_once(monkeypatch):
    from shuffleprune.kernels import cuda_rtc, nm_sparse_mma as sp

    tries = []

    def own(source, name, device_index, arch_specific=False):   # no NVRTC here: what a machine without one answers
        tries.append(device_index)
        raise OSError("libnvrtc.so: cannot open shared object file")

    monkeypatch.setattr(cuda_rtc, "compile_own", own)
    monkeypatch.setattr(cuda_rtc, "_FAILED", {})
    defines = tuple(sp.kernel_defines(SparseMmaPlan(nt=1, mt=1, rw=1, kw=1, ks=128, splits=1, bpre=True),
                                      torch.bfloat16, False, False, True).items()) + (("TEST_ONLY", 1),)
    for _ in range(2):   # a RuntimeError both times (auto leaves the candidate out); NVRTC asked only the first
        with pytest.raises(RuntimeError, match="nm_sparse_mma did not compile: .*own NVRTC: OSError"):
            sp._compiled(defines, 0)
    assert tries == [0]


def test_an_architecture_specific_kernel_is_compiled_for_its_target_and_not_by_pytorch(monkeypatch):
    """The wgmma form needs ``sm_90a``: NVRTC is asked for the architecture-specific target, and where that fails
    PyTorch's own NVRTC call (which compiles for the plain target) is not tried."""
    from shuffleprune.kernels import cuda_rtc

    asked, pytorch = [], []

    def own(source, name, device_index, arch_specific=False):
        asked.append(arch_specific)
        raise RuntimeError("NVRTC did not compile it")

    monkeypatch.setattr(cuda_rtc, "compile_own", own)
    monkeypatch.setattr(cuda_rtc, "_FAILED", {})
    monkeypatch.setattr(torch.cuda, "_compile_kernel", lambda *a, **k: pytorch.append(a), raising=False)
    with pytest.raises(RuntimeError, match="did not compile: own NVRTC") as err:
        cuda_rtc.compile_cuda("source", "kernel", 0, key="wgmma", arch_specific=True)
    assert asked == [True] and pytorch == [] and "_compile_kernel" not in str(err.value)


def test_nvrtc_is_loaded_after_its_builtins_library_from_the_same_folder(monkeypatch, tmp_path):
    """NVRTC 13.0.88's libnvrtc has no run path: its builtins must already be loaded, or every compile fails."""
    from shuffleprune.kernels import cuda_rtc

    for name in ("libnvrtc.so.13", "libnvrtc-builtins.so.13.0", "libnvrtc-builtins.alt.so.13.0", "libnvrtc.alt.so.13"):
        (tmp_path / name).write_bytes(b"")
    loaded = []

    def cdll(path, mode=0):
        loaded.append((os.path.basename(path), mode))
        if "builtins" in path and os.environ.get("_FAIL_BUILTINS"):
            raise OSError("cannot load")
        return SimpleNamespace(path=path)

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    nvrtc = cuda_rtc.load_nvrtc(str(tmp_path / "libnvrtc.so.13"))
    assert loaded == [("libnvrtc-builtins.so.13.0", ctypes.RTLD_GLOBAL), ("libnvrtc.so.13", 0)]
    assert nvrtc.lib.path == str(tmp_path / "libnvrtc.so.13")
    loaded.clear()
    monkeypatch.setenv("_FAIL_BUILTINS", "1")   # a builtins library that cannot load leaves the compile to say so
    cuda_rtc.load_nvrtc(str(tmp_path / "libnvrtc.so.13"))
    assert [name for name, _ in loaded] == ["libnvrtc-builtins.so.13.0", "libnvrtc.so.13"]
    loaded.clear()
    cuda_rtc.load_nvrtc("libnvrtc.so")   # a bare name (the system's): nothing beside it to look for
    assert loaded == [("libnvrtc.so", 0)]


def test_a_gpu_runs_log_says_which_nvrtc_compiles_and_why_not(monkeypatch):
    from shuffleprune.kernels import cuda_rtc

    class Nvrtc:
        def __init__(self, ok):
            self.ok = ok

        def version(self):
            return "13.0"

        def compile(self, source, arch, report=False):
            return self.ok, "nvrtc: error: failed to open libnvrtc-builtins.so.13.0.\n", b""

    monkeypatch.setattr(cuda_rtc, "find_nvrtc", lambda: "/site/nvidia/cu13/lib/libnvrtc.so.13")
    monkeypatch.setattr(cuda_rtc, "load_nvrtc", lambda path: Nvrtc(True))
    assert cuda_rtc.nvrtc_status() == "nvrtc 13.0 /site/nvidia/cu13/lib/libnvrtc.so.13: compiles"
    monkeypatch.setattr(cuda_rtc, "load_nvrtc", lambda path: Nvrtc(False))
    assert cuda_rtc.nvrtc_status().endswith("FAILS: nvrtc: error: failed to open libnvrtc-builtins.so.13.0.")

    def missing(path):
        raise OSError(f"{path}: cannot open shared object file")

    monkeypatch.setattr(cuda_rtc, "load_nvrtc", missing)
    status = cuda_rtc.nvrtc_status()
    assert status.startswith("nvrtc: none loadable (/site/nvidia/cu13/lib/libnvrtc.so.13: ") and "\n" not in status


def test_compile_own_asks_nvrtc_for_the_architecture_specific_target(monkeypatch, tmp_path):
    from shuffleprune.kernels import cuda_rtc

    archs = []

    class Nvrtc:   # records the target, compiles nothing
        def version(self):
            return "13.5"

        def compile(self, source, arch, report=False):
            archs.append(arch)
            return False, "no", b""

    monkeypatch.setattr(cuda_rtc, "own_nvrtc", lambda: Nvrtc())
    monkeypatch.setattr(cuda_rtc, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(cuda_rtc, "cubin_path", lambda source, name, arch, version: tmp_path / f"{name}-{arch}")
    for arch_specific in (False, True):
        with pytest.raises(RuntimeError, match="NVRTC did not compile"):
            cuda_rtc.compile_own("source", "kernel", 0, arch_specific)
    assert archs == ["sm_90", "sm_90a"]


@pytest.mark.parametrize("impl", ["decode_sparse_mma", "decode_sparse_mma_tall", "decode_sparse_mma_mapped",
                                  "decode_sparse_mma_mapped_tall", "decode_sparse_mma_mapped_inline"])
def test_a_layer_runs_each_sparse_mma_policy_with_its_plan(monkeypatch, impl):
    """``SparseLinear.run`` hands each sparse-MMA policy its input (gathered, or with the map) and plan; the kernel
    (here its text under the emulator, 4 SMs) computes the layer's output with either plan."""
    from shuffleprune.deploy import impl_rules
    from shuffleprune.deploy.sparse_linear import SparseLinear
    from shuffleprune.kernels import nm_sparse_mma as sp

    g = torch.Generator().manual_seed(9)
    w = torch.randn(128, 512, generator=g)
    w = (w * nm_keep_mask(w.abs(), 2, 4)).to(torch.bfloat16)
    values, meta = compress(w, 2, 4)
    layer = SparseLinear(values, meta, 512, 2, 4, torch.randperm(512, generator=g))
    x = torch.randn(12, 512, generator=g).to(torch.bfloat16)
    launched = []

    def on_the_emulator(inp, values, words, bias=None, tiled=False, perm=None, pdl=False, tall=False, **override):
        tokens, rows, cols = inp.shape[0], values.shape[0], 2 * values.shape[1]
        plan = (tall_plan if tall else sparse_mma_plan)(tokens, rows, cols, 4, mapped=perm is not None, **override)
        launched.append((tall, perm is not None, plan.rw, plan.inline_map))
        return run_cpu(inp, values, words, bias, tiled, plan, perm=None if perm is None else perm.to(torch.int32))[0]

    monkeypatch.setattr(sp, "nm_sparse_mma", on_the_emulator)
    monkeypatch.setattr(impl_rules, "sparse_mma_applies", lambda layer, x, mapped=False: True)
    y = layer.run(impl, x)
    tall, mapped, rw, inline = launched[-1]
    assert (tall, mapped, inline) == (impl.endswith("_tall"), "mapped" in impl, impl.endswith("_inline"))
    assert (rw > 1) == tall   # the tall plan's CTAs hold more rows here
    _check(y, x.double()[:, layer.perm.long()] @ w.double().t(), torch.bfloat16)


def test_a_compiled_variant_is_kept_on_disk_and_loaded_without_compiling(monkeypatch, tmp_path):
    """``compile_own`` keeps NVRTC's cubin under the cache folder; a later process (here: the cache of compiled
    variants forgotten) loads it without compiling, and a changed source, GPU or NVRTC compiles anew."""
    from shuffleprune.kernels import cuda_rtc

    monkeypatch.setenv("SHUFFLEPRUNE_CACHE", str(tmp_path))
    compiled, loaded = [], []

    class FakeNvrtc:
        version_text = "13.0"

        def version(self):
            return self.version_text

        def compile(self, source, arch, report=False):
            compiled.append((source, arch))
            return True, "", b"\x7fELF" + source.encode()

    nvrtc = FakeNvrtc()
    monkeypatch.setattr(cuda_rtc, "own_nvrtc", lambda: nvrtc)
    monkeypatch.setattr(cuda_rtc, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(cuda_rtc, "load_cubin", lambda cubin, name, index: loaded.append(cubin) or cubin)
    assert cuda_rtc.compile_own("text a", "k", 0) == b"\x7fELFtext a"
    assert cuda_rtc.compile_own("text a", "k", 0) == b"\x7fELFtext a"   # from disk
    assert compiled == [("text a", "sm_90")] and len(loaded) == 2
    kept = cuda_rtc.cubin_path("text a", "k", "sm_90", "13.0")
    assert kept.parent == tmp_path / "cuda_kernels" and kept.read_bytes() == b"\x7fELFtext a"
    cuda_rtc.compile_own("text b", "k", 0)                        # another source
    monkeypatch.setattr(cuda_rtc, "_capability", lambda index: (8, 0))
    cuda_rtc.compile_own("text a", "k", 0)                        # another GPU
    nvrtc.version_text = "13.1"
    monkeypatch.setattr(cuda_rtc, "_capability", lambda index: (9, 0))
    cuda_rtc.compile_own("text a", "k", 0)                        # another NVRTC
    assert compiled[1:] == [("text b", "sm_90"), ("text a", "sm_80"), ("text a", "sm_90")]
    kept.write_bytes(b"half a fi")                                 # a damaged file: compiled again, rewritten
    nvrtc.version_text = "13.0"
    cuda_rtc.compile_own("text a", "k", 0)
    assert compiled[-1] == ("text a", "sm_90") and kept.read_bytes() == b"\x7fELFtext a"
    blocked = tmp_path / "a file, not a folder"                   # no cache folder can be made: compiled, loaded
    blocked.write_text("")
    monkeypatch.setenv("SHUFFLEPRUNE_CACHE", str(blocked / "cache"))
    assert cuda_rtc.compile_own("text c", "k", 0) == b"\x7fELFtext c" and compiled[-1] == ("text c", "sm_90")


def test_a_warps_loads_from_the_staged_input_hit_32_banks():
    """Every B load of a warp from a staged input (the ring, or the map's staging) reads 32 different banks, by the
    kernel's own column assignment and swizzle (a staged row's length is a multiple of 128 columns, 64 words, so
    each row starts at bank 0); without the swizzle 8 token rows share 4 banks."""
    from sparse_mma_cpu import build

    lib = build(kernel_defines(SparseMmaPlan(nt=8, mt=1, rw=1, kw=1, ks=128, splits=1, bpre=False, stage=True),
                               torch.bfloat16, False, False, True))
    for n, block, half, reg in itertools.product(range(8), range(2), range(2), range(4)):
        words = [lib.spemu_staged_word(n, block, half, reg, lane) for lane in range(32)]
        assert len({w % 32 for w in words}) == 32, (n, block, half, reg, words)
        assert all(0 <= w < 64 * (block + 1) and w >= 32 * block for w in words)   # inside its 64-column block


@pytest.mark.parametrize("b_swap", [0, 1])
def test_the_loads_split_each_b_column_as_the_layout_assigns_it(b_swap):
    """A B load's address is the lane's own column plus a constant of its register (global memory), or three parts
    with no bit in common (a staged row): for every lane, register and step, the same column and staged word as the
    layout's own assignment (sp_b_column, sp_staged_word), under either reading of B's registers."""
    from sparse_mma_cpu import build

    defines = kernel_defines(SparseMmaPlan(nt=2, mt=1, rw=1, kw=1, ks=256, splits=1, bpre=False), torch.bfloat16,
                             False, False, True)
    lib = build({**defines, "B_SWAP": b_swap})
    for c0, block, half, reg, lane in itertools.product((0, 128, 1024), range(2), range(2), range(4), range(32)):
        column = lib.spemu_b_column(c0, block, half, reg, lane)
        assert lib.spemu_b_column_split(c0, block, half, reg, lane) == column
        for token in (lane >> 2, 8 + (lane >> 2), 13):
            assert lib.spemu_staged_b_word(token, c0, block, half, reg, lane) == lib.spemu_staged_word_of(token, column)


@pytest.mark.parametrize("budget_rows", [None, 1])
def test_a_mapped_plan_asks_its_further_values_into_l2_before_it_gathers(monkeypatch, budget_rows):
    """Reading a map, each CTA prefetches its rows' kept values past the steps its registers already hold, line by
    line, within the launch's budget (here the whole weight, then one line a row)."""
    from shuffleprune.kernels import nm_sparse_mma as sp
    from sparse_mma_cpu import prefetched

    rows, cols, tokens = 64, 1024, 3
    w, values, words, x, bias = _case(rows, cols, tokens, torch.bfloat16, seed=11)
    perm = torch.randperm(cols, generator=torch.Generator().manual_seed(12)).to(torch.int32)
    plan = SparseMmaPlan(nt=1, mt=1, rw=2, kw=1, ks=512, splits=2, bpre=True, prefetch=True)   # 4 CTAs
    if budget_rows is not None:   # one 128-byte line a row over the whole grid
        monkeypatch.setattr(sp, "PREFETCH_BUDGET", budget_rows * 128 * rows * plan.splits)
    y, _ = run_cpu(x, values, words, bias, False, plan, perm=perm)
    _check(y, x.double()[:, perm.long()] @ w.double().t() + bias.double(), torch.bfloat16)
    got = prefetched(plan, x, values, False, True)
    # each CTA: its 32 rows, columns from the first step past the one in registers (128 on) to its end (512):
    # 384 columns = 192 values = 3 lines of 64 a row; with the budget, the first line only
    lines = [0] if budget_rows else [0, 1, 2]
    want = sorted(r * (cols // 2) + split * 256 + 64 + 64 * line
                  for r in range(rows) for split in range(plan.splits) for line in lines)
    assert got == want
