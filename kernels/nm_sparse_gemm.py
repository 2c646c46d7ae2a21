"""The 2:4 GEMM on the sparse tensor cores for prompts: ``kernels/nm_sparse_gemm.cu``, compiled by NVRTC at its first
call on a GPU, like the decode (:mod:`.nm_sparse_mma`, whose device prelude, MMA and fragment readings it shares).

From a few hundred tokens a dense layer is bound by its MMAs, not by its weight's bytes, and every path of this
runtime but cuSPARSELt did the dense FLOPs after expanding the weight, so none could beat cuBLAS there
(``bench_kernel.json``, H200: ``auto`` at 0.56–0.59× cuBLAS at 512 tokens in the export's layout). ``mma.sp`` does
half the MMAs' work for the same result. The decode's CTAs hold each weight byte in registers once and read the
input per warp, which at 512 tokens would bind them to their input loads; here the kept values, position words and
the input's tile are copied into shared memory a stage of 64 columns at a time (``cp.async``,
:data:`SparseGemmPlan.stages` in flight) and each fragment read there (``ldmatrix``) serves a warp's other tiles: a
B fragment its ``mt`` m-tiles, an A fragment its ``nt`` n-tiles. The layer's own buffer is read as it is, in either
layout. The same text runs on the CPU under the tests' emulator.

On Hopper a plan may take ``wgmma``: the same CTA with Hopper's own asynchronous ``wgmma.mma_async.sp`` in place of
``mma.sp`` (compiled for ``sm_90a``). ``mma.sp`` is the instruction set Ampere brought; on Hopper cuBLAS reaches its
dense rate through ``wgmma``, which ``mma`` does not match (``scripts/mma_ceiling.py`` measures both), so only the
sparse ``wgmma`` can be expected to pass cuBLAS by its factor of two. Each warpgroup multiplies 64 rows' kept values by
the stage's input tile, both read by the tensor cores from shared memory themselves (the stage's tiles are already
laid out in ``wgmma``'s 64- and 128-byte swizzles), and its wgmmas run on through the next step's barrier and
copies. The tests' emulator reads a ``wgmma``'s operands when it is issued and requires them unchanged, with no copy
issued into them, until its group retires: a slot copied into too early, read before it landed, or metadata written
while one runs is an error there.
"""
from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shuffleprune.kernels.cuda_rtc import CudaSource, KernelLaunch, allow_dynamic_shared, compile_cuda, driver
from shuffleprune.kernels.gpu import SMEM_PER_BLOCK_OPTIN, _capability, cdiv, smem_per_block_optin
from shuffleprune.kernels.nm_sparse_mma import (DEVICE_PRELUDE, FRAGMENT_KNOBS, device_index,
                                                fragment_reading, ordered_metadata, split_k_workspace,
                                                sparse_mma_available, stream_handle)
from shuffleprune.kernels.nm_sparse_mma import kernel_source as sparse_mma_source
from shuffleprune.kernels.sparse_mma_tiles import SHARED_LIMIT

SOURCE = Path(__file__).with_name("nm_sparse_gemm.cu")
KERNEL_NAME = "nm_sparse_gemm"
BK = 64                        # columns a stage copies (two k32 MMAs)
ARG_POINTERS, ARG_INTS = 8, 5  # x, values, words, bias, y, partial, counters, perm; T, R, C, xs, KS
MIN_SPLIT_STAGES = 4           # a split of K keeps at least this many stages (its pipeline's fill is worth it)


@dataclass(frozen=True)
class SparseGemmPlan:
    """A launch: ``wm`` × ``wn`` warps a CTA, each holding ``mt`` m-tiles of 16 rows × ``nt`` n-tiles of 8 tokens
    (a CTA: ``bm`` rows × ``bn`` tokens), ``stages`` stages of :data:`BK` columns in flight in shared memory,
    ``splits`` CTAs along K (fp32 partial sums, added by the last CTA of a tile in split order)."""
    mt: int
    nt: int
    wm: int
    wn: int
    stages: int = 3
    splits: int = 1
    wgmma: bool = False
    mapped: bool = False

    @property
    def warps(self) -> int:
        return self.wm * self.wn

    @property
    def bm(self) -> int:
        return self.wm * self.mt * 16

    @property
    def bn(self) -> int:
        return self.wn * self.nt * 8

    def grid(self, tokens: int, rows: int) -> tuple[int, int, int]:
        """Token blocks along x (a row block's token blocks run side by side, sharing its weight in L2), row blocks
        along y, splits of K along z."""
        return cdiv(tokens, self.bn), rows // self.bm, self.splits

    def k_split(self, cols: int) -> int:
        """The columns each split takes (whole stages; the last split may take fewer)."""
        return cdiv(cdiv(cols, BK), self.splits) * BK

    def stage_bytes(self) -> int:
        """One stage: kept values (64 bytes a row), the input (128 bytes a token; none where ``mapped``: staged apart)
        and position words (8 bytes a row); under ``wgmma`` rounded up to 1024 bytes (each stage's input tile on the
        swizzle's period)."""
        raw = self.bm * 64 + (0 if self.mapped else self.bn * 128) + self.bm * 8
        return cdiv(raw, WGMMA_ALIGN) * WGMMA_ALIGN if self.wgmma else raw

    def staged_bytes(self, cols: int) -> int:
        """A ``mapped`` plan's input gathered through the map, once: its split's stages × ``bn`` tokens × 128 bytes."""
        return self.k_split(cols) // BK * self.bn * 128 if self.mapped else 0

    def dynamic_shared(self, cols: int | None = None) -> int:
        """The stages (and a ``mapped`` plan's staged input, which needs the layer's ``cols``), or the output tile
        (``bn`` tokens × ``bm + 8`` 16-bit sums) after them, whichever is more (under ``wgmma`` with
        :data:`WGMMA_ALIGN` bytes to spare, the kernel aligning its stages itself)."""
        if self.mapped and cols is None:
            raise ValueError("a mapped plan's shared memory holds its split's input: give the layer's columns")
        pipeline = self.stages * self.stage_bytes() + (self.staged_bytes(cols) if self.mapped else 0)
        return max(pipeline, self.bn * (self.bm + 8) * 2) + (WGMMA_ALIGN if self.wgmma else 0)


# the tiles tried, largest first: (mt, nt, wm, wn). A warp tile of 64 rows × 64 tokens reads 192 bytes of shared
# memory per MMA (A and B fragments), 32 × 32 reads 512: the larger tiles leave the MMAs, not the shared-memory reads,
# to bind, where the grid still fills the GPU. A CTA's stage moves (bm · 72 + bn · 128) bytes from L2 for
# bm · bn · 128 dense-equivalent FLOPs: 256 × 128 (8 warps; 3 stages take 104 KB, Hopper's opt-in) needs a third less
# L2 bandwidth per FLOP than 128 × 128, which at a sparse MMA's rate could otherwise bind
GEMM_TILES = ((4, 8, 4, 2), (4, 8, 2, 2), (4, 4, 2, 4), (2, 8, 2, 2), (4, 4, 2, 2), (2, 4, 2, 2))
DEFAULT_STAGES = 3
# the wgmma tiles (mt, nt, wm, wn): warpgroups of 64 rows along M (mt 1, wn 1), each wgmma m64n(8·nt)k32 over the CTA's
# tokens; 128 x 256 holds 128 fp32 sums a thread (one CTA an SM), 128 x 128 64 (two). A step's wgmmas run on through
# the next step's barrier and copies, so a slot is copied into two steps after its own: STAGES - 2 stages ahead
WGMMA_TILES = ((1, 32, 8, 1), (1, 16, 8, 1), (1, 16, 4, 1), (1, 8, 8, 1), (1, 8, 4, 1))
WGMMA_STAGES = 4
WGMMA_ALIGN = 1024   # the 128-byte swizzle's period: each stage's input tile starts on it
# up to this many tokens a layer reads far more weight than it computes (at 64 tokens, 114 dense-equivalent flops a
# weight byte against an H200's ~200 at its bandwidth): the wgmma form then runs as a decode, on CTAs of 64 rows × the
# fewest tokens of 8, 16, 32 or 64 that hold the input (m64n8 at one token: the MMA's waste costs nothing where the
# weight's bytes bound), K split until the grid holds DECODE_CTAS_PER_SM CTAs an SM, so enough stages of weight are
# in flight (each CTA keeps STAGES - 2 ahead, 4.6 KB a stage) to cover DRAM's latency at full bandwidth
WGMMA_DECODE_MAX_TOKENS = 64
WGMMA_DECODE_TILES = {8: (1, 1, 4, 1), 16: (1, 2, 4, 1), 32: (1, 4, 4, 1), 64: (1, 8, 4, 1)}
DECODE_CTAS_PER_SM = 4
# the map read in the kernel (``mapped``): up to this many tokens (16 a CTA), its split's input staged in shared memory
# once, at most MAPPED_STAGED_LIMIT bytes (K split further where a split's columns would take more)
WGMMA_MAPPED_MAX_TOKENS = 16
MAPPED_STAGED_LIMIT = 32 * 1024
FILL = 0.9   # the share of the multiprocessors a tile's grid must reach (128 CTAs of 128 x 128 on 132 do)


def sparse_gemm_applies(tokens: int, rows: int, cols: int, n: int, m: int, dtype: torch.dtype) -> bool:
    """Whether the GEMM takes this layer and input: 2:4, 16-bit, rows in 64-row bands, columns in stages of 64."""
    return ((n, m) == (2, 4) and dtype in (torch.float16, torch.bfloat16) and tokens >= 1 and rows % 64 == 0
            and cols % BK == 0)


def gemm_traffic(plan: SparseGemmPlan, tokens: int, rows: int, cols: int) -> int:
    """The bytes a launch moves from L2 into its CTAs, by count: the weight (values and position words, 1.125 bytes a
    dense element) once per token block, the input once per row block (tokens past the end are zero-filled, not
    read), and split-K's fp32 partial sums written and read back."""
    token_blocks, row_blocks = cdiv(tokens, plan.bn), rows // plan.bm
    partials = 2 * plan.splits * tokens * rows * 4 if plan.splits > 1 else 0
    return int(rows * cols * 1.125) * token_blocks + tokens * cols * 2 * row_blocks + partials


def sparse_gemm_plan(tokens: int, rows: int, cols: int, sms: int, shared_limit: int = SMEM_PER_BLOCK_OPTIN,
                     wgmma: bool = False, **override) -> SparseGemmPlan:
    """Of the tiles of :data:`GEMM_TILES` (``wgmma``: :data:`WGMMA_TILES`) whose stages fit ``shared_limit`` bytes
    (the GPU's opt-in limit a CTA) and that pad fewer than half a token block (where one does), each split along K
    until the grid reaches :data:`FILL` of the ``sms`` multiprocessors (each split keeping :data:`MIN_SPLIT_STAGES`
    stages): the one moving the fewest bytes (:func:`gemm_traffic`) of those whose grid fills the GPU, else the one
    with the most CTAs. Under ``wgmma``, up to :data:`WGMMA_DECODE_MAX_TOKENS` tokens, the decode's tile of
    :data:`WGMMA_DECODE_TILES` instead, split as :func:`filling_splits` splits it. ``override`` sets any field
    (tuning)."""
    if override.get("mapped"):
        check_map_reader(tokens, wgmma)
    if wgmma and tokens <= WGMMA_DECODE_MAX_TOKENS:
        bn = next(n for n in sorted(WGMMA_DECODE_TILES) if n >= tokens)
        mapped = bool(override.pop("mapped", False))
        plan = filling_splits(SparseGemmPlan(*WGMMA_DECODE_TILES[bn], stages=WGMMA_STAGES, wgmma=True, mapped=mapped),
                              tokens, rows, cols, sms)
        plan = staged_within_limit(plan, cols)
        plan = whole_splits(SparseGemmPlan(**{**asdict(plan), **override}), cols)
        check_gemm_plan(plan, rows, cols, shared_limit)
        return plan
    tiles = ([SparseGemmPlan(*tile, stages=WGMMA_STAGES, wgmma=True) for tile in WGMMA_TILES] if wgmma else
             [SparseGemmPlan(*tile, stages=DEFAULT_STAGES) for tile in GEMM_TILES])
    fits = [p for p in tiles if rows % p.bm == 0 and p.dynamic_shared(cols) <= shared_limit]
    if not fits:
        raise ValueError(f"{rows} rows are not whole 64-row blocks: the sparse GEMM takes rows in 64s")
    unpadded = [p for p in fits if -tokens % p.bn < p.bn // 2]
    fits = unpadded or fits
    plans = [filling_splits(p, tokens, rows, cols, sms) for p in fits]

    def cost(p: SparseGemmPlan) -> tuple:   # bytes moved, within 10 %; then the MMAs spent on padding tokens
        return round(math.log(gemm_traffic(p, tokens, rows, cols)) / math.log(1.1)), -tokens % p.bn, -p.bm * p.bn

    full = [p for p in plans if _ctas(p, tokens, rows) >= FILL * sms]
    plan = min(full, key=cost) if full else max(plans, key=lambda p: (_ctas(p, tokens, rows), [-c for c in cost(p)]))
    plan = whole_splits(SparseGemmPlan(**{**asdict(plan), **override}), cols)
    check_gemm_plan(plan, rows, cols, shared_limit)
    return plan


def filling_splits(plan: SparseGemmPlan, tokens: int, rows: int, cols: int, sms: int) -> SparseGemmPlan:
    """``plan``'s tile split along K until its grid reaches :data:`FILL` of ``sms`` multiprocessors (a ``wgmma`` plan
    at :data:`WGMMA_DECODE_MAX_TOKENS` tokens or fewer: :data:`DECODE_CTAS_PER_SM` CTAs each), each split keeping
    at least :data:`MIN_SPLIT_STAGES` stages (unsplit where the row and token blocks fill the GPU already)."""
    blocks = max(1, cdiv(tokens, plan.bn) * (rows // plan.bm))   # none: a tile taller than the layer (refused later)
    target = DECODE_CTAS_PER_SM * sms if plan.wgmma and tokens <= WGMMA_DECODE_MAX_TOKENS else int(FILL * sms)
    splits = min(max(1, cols // BK // MIN_SPLIT_STAGES), max(1, cdiv(target, blocks)))
    return whole_splits(SparseGemmPlan(**{**asdict(plan), "splits": splits}), cols)


def staged_within_limit(plan: SparseGemmPlan, cols: int) -> SparseGemmPlan:
    """A ``mapped`` plan split along K at least until each split's staged input fits :data:`MAPPED_STAGED_LIMIT`
    (others as they are)."""
    if not plan.mapped:
        return plan
    least = cdiv(cdiv(cols, BK) * plan.bn * 128, MAPPED_STAGED_LIMIT)
    return whole_splits(SparseGemmPlan(**{**asdict(plan), "splits": max(plan.splits, least)}), cols)


def whole_splits(plan: SparseGemmPlan, cols: int) -> SparseGemmPlan:
    """``plan`` with as many splits as its columns per split (whole stages) make: none of them empty."""
    return SparseGemmPlan(**{**asdict(plan), "splits": cdiv(cols, plan.k_split(cols))})


def _ctas(plan: SparseGemmPlan, tokens: int, rows: int) -> int:
    gx, gy, gz = plan.grid(tokens, rows)
    return gx * gy * gz


def check_gemm_plan(plan: SparseGemmPlan, rows: int, cols: int, shared_limit: int = SMEM_PER_BLOCK_OPTIN) -> None:
    """Refuse a plan the kernel cannot run, in one line naming what to change."""
    if plan.mapped and (not plan.wgmma or plan.bn > WGMMA_MAPPED_MAX_TOKENS):
        raise ValueError(f"the map is read in the kernel by the wgmma form's CTAs of {WGMMA_MAPPED_MAX_TOKENS} tokens or "
                         f"fewer; not {plan}")
    if plan.wgmma and (plan.mt != 1 or plan.wn != 1 or plan.wm % 4 or not 1 <= plan.nt <= 32 or plan.stages < 3):
        raise ValueError(f"a wgmma plan takes mt=1, wn=1, wm a multiple of 4 (warpgroups), nt 1-32 (N up to 256) and "
                         f"3 or more stages (a slot is copied into two steps after its own); not {plan}")
    if rows % plan.bm or plan.bm % 64:
        raise ValueError(f"{rows} rows are not whole CTAs of {plan.bm} (wm·mt·16, a multiple of 64): change wm or mt")
    if cols % BK:
        raise ValueError(f"{cols} columns are not whole stages of {BK}")
    threads = 32 * plan.warps
    if plan.bm * 4 % threads or (plan.bn * 8 >= threads and plan.bn * 8 % threads):
        raise ValueError(f"a CTA of {threads} threads copies its {plan.bm} rows' and {plan.bn} tokens' 16-byte chunks "
                         "evenly: take more rows or tokens a CTA (mt, nt) or fewer warps")
    if plan.stages < 2:
        raise ValueError(f"stages={plan.stages}: the pipeline holds 2 or more stages")
    if plan.splits < 1 or plan.k_split(cols) * (plan.splits - 1) >= cols:
        raise ValueError(f"splits={plan.splits} leaves a split of {cols} columns in stages of {BK} empty: take "
                         f"{cdiv(cols, plan.k_split(cols))} or fewer")
    if plan.dynamic_shared(cols) > shared_limit:
        raise ValueError(f"{plan.stages} stages of {plan.stage_bytes()} bytes (and {plan.staged_bytes(cols)} of staged "
                         f"input) exceed {shared_limit} bytes of shared memory a CTA: take fewer stages, more splits or a "
                         "smaller tile")


def kernel_defines(plan: SparseGemmPlan, dtype: torch.dtype, tiled: bool, has_bias: bool, ordered: bool) -> dict:
    """The compile-time parameters of one variant (``#define`` s before the source); the fragment knobs a probe of
    the decode flipped (:func:`.nm_sparse_mma.fragment_reading`) apply here too: the same MMA."""
    reading = fragment_reading()
    return {"MT": plan.mt, "NT": plan.nt, "WM": plan.wm, "WN": plan.wn, "STAGES": plan.stages, "TILED": int(tiled),
            "HAS_BIAS": int(has_bias), "IS_BF16": int(dtype == torch.bfloat16), "ORDERED": int(ordered),
            "WGMMA": int(plan.wgmma), "MAPPED": int(plan.mapped), **{knob: int(knob in reading) for knob in FRAGMENT_KNOBS}}


def wgmma_asm(n: int, accumulators: list[str], sparse: bool = True, ab_type: str = '" SP_TYPE "') -> str:
    """One ``asm volatile`` statement issuing ``wgmma.mma_async`` m64n``n`` into the fp32 ``accumulators`` (C lvalues,
    ``n / 2`` of them), A and B read through the descriptors ``a`` and ``b``: with ``sparse`` the 2:4 k32 with the
    metadata register ``e`` (selector 0), else the dense k16; scale-d on, A and B as stored. ``ab_type``: the 16-bit
    type's name, or the C string splice of the ``SP_TYPE`` macro (the kernel's fp16 or bf16)."""
    regs = len(accumulators)
    d = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"({a})' for a in accumulators)
    if sparse:
        op = (f"wgmma.mma_async.sp.sync.aligned.m64n{n}k32.f32.{ab_type}.{ab_type} {{{d}}}, %{regs}, %{regs + 1}, "
              f"%{regs + 2}, 0, p, 1, 1, 0, 0;")
        ins = '"l"(a), "l"(b), "r"(e)'
    else:
        op = (f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab_type}.{ab_type} {{{d}}}, %{regs}, %{regs + 1}, "
              "p, 1, 1, 0, 0;")
        ins = '"l"(a), "l"(b)'
    return f'  asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, 1, 0;\\n{op}\\n}}\\n" : {outs} : {ins});\n'


def wgmma_functions(nt: int) -> str:
    """The GPU side of the ``wgmma`` calls the kernel makes (the emulator defines the same names): the fences, commit
    and wait, and ``sp_wgmma_sp``, one ``wgmma.mma_async.sp`` m64n(8·nt)k32 with A and B through descriptors
    (:func:`wgmma_asm`). Each accumulator is named to the compiler at the fences and waits (an empty asm that reads
    and writes it), so no read or write of one moves across them."""
    acc = [f"d[0][{i // 4}][{i % 4}]" for i in range(4 * nt)]
    touch = "".join(f'  asm volatile("" : "+f"({a}) :: "memory");\n' for a in acc)
    return (
        f"SP_DEV void sp_wgmma_touch(float (&d)[1][{nt}][4]) {{\n{touch}}}\n"
        "SP_DEV void sp_wgmma_operands_ready(unsigned (&e)[2], unsigned long long (&desc)[2][2]) {\n"
        "  for (int k = 0; k < 2; ++k) {\n"
        '    asm volatile("" : "+r"(e[k]), "+l"(desc[k][0]), "+l"(desc[k][1]) :: "memory");\n  }\n}\n'
        "SP_DEV void sp_fence_proxy_async() { asm volatile(\"fence.proxy.async.shared::cta;\" ::: \"memory\"); }\n"
        f"SP_DEV void sp_wgmma_fence(float (&d)[1][{nt}][4]) {{\n  sp_wgmma_touch(d);\n"
        '  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");\n}\n'
        'SP_DEV void sp_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }\n'
        f"template <int KEEP>\nSP_DEV void sp_wgmma_wait(float (&d)[1][{nt}][4]) {{\n"
        '  asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(KEEP) : "memory");\n  sp_wgmma_touch(d);\n}\n'
        f"SP_DEV void sp_wgmma_sp(float (&d)[1][{nt}][4], unsigned long long a, unsigned long long b, unsigned e) {{\n"
        + wgmma_asm(8 * nt, acc) + "}\n")


def kernel_source(defines: dict, prelude: str = DEVICE_PRELUDE) -> str:
    """The full text of one variant (:func:`.nm_sparse_mma.kernel_source` of ``nm_sparse_gemm.cu``; under ``WGMMA``
    the GPU prelude gains :func:`wgmma_functions`)."""
    if defines.get("WGMMA") and prelude is DEVICE_PRELUDE:
        prelude = prelude + wgmma_functions(int(defines["NT"]))
    return sparse_mma_source(defines, prelude, SOURCE)


def variant_source(defines: dict) -> CudaSource:
    """What NVRTC compiles for one variant: the wgmma form for the GPU's architecture-specific target (``sm_90a``)."""
    return CudaSource(kernel_source(defines), KERNEL_NAME, bool(defines.get("WGMMA")))


@functools.lru_cache(maxsize=None)
def _compiled(defines: tuple, device_index: int):
    variant = variant_source(dict(defines))
    return compile_cuda(variant.text, variant.name, device_index, key=defines, arch_specific=variant.arch_specific)


def _prepare(plan: SparseGemmPlan, dtype: torch.dtype, tiled: bool, has_bias: bool, index: int, cols: int):
    kernel = _compiled(tuple(kernel_defines(plan, dtype, tiled, has_bias, ordered_metadata()).items()), index)
    if plan.dynamic_shared(cols) > SHARED_LIMIT:
        allow_dynamic_shared(kernel, plan.dynamic_shared(cols))
    return kernel


@functools.lru_cache(maxsize=None)
def _launch(tokens: int, rows: int, cols: int, dtype: torch.dtype, tiled: bool, has_bias: bool, index: int,
            override: tuple, wgmma: bool = False) -> tuple:
    """``(kernel, plan, bound launch or None)`` for one kind of call (once per kind and process)."""
    sms = torch.cuda.get_device_properties(index).multi_processor_count
    plan = sparse_gemm_plan(tokens, rows, cols, sms, smem_per_block_optin(torch.device("cuda", index)), wgmma=wgmma,
                            **dict(override))
    kernel = _prepare(plan, dtype, tiled, has_bias, index, cols)
    try:
        bound = KernelLaunch(kernel, plan.grid(tokens, rows), (32 * plan.warps, 1, 1), plan.dynamic_shared(cols),
                             driver(), ARG_POINTERS, ARG_INTS)
    except (AttributeError, OSError):   # no driver reachable: PyTorch's _CudaKernel call launches it
        bound = None
    return kernel, plan, bound


def launch_plan(x: torch.Tensor, values: torch.Tensor, tiled: bool = False, has_bias: bool = False,
                wgmma: bool = False, **override) -> SparseGemmPlan:
    """The plan :func:`nm_sparse_gemm` launches for ``x`` on ``values``."""
    return _launch(x.numel() // x.shape[-1], values.shape[0], 2 * values.shape[1], x.dtype, tiled, has_bias,
                   device_index(x.device), tuple(sorted(override.items())), wgmma)[1]


def nm_sparse_gemm(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, bias: torch.Tensor | None = None,
                   tiled: bool = False, plan: SparseGemmPlan | None = None, wgmma: bool = False,
                   perm: torch.Tensor | None = None, **override) -> torch.Tensor:
    """``x @ Wᵀ + bias`` for a 2:4 ``W`` held as ``values`` ``[R, C/2]`` and position ``words`` ``[R, C/32]`` (row
    words, or cuSPARSELt's order when ``tiled``) on the sparse tensor cores, ``x`` in the weight's column order
    (gathered), or with ``perm`` (int32 ``[C]``, the wgmma decode up to :data:`WGMMA_MAPPED_MAX_TOKENS` tokens)
    ``x[..., perm] @ Wᵀ + bias``, the map read in the kernel. ``plan`` (or ``override``'s fields) replaces
    :func:`sparse_gemm_plan`'s; ``wgmma`` plans with Hopper's ``wgmma.mma_async.sp`` (:func:`sparse_wgmma_available`
    GPUs only)."""
    rows, cols = values.shape[0], 2 * values.shape[1]
    x2 = x.reshape(-1, cols)
    tokens = x2.shape[0]
    if not sparse_gemm_applies(tokens, rows, cols, 2, 4, x.dtype) or values.dtype != x.dtype:
        raise ValueError(f"the sparse GEMM takes 2:4 16-bit weights of the input's dtype, rows in 64s and columns in "
                         f"{BK}s; not {tokens} tokens of {x.dtype} on [{rows}, {cols}] {values.dtype}")
    if not (values.is_contiguous() and words.is_contiguous() and words.dtype == torch.int32 and
            words.shape == (rows, cols // 32) and values.data_ptr() % 16 == 0 and
            words.data_ptr() % (16 if tiled else 8) == 0):
        raise ValueError("the sparse GEMM reads contiguous values (16-byte aligned) and int32 position words "
                         f"[{rows}, {cols // 32}] (16-byte aligned in cuSPARSELt's order, else 8); got "
                         f"{tuple(words.shape)} {words.dtype}")
    if bias is not None and (bias.dtype != x.dtype or bias.shape != (rows,) or not bias.is_contiguous()):
        raise ValueError(f"the sparse GEMM adds a contiguous bias [{rows}] of the input's dtype")
    wgmma = wgmma or (plan is not None and plan.wgmma)
    check_map(perm, cols, tokens, wgmma)
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:   # 16-byte copies of each row
        x2 = x2.clone(memory_format=torch.contiguous_format)
    index = device_index(x.device)
    if wgmma and not sparse_wgmma_available(x.device):
        raise ValueError("the wgmma form of the sparse GEMM runs on Hopper (compute capability 9.0) only")
    if plan is None:
        if perm is not None:
            override = {**override, "mapped": True}
        kernel, plan, bound = _launch(tokens, rows, cols, x.dtype, tiled, bias is not None, index,
                                      tuple(sorted(override.items())), wgmma)
    else:
        if plan.mapped != (perm is not None):
            raise ValueError("a mapped plan takes the map (perm), and only it does")
        check_gemm_plan(plan, rows, cols, smem_per_block_optin(torch.device("cuda", index)))
        kernel, bound = _prepare(plan, x.dtype, tiled, bias is not None, index, cols), None
    y = torch.empty(tokens, rows, device=x.device, dtype=x.dtype)
    grid = plan.grid(tokens, rows)
    partial, counters = split_k_workspace(x.device, plan.splits * tokens * rows if plan.splits > 1 else 0,
                                   grid[0] * grid[1] if plan.splits > 1 else 0)
    tensors = [x2, values, words, bias if bias is not None else values, y, partial, counters,
               perm if perm is not None else words]
    ints = [tokens, rows, cols, x2.stride(0), plan.k_split(cols)]
    if bound is not None:
        bound(tensors, ints, stream_handle(x.device))
    else:
        kernel(grid=grid, block=(32 * plan.warps, 1, 1), shared_mem=plan.dynamic_shared(cols), args=[*tensors, *ints])
    return y.reshape(*x.shape[:-1], rows)


def check_map_reader(tokens: int, wgmma: bool) -> None:
    """Refuse, in one line, to read a map in the kernel where it cannot: only the wgmma decode does, up to
    :data:`WGMMA_MAPPED_MAX_TOKENS` tokens."""
    if not wgmma or tokens > WGMMA_MAPPED_MAX_TOKENS:
        raise ValueError(f"the map is read in the kernel by the wgmma decode only, up to {WGMMA_MAPPED_MAX_TOKENS} "
                         f"tokens (gather the input first): not {tokens} tokens{'' if wgmma else ' on mma.sp'}")


def check_map(perm: torch.Tensor | None, cols: int, tokens: int, wgmma: bool) -> None:
    """Refuse, in one line, a map the kernel cannot read (:func:`check_map_reader`), or one not contiguous int32
    ``[C]`` on 16 bytes."""
    if perm is None:
        return
    check_map_reader(tokens, wgmma)
    if perm.dtype != torch.int32 or perm.shape != (cols,) or not perm.is_contiguous() or perm.data_ptr() % 16:
        raise ValueError(f"the map is a contiguous int32 [{cols}] on 16 bytes; got {perm.dtype} {tuple(perm.shape)}")


def sparse_gemm_available(device: torch.device) -> bool:
    """Whether ``device`` runs it: where the decode runs (an NVIDIA GPU of compute capability 8.0 or more)."""
    return sparse_mma_available(device)


def sparse_wgmma_available(device: torch.device) -> bool:
    """Whether ``device`` runs the ``wgmma`` form: a Hopper GPU (compute capability 9.0 exactly: ``sm_90a`` code runs
    on no other)."""
    return sparse_mma_available(device) and _capability(device_index(device)) == (9, 0)


def plan_fields(plan: SparseGemmPlan) -> dict:
    """A plan as a dict (results files, compile checks)."""
    return asdict(plan)
