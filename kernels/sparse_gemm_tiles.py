"""The sparse-tensor-core prompt GEMM's plans: how :func:`.nm_sparse_gemm.nm_sparse_gemm` tiles a layer and an
input (:class:`SparseGemmPlan`: warps of m-tiles × n-tiles, stages of :data:`BK` columns in shared memory, splits
along K), which layers it takes (:func:`sparse_gemm_applies`), the tiles tried (:data:`GEMM_TILES`; under Hopper's
``wgmma`` :data:`WGMMA_TILES`, and up to :data:`WGMMA_DECODE_MAX_TOKENS` tokens the decode's
:data:`WGMMA_DECODE_TILES`), the bytes a launch moves (:func:`gemm_traffic`) and the plan chosen by them
(:func:`sparse_gemm_plan`). Plain arithmetic on shapes: nothing here needs a GPU.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from shuffleprune.kernels.gpu import SMEM_PER_BLOCK_OPTIN, cdiv

BK = 64                        # columns a stage copies (two k32 MMAs)
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


def check_map_reader(tokens: int, wgmma: bool) -> None:
    """Refuse, in one line, to read a map in the kernel where it cannot: only the wgmma decode does, up to
    :data:`WGMMA_MAPPED_MAX_TOKENS` tokens."""
    if not wgmma or tokens > WGMMA_MAPPED_MAX_TOKENS:
        raise ValueError(f"the map is read in the kernel by the wgmma decode only, up to {WGMMA_MAPPED_MAX_TOKENS} "
                         f"tokens (gather the input first): not {tokens} tokens{'' if wgmma else ' on mma.sp'}")


def plan_fields(plan: SparseGemmPlan) -> dict:
    """A plan as a dict (results files, compile checks)."""
    return asdict(plan)
