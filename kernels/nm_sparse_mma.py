"""The 2:4 decode on the sparse tensor cores (``mma.sp``): ``kernels/nm_sparse_mma.cu``, compiled by NVRTC
at its first call on a GPU (:func:`.cuda_rtc.compile_cuda`, each cubin kept on disk), for 1–64 tokens of 16-bit
inputs.

Triton has no sparse MMA (triton-lang/triton#6891), so every Triton decode expands its 2:4 tile to dense
in registers before ``tl.dot``: that expansion, not the weight's bytes, bounds them from 2 tokens on
(``bench_kernel.json``, H200, 4096×4096: 1.0–1.5 TB/s at 16–64 tokens where cuBLAS moved 2.5–2.8). ``mma.sp``
multiplies the kept values as they lie, each position code a 2-bit index the tensor core reads itself, so the decode's
work per weight byte is the same at 1 token as at 64. It reads the layer's one buffer as it is (the
export's row words, or cuSPARSELt's order after ``use_cslt_layout``): no copy, no re-layout. The
kernel's text says how lanes map to the MMA's fragments; :func:`sparse_mma_plan` sizes its grid, and
:func:`tall_plan` the other launch, whose CTAs stage the input in shared memory and share it among more rows
(by :func:`side_traffic`, the input and partial-sum bytes a launch moves besides its weight).

The same ``.cu`` text runs on the CPU under ``tests/sparse_mma_emulator.hpp`` (a CUDA thread model
with the MMA computed as the PTX ISA defines it), which is how the tests check it against float64.
"""
from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass, asdict
from pathlib import Path

import torch

from shuffleprune.kernels.cuda_rtc import (CudaSource, KernelLaunch, allow_dynamic_shared, compile_cuda, driver,
                                           resident_ctas)
from shuffleprune.kernels.gpu import _capability, cdiv

SOURCE = Path(__file__).with_name("nm_sparse_mma.cu")
COMMON = Path(__file__).with_name("nm_sparse_common.cuh")   # what the decode and the prompt GEMM share
KERNEL_NAME = "nm_sparse_mma"
STEP = 128                 # columns a warp reads per step (two blocks of 64)
ARG_POINTERS, ARG_INTS = 8, 5   # the kernel's parameters: x, values, words, perm, bias, y, partial, counters; T, R,
                                # C, xs, KS
MAX_TOKENS = 64            # 8 n-tiles of 8 tokens
MAPPED_MAX_TOKENS = 16     # reading the map itself: every token's columns of a CTA staged in shared memory
STAGED_LIMIT = 32 * 1024   # the most bytes of staged input a CTA takes (its columns split further to fit)
SHARED_LIMIT = 48 * 1024   # static shared memory per CTA without an opt-in
# a plan that stages its input by choice (``stage``: the tall plan) takes up to this much, over 48 KB by the
# driver's opt-in (cuFuncSetAttribute: every CUDA GPU of compute capability 8.0 or more allows 99 KB or more a CTA):
# through the map every token's columns of the CTA; without one a ring of two rounds of 128 columns per K group
STAGED_OPTIN_LIMIT = 96 * 1024
SHARED_OPTIN_LIMIT = 99 * 1024
PREFETCH_BUDGET = 16 << 20   # the most weight bytes a launch asks into L2 ahead (``prefetch``): a third of an H100's L2

# what each kernel source needs from the GPU side; the emulator (tests/) defines the same names for the CPU
DEVICE_PRELUDE = r"""
typedef uint4 u32x4;
typedef uint2 u32x2;
#define SP_DEV __device__ __forceinline__
#define SP_BOUNDS(n) __launch_bounds__(n)
#define SP_BOUNDS_MIN(n, ctas) __launch_bounds__(n, ctas)   // and at least `ctas` CTAs an SM: registers capped
SP_DEV u32x4 sp_ld128(const void* p) {   // the weight: read once, kept out of L1
  u32x4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
SP_DEV u32x2 sp_ld64(const void* p) {
  u32x2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
SP_DEV unsigned sp_ld32(const void* p) { return __ldg((const unsigned*)p); }   // the input: shared by every warp
SP_DEV u32x4 sp_ld_cg128(const float* p) {   // L2 only: other CTAs' partial sums, never a stale L1 line
  u32x4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
SP_DEV float sp_bits_float(unsigned u) { return __uint_as_float(u); }
SP_DEV unsigned short sp_ld16(const unsigned short* p) { return *p; }
SP_DEV u32x4 sp_ldg128(const void* p) { return __ldg((const uint4*)p); }   // the map: cached, read per token
SP_DEV u32x2 sp_ldg64(const void* p) { return __ldg((const uint2*)p); }
SP_DEV void sp_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" :: "l"(p)); }
SP_DEV unsigned sp_lds32(const unsigned short* p) { return *(const unsigned*)p; }   // shared memory
SP_DEV void sp_st_shared32(unsigned short* p, unsigned v) { *(unsigned*)p = v; }
SP_DEV void sp_st_shared128(unsigned short* p, u32x4 v) { *(u32x4*)p = v; }
SP_DEV void sp_cp_async8(unsigned short* to, const unsigned short* from) {   // global to shared, not through registers
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"((unsigned)__cvta_generic_to_shared(to)), "l"(from)
               : "memory");
}
SP_DEV void sp_cp_async16(unsigned short* to, const void* from, int bytes) {   // bytes 16, or 0: zeros
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"((unsigned)__cvta_generic_to_shared(to)),
               "l"(from), "r"(bytes) : "memory");
}
SP_DEV void sp_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
SP_DEV void sp_cp_async_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
SP_DEV void sp_ldmatrix4(unsigned (&r)[4], const unsigned short* p) {   // four 8x8 16-bit matrices, rows by lanes
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"((unsigned)__cvta_generic_to_shared(p)));
}
SP_DEV void sp_sts16(unsigned short* p, unsigned short v) { *p = v; }
SP_DEV u32x4 sp_lds128(const unsigned short* p) { return *(const u32x4*)p; }
SP_DEV void sp_st128(unsigned short* p, u32x4 v) { *(u32x4*)p = v; }
#define SP_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
SP_DEV unsigned sp_shared_address(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
SP_DEV void sp_keep(int& v) { asm volatile("" : "+r"(v)); }   // a value the compiler may not work out again
SP_DEV void sp_keep(long long& v) { asm volatile("" : "+l"(v)); }
SP_DEV void sp_st16(unsigned short* p, unsigned short v) { *p = v; }
SP_DEV void sp_st_float(float* p, float v) { *p = v; }
SP_DEV void sp_st_int(int* p, int v) { *p = v; }
SP_DEV unsigned sp_byte_perm(unsigned a, unsigned b, unsigned s) { return __byte_perm(a, b, s); }
SP_DEV void sp_threadfence() { __threadfence(); }
SP_DEV int sp_atomic_add(int* p, int v) { return atomicAdd(p, v); }
#if PDL
SP_DEV void sp_grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
SP_DEV void sp_grid_release() { asm volatile("griddepcontrol.launch_dependents;" :::); }
#endif
#if IS_BF16
#define SP_TYPE "bf16"
SP_DEV float sp_to_float(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }
SP_DEV unsigned short sp_from_float(float f) {
  unsigned short r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
#else
#define SP_TYPE "f16"
SP_DEV float sp_to_float(unsigned short h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
SP_DEV unsigned short sp_from_float(float f) {
  unsigned short r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
}
#endif
#if ORDERED
#define SP_MMA "mma.sp::ordered_metadata.sync.aligned.m16n8k32.row.col.f32." SP_TYPE "." SP_TYPE ".f32 "
#else
#define SP_MMA "mma.sp.sync.aligned.m16n8k32.row.col.f32." SP_TYPE "." SP_TYPE ".f32 "
#endif
template <int SEL>
SP_DEV void sp_mma(float (&d)[4], const unsigned (&a)[4], const unsigned (&b)[4], unsigned e) {
  asm volatile(SP_MMA "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9, %10, %11}, {%0, %1, %2, %3}, %12, %13;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(b[2]), "r"(b[3]),
                 "r"(e), "n"(SEL));
}
"""


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
    streams while the CTA gathers, at most :data:`PREFETCH_BUDGET` bytes a launch); ``inline_map`` whether, reading a
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


def sparse_mma_available(device: torch.device) -> bool:
    """Whether ``device`` runs it: an NVIDIA GPU of compute capability 8.0 or more (sparse ``mma``). It is
    compiled at its first call by NVRTC called here or by PyTorch's ``torch.cuda._compile_kernel`` (2.8 and
    later); where neither works the call raises and ``auto`` leaves it out."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(device_index(device))[0] >= 8


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


def kernel_defines(plan: SparseMmaPlan, dtype: torch.dtype, tiled: bool, has_bias: bool, ordered: bool,
                   mapped: bool = False, pdl: bool = False) -> dict:
    """The compile-time parameters of one kernel variant (``#define`` s before the source)."""
    reading = fragment_reading()
    return {"NT": plan.nt, "MT": plan.mt, "RW": plan.rw, "KW": plan.kw, "TILED": int(tiled),
            "HAS_BIAS": int(has_bias), "HAS_PERM": int(mapped), "MAP_INLINE": int(mapped and plan.inline_map),
            "STAGE_X": int(plan.stage and not mapped),
            "IS_BF16": int(dtype == torch.bfloat16),
            "BPRE": int(plan.bpre), "STAGES": plan.stages, "ORDERED": int(ordered), "PDL": int(pdl),
            "PREFETCH": int(plan.prefetch), "PREFETCH_BUDGET": f"{PREFETCH_BUDGET}LL", "MIN_CTAS": plan.min_ctas,
            **{knob: int(knob in reading) for knob in FRAGMENT_KNOBS}}


# the .cu text's other readings of the PTX ISA's fragments (each 0 in the reading it documents)
FRAGMENT_KNOBS = ("A_SWAP", "META_HALF_SWAP", "META_ROLE_SWAP", "B_SWAP")
READING_ENV = "SHUFFLEPRUNE_SPARSE_MMA_READING"   # knobs to flip, separated by commas (a GPU probe's finding)


def fragment_reading() -> frozenset[str]:
    """The fragment knobs flipped in this process (:data:`READING_ENV`; none by default: the reading the
    kernel's text documents). Only a probe on a GPU (``scripts/tune_sparse_mma.py --probe``) has reason to
    set it; an unknown name is refused in one line."""
    names = frozenset(n.strip().upper() for n in os.environ.get(READING_ENV, "").split(",") if n.strip())
    unknown = sorted(names - set(FRAGMENT_KNOBS))
    if unknown:
        raise ValueError(f"{READING_ENV} names {', '.join(unknown)}: use some of {', '.join(FRAGMENT_KNOBS)}")
    return names


def set_fragment_reading(knobs) -> None:
    """Flip ``knobs`` (some of :data:`FRAGMENT_KNOBS`) for the rest of this process: the environment
    variable set, and every launch worked out before forgotten (a probe's use)."""
    os.environ[READING_ENV] = ",".join(sorted(knobs))
    fragment_reading()   # refuses a name that is no knob
    _launch.cache_clear()


def kernel_source(defines: dict, prelude: str = DEVICE_PRELUDE, source: Path = SOURCE) -> str:
    """The full text of one variant: its defines, the side's prelude (GPU here; the CPU emulator's in
    the tests), what both sparse-MMA kernels share (:data:`COMMON`), then ``source`` (``nm_sparse_mma.cu``, or the
    prompt GEMM's ``nm_sparse_gemm.cu``)."""
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    return head + prelude + COMMON.read_text() + source.read_text()


def ordered_metadata() -> bool:
    """``mma.sp::ordered_metadata`` (PTX ISA 8.5, CUDA 12.5+: the form Hopper runs at full rate) where
    PyTorch's CUDA has it; the plain ``mma.sp`` before (every code this project writes is ordered)."""
    version = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    return version >= (12, 5)


def variant_source(defines: dict) -> CudaSource:
    """What NVRTC compiles for one variant (``scripts/compile_ahead.py`` compiles them before a GPU run asks)."""
    return CudaSource(kernel_source(defines), KERNEL_NAME)


@functools.lru_cache(maxsize=None)
def _compiled(defines: tuple, device_index: int):
    """One variant compiled for one GPU (:func:`.cuda_rtc.compile_cuda`: about a second the first time)."""
    variant = variant_source(dict(defines))
    return compile_cuda(variant.text, variant.name, device_index, key=defines)


@functools.lru_cache(maxsize=None)
def _launch(tokens: int, rows: int, cols: int, dtype: torch.dtype, tiled: bool, has_bias: bool, mapped: bool,
            device_index: int, override: tuple, pdl: bool = False, tall: bool = False) -> tuple:
    """``(kernel, plan)`` for one kind of call (``tall``: :func:`tall_plan`'s CTAs): the plan's split worked out
    again with the compiled kernel's occupancy in place of :data:`DEFAULT_CTAS_PER_SM`, its warps kept (once per
    kind of call and process)."""
    sms = torch.cuda.get_device_properties(device_index).multi_processor_count
    plan = (tall_plan if tall else sparse_mma_plan)(tokens, rows, cols, sms, mapped=mapped, **dict(override))
    kernel = _compiled(tuple(kernel_defines(plan, dtype, tiled, has_bias, ordered_metadata(), mapped, pdl).items()),
                       device_index)
    _allow_shared(kernel, plan, tokens, mapped)
    ctas = resident_ctas(kernel, 32 * plan.warps, plan.dynamic_shared(tokens, mapped)) or DEFAULT_CTAS_PER_SM
    if ctas != DEFAULT_CTAS_PER_SM:
        plan = sparse_mma_plan(tokens, rows, cols, sms, ctas_per_sm=ctas, mapped=mapped,
                               **{**dict(override), "rw": plan.rw, "kw": plan.kw, "stage": plan.stage})
        _allow_shared(kernel, plan, tokens, mapped)
    return kernel, plan, _bound(kernel, plan, rows, tokens, mapped, pdl)


def _allow_shared(kernel, plan: SparseMmaPlan, tokens: int, mapped: bool) -> None:
    """Raise ``kernel``'s dynamic shared memory limit to what ``plan`` stages where it needs more than 48 KB in all
    (:func:`.cuda_rtc.allow_dynamic_shared`: a RuntimeError where the driver refuses, and ``auto`` leaves it out)."""
    dynamic = plan.dynamic_shared(tokens, mapped)
    if dynamic + plan.shared_bytes() > SHARED_LIMIT:
        allow_dynamic_shared(kernel, dynamic)


def _bound(kernel, plan: SparseMmaPlan, rows: int, tokens: int, mapped: bool, pdl: bool) -> KernelLaunch | None:
    """The launch of ``kernel`` for one kind of call, or None where the driver is not reachable (then
    PyTorch's ``_CudaKernel`` call launches it, never as a programmatic dependent: its wait is then a no-op)."""
    try:
        cuda = driver()
        cuda.cuLaunchKernelEx if pdl else cuda.cuLaunchKernel   # noqa: B018 - a driver without it falls back
    except (AttributeError, OSError):
        return None
    return KernelLaunch(kernel, plan.grid(rows), (32 * plan.warps, 1, 1), plan.dynamic_shared(tokens, mapped),
                        cuda, ARG_POINTERS, ARG_INTS, pdl)


_WORKSPACE: dict[tuple[int, str], dict[str, torch.Tensor]] = {}


def split_k_workspace(device: torch.device, partial_numel: int, counters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partial sums and row-block counters, one pair per device shared by every layer (the
    kernels run one after another on a stream; each leaves its counters at zero). Grown, never shrunk;
    made outside any CUDA graph's pool."""
    from shuffleprune.runtime.graph_pools import outside_graph_pools

    key = (device.index or 0, device.type)
    ws = _WORKSPACE.get(key)
    if ws is None or ws["partial"].numel() < partial_numel or ws["counters"].numel() < counters:
        p = max(partial_numel, 0 if ws is None else ws["partial"].numel(), 1)
        c = max(counters, 0 if ws is None else ws["counters"].numel(), 1)
        ws = _WORKSPACE[key] = outside_graph_pools(lambda: {
            "partial": torch.empty(p, device=device, dtype=torch.float32),
            "counters": torch.zeros(c, device=device, dtype=torch.int32)}, device)
    return ws["partial"], ws["counters"]


def device_index(device: torch.device) -> int:
    """The CUDA device's index (the current one where ``device`` names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def stream_handle(device: torch.device) -> int:
    """The current stream's ``CUstream`` on ``device`` (a graph's capture stream while one is captured)."""
    return torch.cuda.current_stream(device).cuda_stream


def launch_plan(x: torch.Tensor, values: torch.Tensor, tiled: bool = False, has_bias: bool = False,
                mapped: bool = False, tall: bool = False, **override) -> SparseMmaPlan:
    """The plan :func:`nm_sparse_mma` launches for ``x`` on ``values`` (the compiled kernel's occupancy in it)."""
    return _launch(x.numel() // x.shape[-1], values.shape[0], 2 * values.shape[1], x.dtype, tiled, has_bias, mapped,
                   device_index(x.device), tuple(sorted(override.items())), False, tall)[1]


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


def nm_sparse_mma(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, bias: torch.Tensor | None = None,
                  tiled: bool = False, perm: torch.Tensor | None = None, plan: SparseMmaPlan | None = None,
                  pdl: bool = False, tall: bool = False, **override) -> torch.Tensor:
    """``x[..., perm] @ Wᵀ + bias`` for a 2:4 ``W`` held as ``values`` ``[R, C/2]`` and position ``words``
    ``[R, C/32]`` (row words, or cuSPARSELt's order when ``tiled``) on the sparse tensor cores; ``perm`` (int32,
    1–16 tokens) is read by the kernel itself, else ``x`` is already in the weight's column order (gathered).
    ``plan`` (or ``override``'s fields) replaces :func:`sparse_mma_plan`'s (``tall``: :func:`tall_plan`'s);
    ``pdl`` launches it as a programmatic dependent where the GPU has them (compute capability 9.0 or more)."""
    rows, cols = values.shape[0], 2 * values.shape[1]
    x2 = x.reshape(-1, cols)
    tokens = x2.shape[0]
    mapped = perm is not None
    if not sparse_mma_applies(tokens, rows, cols, 2, 4, x.dtype, mapped) or values.dtype != x.dtype:
        raise ValueError(f"the sparse-MMA decode takes 2:4 16-bit weights of the input's dtype, 1-{MAX_TOKENS} "
                         f"tokens ({MAPPED_MAX_TOKENS} through a map), columns in steps of {STEP} and rows in 16s; "
                         f"not {tokens} tokens of {x.dtype} "
                         f"on [{rows}, {cols}] {values.dtype}")
    if not (values.is_contiguous() and words.is_contiguous() and words.dtype == torch.int32 and
            words.shape == (rows, cols // 32) and values.data_ptr() % 16 == 0 and words.data_ptr() % 8 == 0):
        raise ValueError("the sparse-MMA decode reads contiguous values (16-byte aligned) and int32 position words "
                         f"[{rows}, {cols // 32}] (8-byte aligned); got {tuple(words.shape)} {words.dtype}")
    if mapped and (perm.dtype != torch.int32 or perm.shape != (cols,) or not perm.is_contiguous() or
                   perm.data_ptr() % 16):
        raise ValueError(f"the sparse-MMA decode reads its index map as int32 [{cols}] (16-byte aligned), not "
                         f"{perm.dtype} {tuple(perm.shape)}")
    if x2.stride(-1) != 1 or x2.stride(0) % 2 or x2.data_ptr() % 4:
        x2 = x2.contiguous()
    ring = not mapped and (tall or override.get("stage") or (plan is not None and plan.stage))
    if ring and (x2.stride(0) % 4 or x2.data_ptr() % 8):   # the ring's 8-byte copies: rows 8-byte aligned
        x2 = x2.clone(memory_format=torch.contiguous_format)
    index = device_index(x.device)
    if plan is None:
        kernel, plan, bound = _launch(tokens, rows, cols, x.dtype, tiled, bias is not None, mapped, index,
                                      tuple(sorted(override.items())), pdl and _capability(index)[0] >= 9, tall)
    else:
        check_plan(plan, tokens, rows, cols, mapped)
        kernel = _compiled(tuple(kernel_defines(plan, x.dtype, tiled, bias is not None, ordered_metadata(),
                                                mapped).items()), index)
        _allow_shared(kernel, plan, tokens, mapped)
        bound = _bound(kernel, plan, rows, tokens, mapped, False)
    y = torch.empty(tokens, rows, device=x.device, dtype=x.dtype)
    grid = plan.grid(rows)
    partial, counters = split_k_workspace(x.device, plan.splits * tokens * rows if plan.splits > 1 else 0, grid[0])
    tensors = [x2, values, words, perm if mapped else words, bias if bias is not None else values, y, partial, counters]
    ints = [tokens, rows, cols, x2.stride(0), plan.ks]
    if bound is not None:
        bound(tensors, ints, stream_handle(x.device))
    else:
        kernel(grid=grid, block=(32 * plan.warps, 1, 1), shared_mem=plan.dynamic_shared(tokens, mapped),
               args=[*tensors, *ints])
    return y.reshape(*x.shape[:-1], rows)


def plan_fields(plan: SparseMmaPlan) -> dict:
    """A plan as a dict (results files, compile checks)."""
    return asdict(plan)
