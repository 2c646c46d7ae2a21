"""The sparse-MMA decode's plans: how :func:`.nm_sparse_mma.nm_sparse_mma` tiles a layer and an input
(:class:`SparseMmaPlan`: n-tiles of 8 tokens, m-tiles of 16 rows per warp, row and K groups of warps per CTA,
CTAs along K), which layers and inputs it takes (:func:`sparse_mma_applies`), the default plan
(:func:`sparse_mma_plan`: the tile of :data:`TILES`, split along K until one wave fills the GPU), the tall
plan whose CTAs stage their input and share it among more rows (:func:`tall_plan`), the bytes a launch
moves besides its weight (:func:`side_traffic`) and when the tall plan is worth weighing
(:func:`tall_worth_weighing`). Plain arithmetic on shapes: nothing here needs a GPU.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import torch

from shuffleprune.kernels.gpu import cdiv

STEP = 128                 # columns a warp reads per step (two blocks of 64)
MAX_TOKENS = 64            # 8 n-tiles of 8 tokens
MAPPED_MAX_TOKENS = 16     # reading the map itself: every token's columns of a CTA staged in shared memory
STAGED_LIMIT = 32 * 1024   # the most bytes of staged input a CTA takes (its columns split further to fit)
SHARED_LIMIT = 48 * 1024   # static shared memory per CTA without an opt-in
# a plan that stages its input by choice (``stage``: the tall plan) takes up to this much, over 48 KB by the
# driver's opt-in (cuFuncSetAttribute: every CUDA GPU of compute capability 8.0 or more allows 99 KB or more a CTA):
# through the map every token's columns of the CTA; without one a ring of two rounds of 128 columns per K group
STAGED_OPTIN_LIMIT = 96 * 1024
SHARED_OPTIN_LIMIT = 99 * 1024


@dataclass(frozen=True)
class SparseMmaPlan:
    """A launch of the kernel: ``nt`` n-tiles of 8 tokens, ``mt`` m-tiles of 16 rows per warp, ``rw`` row
    groups and ``kw`` K groups of warps per CTA, ``ks`` columns per CTA (``splits`` CTAs along K), and
    ``bpre`` whether the input's fragments are loaded a step ahead with the weight's, ``stages`` the steps a warp
    holds in registers (``stages - 1`` loading while one multiplies), ``stage`` whether the CTA stages its input in
    shared memory by choice: without a map in a ring of two rounds (a round: 128 columns per K group of every
    token, copied asynchronously two rounds ahead; the input then read at each step, ``bpre`` off), through a map
    every token's columns as a map always stages them but up to :data:`STAGED_OPTIN_LIMIT` bytes; ``prefetch``
    whether the CTA asks its further kept values into L2 before it stages its input (reading a map: the weight
    streams while the CTA gathers, at most :data:`.nm_sparse_mma.PREFETCH_BUDGET` bytes a launch); ``inline_map`` whether, reading a
    map, each B load reads its columns' map entries and gathers its inputs itself, nothing staged (no gather before
    the first MMA, no barrier); ``min_ctas``, where set, the CTAs an SM must hold (``__launch_bounds__``: ptxas then
    caps the registers, where unbounded it may take more for fewer instructions; a tuning knob, 0 by default)."""
    nt: int
    mt: int
    rw: int
    kw: int
    ks: int
    splits: int
    bpre: bool
    stages: int = 2
    stage: bool = False
    prefetch: bool = False
    inline_map: bool = False
    min_ctas: int = 0

    @property
    def warps(self) -> int:
        return self.rw * self.kw

    @property
    def rows_per_cta(self) -> int:
        return self.rw * self.mt * 16

    def grid(self, rows: int) -> tuple[int, int, int]:
        return rows // self.rows_per_cta, self.splits, 1

    def shared_bytes(self) -> int:
        """Static shared memory: the warps' partial sums where several K groups add them (and the last-CTA flag)."""
        return (self.warps * self.mt * self.nt * 32 * 4 * 4 if self.kw > 1 else 0) + 4

    def staged_bytes(self, tokens: int) -> int:
        """Dynamic shared memory of the kernel reading the map itself: the CTA's columns of every token."""
        return tokens * self.ks * 2

    def ring_bytes(self, tokens: int) -> int:
        """Dynamic shared memory of the ring a ``stage`` plan without a map stages its input in: two rounds."""
        return 2 * tokens * STEP * self.kw * 2

    def staged_limit(self) -> int:
        """The most staged bytes this plan may take: :data:`STAGED_OPTIN_LIMIT` where it stages by choice."""
        return STAGED_OPTIN_LIMIT if self.stage else STAGED_LIMIT

    def dynamic_shared(self, tokens: int, mapped: bool) -> int:
        """The launch's dynamic shared memory: the staged input where it stages one (a map, unless read inline; a ring
        for ``stage``)."""
        if mapped:
            return 0 if self.inline_map else self.staged_bytes(tokens)
        return self.ring_bytes(tokens) if self.stage else 0


def sparse_mma_applies(tokens: int, rows: int, cols: int, n: int, m: int, dtype: torch.dtype,
                       mapped: bool = False) -> bool:
    """Whether the kernel takes this layer and input: 2:4, 16-bit, 1–64 tokens (1–16 reading the map
    itself), columns in whole steps of 128 and rows in whole m-tiles of 16 (any layout the layer holds)."""
    return ((n, m) == (2, 4) and dtype in (torch.float16, torch.bfloat16) and 1 <= tokens <= MAX_TOKENS
            and cols % STEP == 0 and rows % 16 == 0 and (not mapped or tokens <= MAPPED_MAX_TOKENS))


def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _columns_per_cta(cols: int, splits: int) -> int:
    """Each of ``splits`` CTAs' share of ``cols`` columns, rounded up to whole steps."""
    return cdiv(cdiv(cols, splits), STEP) * STEP


# the tile per n-tile count: m-tiles per warp, warps splitting K in a CTA, the input loaded a step ahead. As
# compiled for sm_90 by NVRTC 13.5 (scripts/results/sparse_mma_compile.json) these hold 100–150 registers and
# spill nothing; two m-tiles a warp from 4 n-tiles up spilled (255 registers), loading the input ahead at 2 n-tiles
# took 162 registers (one 256-thread CTA per SM)
TILES = {1: dict(mt=1, kw=4, bpre=True, min_ctas=5), 2: dict(mt=1, kw=4, bpre=False),
         4: dict(mt=1, kw=4, bpre=False), 8: dict(mt=1, kw=2, bpre=False)}
# min_ctas 5 at 1-8 tokens: unbounded, ptxas took 104-106 registers for the map read inline (4 CTAs an SM); bounded to
# 5 CTAs every 1-8-token variant holds at most 96, spills nothing and issues no more instructions a K loop pass
# (scripts/results/sparse_mma_compile.json). At 16 tokens the bound moved the plain decode from 80 registers to 96
# and spilled the inline one, so it stays unbounded there (the staged map then takes 124: 4 CTAs; `--min-ctas` of
# tune_sparse_mma.py sweeps it on a GPU)
DEFAULT_CTAS_PER_SM = 4   # what the plan assumes before the compiled kernel's occupancy is known
MAX_THREADS_PER_SM = 2048  # every GPU of compute capability 8.0–9.0 (8.6 and 8.9: 1536; the driver refuses past it)
# the tall plans' CTAs (warps sharing their input through L1 or the staged map): row groups and K groups of warps
# tried, at most this many threads a CTA, keeping at least this share of the default tile's resident warps
TALL_ROW_WARPS, TALL_K_WARPS, TALL_MAX_THREADS, TALL_MIN_OCCUPANCY = (1, 2, 4), (1, 2, 4), 128, 0.5


GATHER_SECTOR = 32   # bytes a scattered 2-byte gather through a map costs: a sector of its own


def side_traffic(plan: SparseMmaPlan, tokens: int, rows: int, cols: int, mapped: bool = False) -> int:
    """The bytes a launch moves besides its weight: the input, read once per row block (every CTA reads its
    columns of every token; :data:`TILES`' CTAs of 16 rows read it ``rows / 16`` times over), and split-K's fp32
    partial sums, written and read back. At 64 tokens on 4096×4096 the default tile's input reads are 134 MB
    against the weight's 19 (values and position words): what :func:`tall_plan` trades against partial sums.
    ``mapped``: each input value is gathered through the map alone, counted as a sector (:data:`GATHER_SECTOR`)."""
    reads = rows // plan.rows_per_cta * tokens * cols * (GATHER_SECTOR if mapped else 2)
    return reads + (2 * plan.splits * tokens * rows * 4 if plan.splits > 1 else 0)


def tall_plan(tokens: int, rows: int, cols: int, sms: int, ctas_per_sm: int = DEFAULT_CTAS_PER_SM,
              mapped: bool = False, **override) -> SparseMmaPlan:
    """The plan whose CTAs stage their input in shared memory (``stage``) and share it among more rows: of the
    row groups (``rw``) and K groups (``kw``) of warps in :data:`TALL_ROW_WARPS` × :data:`TALL_K_WARPS` (at most
    :data:`TALL_MAX_THREADS` threads, keeping :data:`TALL_MIN_OCCUPANCY` of the default tile's resident warps:
    registers bound them per thread, so a CTA of more warps has fewer CTAs a multiprocessor), the one with the
    least :func:`side_traffic`, then the most resident warps. ``ctas_per_sm`` is the default tile's occupancy;
    ``override`` as in :func:`sparse_mma_plan` (``rw`` or ``kw`` given: searched over the other; both: that
    plan)."""
    override = {**override, "stage": override.get("stage", True)}
    if "rw" in override and "kw" in override:
        return sparse_mma_plan(tokens, rows, cols, sms, ctas_per_sm, mapped, **override)
    base = sparse_mma_plan(tokens, rows, cols, sms, ctas_per_sm, mapped,
                           **{k: v for k, v in override.items() if k != "stage"})
    warps_per_sm = ctas_per_sm * base.warps
    best, best_key = None, None
    for rw, kw in itertools.product([override["rw"]] if "rw" in override else TALL_ROW_WARPS,
                                    [override["kw"]] if "kw" in override else TALL_K_WARPS):
        warps = rw * kw
        resident = warps_per_sm // warps * warps
        if 32 * warps > TALL_MAX_THREADS or resident < TALL_MIN_OCCUPANCY * warps_per_sm:
            continue
        try:
            plan = sparse_mma_plan(tokens, rows, cols, sms, warps_per_sm // warps, mapped, **{**override, "rw": rw,
                                                                                               "kw": kw})
        except ValueError:   # rows not whole CTAs of these, or too much shared memory
            continue
        key = (side_traffic(plan, tokens, rows, cols, mapped), -resident, warps)
        if best_key is None or key < best_key:
            best, best_key = plan, key
    if best is None:   # no CTA of these fits: the default tile's, staged
        return sparse_mma_plan(tokens, rows, cols, sms, ctas_per_sm, mapped, **{**override, "rw": base.rw,
                                                                                 "kw": base.kw})
    return best


def sparse_mma_plan(tokens: int, rows: int, cols: int, sms: int, ctas_per_sm: int = DEFAULT_CTAS_PER_SM,
                    mapped: bool = False, **override) -> SparseMmaPlan:
    """The launch for ``tokens`` tokens on a ``[rows, cols]`` weight, ``sms`` multiprocessors holding
    ``ctas_per_sm`` of its CTAs each: the n-tile's tile (:data:`TILES`), and CTAs along K (``splits``) until
    the grid fills one wave of the GPU, each warp keeping at least one step (its next step's loads are in
    flight while it multiplies where it has two or more). ``mapped``: the CTAs' columns also split until
    every token's fit in :data:`STAGED_LIMIT` bytes of shared memory (``stage``: staged without a map too, to
    :data:`STAGED_OPTIN_LIMIT`). ``override`` sets any field (tuning). :func:`tall_plan` is the other plan, its
    CTAs staging the input and sharing it among more rows."""
    nt = min(8, _pow2_at_least(cdiv(tokens, 8)))
    tile = dict(TILES[nt])
    for name in ("mt", "kw", "bpre", "rw", "stages", "stage"):
        if name in override:
            tile[name] = override[name]
    mt, kw, rw, stage = tile["mt"], tile["kw"], tile.get("rw", 1), bool(tile.get("stage", False))
    inline_map = bool(override.get("inline_map", False))
    # the map stages the CTA's columns (unless each B load reads it inline)
    staged, limit = mapped and not inline_map, STAGED_OPTIN_LIMIT if stage else STAGED_LIMIT
    if stage and not mapped and "bpre" not in override:   # the ring's input is read at its step, never ahead
        tile["bpre"] = False
    steps = cols // STEP
    kw = max(1, min(kw, steps))
    row_blocks = max(1, rows // (16 * mt * rw))
    splits = max(1, min(round(sms * ctas_per_sm / row_blocks), steps // kw))
    if staged:
        splits = max(splits, cdiv(tokens * cols * 2, limit))
    ks = _columns_per_cta(cols, splits)
    while staged and tokens * ks * 2 > limit and ks > STEP:   # the rounding up to whole steps went over
        splits += 1
        ks = _columns_per_cta(cols, splits)
    fields = dict(nt=nt, mt=mt, rw=rw, kw=kw, ks=ks, splits=cdiv(cols, ks), bpre=tile["bpre"],
                  stages=tile.get("stages", 2), stage=stage, prefetch=mapped and not inline_map, inline_map=inline_map,
                  min_ctas=tile.get("min_ctas", 0))
    fields.update({k: v for k, v in override.items() if k not in ("mt", "kw", "bpre", "rw", "stages", "stage")})
    if "ks" in override and "splits" not in override:
        fields["splits"] = cdiv(cols, fields["ks"])
    if "splits" in override and "ks" not in override:
        fields["ks"] = _columns_per_cta(cols, fields["splits"])
        fields["splits"] = cdiv(cols, fields["ks"])
    plan = SparseMmaPlan(**fields)
    check_plan(plan, tokens, rows, cols, mapped)
    return plan


def check_plan(plan: SparseMmaPlan, tokens: int, rows: int, cols: int, mapped: bool = False) -> None:
    """Refuse a plan the kernel cannot run, in one line naming what to change."""
    if tokens > 8 * plan.nt:
        raise ValueError(f"nt={plan.nt} holds {8 * plan.nt} tokens, not {tokens}: take nt >= {cdiv(tokens, 8)}")
    if rows % plan.rows_per_cta:
        raise ValueError(f"{rows} rows are not whole CTAs of {plan.rows_per_cta} (rw·mt·16): take smaller rw or mt")
    if plan.ks % STEP or plan.ks * (plan.splits - 1) >= cols or plan.ks * plan.splits < cols:
        raise ValueError(f"ks={plan.ks} × splits={plan.splits} does not cover {cols} columns in steps of {STEP}")
    if plan.stages not in (2, 3, 4):
        raise ValueError(f"stages={plan.stages}: the kernel holds 2, 3 or 4 steps in registers")
    if plan.shared_bytes() > SHARED_LIMIT:
        raise ValueError(f"warps·mt·nt = {plan.warps * plan.mt * plan.nt} needs {plan.shared_bytes()} bytes of "
                         f"shared memory (at most {SHARED_LIMIT}): take fewer warps, m-tiles or n-tiles")
    staged, total = plan.dynamic_shared(tokens, mapped), SHARED_OPTIN_LIMIT if plan.stage else SHARED_LIMIT
    ring = plan.stage and not mapped
    if ring and plan.bpre:
        raise ValueError("a plan staging its input in a ring reads it at each step: take bpre=False")
    if plan.inline_map and plan.stage:
        raise ValueError("inline_map reads the map at each B load, staging nothing: take stage=False")
    if plan.min_ctas < 0 or plan.min_ctas * 32 * plan.warps > MAX_THREADS_PER_SM:
        raise ValueError(f"min_ctas={plan.min_ctas}: an SM holds at most {MAX_THREADS_PER_SM // (32 * plan.warps)} "
                         f"CTAs of {plan.warps} warps (0: no bound)")
    if staged > plan.staged_limit():
        raise ValueError(f"{'the ring' if ring else f'ks={plan.ks}'} stages {staged} bytes of {tokens} tokens' input "
                         f"(at most {plan.staged_limit()}): take {'fewer K groups of warps' if ring else 'more splits'}")
    if staged and plan.shared_bytes() + staged > total:
        raise ValueError(f"the warps' sums ({plan.shared_bytes()} bytes) and the staged input ({staged}) exceed "
                         f"{total} bytes of shared memory: take more splits, or fewer warps or m-tiles")


TALL_WORTH = 0.25   # the tall plan is weighed where the default tile's side traffic is at least this share of the weight


def tall_worth_weighing(tokens: int, rows: int, cols: int, sms: int, mapped: bool = False) -> bool:
    """Whether :func:`tall_plan` differs from the default plan and the default's :func:`side_traffic` is at least
    :data:`TALL_WORTH` of the 16-bit 2:4 weight's bytes (values and position words: 1.125 bytes a dense
    element): from about 4 tokens on the benchmark's shapes, where the input read once per 16 rows starts to
    weigh against the weight itself; through a map from one token (every CTA gathers its columns value by value)."""
    try:
        base = sparse_mma_plan(tokens, rows, cols, sms, mapped=mapped)
        tall = tall_plan(tokens, rows, cols, sms, mapped=mapped)
    except ValueError:   # no launch of either fits this layer and input
        return False
    return tall != base and side_traffic(base, tokens, rows, cols, mapped) >= TALL_WORTH * 1.125 * rows * cols


def plan_fields(plan: SparseMmaPlan) -> dict:
    """A plan as a dict (results files, compile checks)."""
    return asdict(plan)
