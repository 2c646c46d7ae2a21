"""The 2:4 decode on the sparse tensor cores (``mma.sp``): ``kernels/nm_sparse_mma.cu``, compiled by NVRTC
at its first call on a GPU (:func:`.cuda_rtc.compile_cuda`, each cubin kept on disk), for 1–64 tokens of 16-bit
inputs.

Triton has no sparse MMA (triton-lang/triton#6891), so every Triton decode expands its 2:4 tile to dense
in registers before ``tl.dot``: that expansion, not the weight's bytes, bounds them from 2 tokens on
(``bench_kernel.json``, H200, 4096×4096: 1.0–1.5 TB/s at 16–64 tokens where cuBLAS moved 2.5–2.8). ``mma.sp``
multiplies the kept values as they lie, each position code a 2-bit index the tensor core reads itself, so the decode's
work per weight byte is the same at 1 token as at 64. It reads the layer's one buffer as it is (the
export's row words, or cuSPARSELt's order after ``use_cslt_layout``): no copy, no re-layout. The
kernel's text says how lanes map to the MMA's fragments; :mod:`.sparse_mma_tiles` plans its grid
(:func:`.sparse_mma_tiles.sparse_mma_plan`, and :func:`.sparse_mma_tiles.tall_plan` the other launch, whose CTAs
stage the input in shared memory and share it among more rows).

The same ``.cu`` text runs on the CPU under ``tests/sparse_mma_emulator.hpp`` (a CUDA thread model
with the MMA computed as the PTX ISA defines it), which is how the tests check it against float64.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from shuffleprune.kernels.cuda_rtc import (CudaSource, KernelLaunch, allow_dynamic_shared, compile_cuda, driver,
                                           resident_ctas)
from shuffleprune.kernels.gpu import _capability
from shuffleprune.kernels.sparse_mma_tiles import (DEFAULT_CTAS_PER_SM, MAPPED_MAX_TOKENS, MAX_TOKENS, SHARED_LIMIT, STEP,
                                                   SparseMmaPlan, check_plan, sparse_mma_applies, sparse_mma_plan,
                                                   tall_plan)

SOURCE = Path(__file__).with_name("nm_sparse_mma.cu")
COMMON = Path(__file__).with_name("nm_sparse_common.cuh")   # what the decode and the prompt GEMM share
KERNEL_NAME = "nm_sparse_mma"
ARG_POINTERS, ARG_INTS = 8, 5   # the kernel's parameters: x, values, words, perm, bias, y, partial, counters; T, R,
                                # C, xs, KS
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


def sparse_mma_available(device: torch.device) -> bool:
    """Whether ``device`` runs it: an NVIDIA GPU of compute capability 8.0 or more (sparse ``mma``). It is
    compiled at its first call by NVRTC called here or by PyTorch's ``torch.cuda._compile_kernel`` (2.8 and
    later); where neither works the call raises and ``auto`` leaves it out."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return _capability(device_index(device))[0] >= 8


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
    again with the compiled kernel's occupancy in place of :data:`.sparse_mma_tiles.DEFAULT_CTAS_PER_SM`, its warps kept (once per
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


def nm_sparse_mma(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, bias: torch.Tensor | None = None,
                  tiled: bool = False, perm: torch.Tensor | None = None, plan: SparseMmaPlan | None = None,
                  pdl: bool = False, tall: bool = False, **override) -> torch.Tensor:
    """``x[..., perm] @ Wᵀ + bias`` for a 2:4 ``W`` held as ``values`` ``[R, C/2]`` and position ``words``
    ``[R, C/32]`` (row words, or cuSPARSELt's order when ``tiled``) on the sparse tensor cores; ``perm`` (int32,
    1–16 tokens) is read by the kernel itself, else ``x`` is already in the weight's column order (gathered).
    ``plan`` (or ``override``'s fields) replaces :func:`.sparse_mma_tiles.sparse_mma_plan`'s (``tall``: :func:`.sparse_mma_tiles.tall_plan`'s);
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
