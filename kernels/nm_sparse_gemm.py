"""The 2:4 GEMM on the sparse tensor cores for prompts: ``kernels/nm_sparse_gemm.cu``, compiled by NVRTC at its first
call on a GPU, like the decode (:mod:`.nm_sparse_mma`, whose device prelude, MMA and fragment readings it shares).

From a few hundred tokens a dense layer is bound by its MMAs, not by its weight's bytes, and every path of this
runtime but cuSPARSELt did the dense FLOPs after expanding the weight, so none could beat cuBLAS there
(``bench_kernel.json``, H200: ``auto`` at 0.56–0.59× cuBLAS at 512 tokens in the export's layout). ``mma.sp`` does
half the MMAs' work for the same result. The decode's CTAs hold each weight byte in registers once and read the
input per warp, which at 512 tokens would bind them to their input loads; here the kept values, position words and
the input's tile are copied into shared memory a stage of 64 columns at a time (``cp.async``,
:data:`.sparse_gemm_tiles.SparseGemmPlan.stages` in flight) and each fragment read there (``ldmatrix``) serves a warp's other tiles: a
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
from pathlib import Path

import torch

from shuffleprune.kernels.cuda_rtc import CudaSource, KernelLaunch, allow_dynamic_shared, compile_cuda, driver
from shuffleprune.kernels.gpu import _capability, smem_per_block_optin
from shuffleprune.kernels.nm_sparse_mma import (DEVICE_PRELUDE, FRAGMENT_KNOBS, device_index,
                                                fragment_reading, ordered_metadata, split_k_workspace,
                                                sparse_mma_available, stream_handle)
from shuffleprune.kernels.nm_sparse_mma import kernel_source as sparse_mma_source
from shuffleprune.kernels.sparse_gemm_tiles import (BK, SparseGemmPlan, check_gemm_plan, check_map_reader,
                                                    sparse_gemm_applies, sparse_gemm_plan)
from shuffleprune.kernels.sparse_mma_tiles import SHARED_LIMIT

SOURCE = Path(__file__).with_name("nm_sparse_gemm.cu")
KERNEL_NAME = "nm_sparse_gemm"
ARG_POINTERS, ARG_INTS = 8, 5  # x, values, words, bias, y, partial, counters, perm; T, R, C, xs, KS


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
    (gathered), or with ``perm`` (int32 ``[C]``, the wgmma decode up to :data:`.sparse_gemm_tiles.WGMMA_MAPPED_MAX_TOKENS` tokens)
    ``x[..., perm] @ Wᵀ + bias``, the map read in the kernel. ``plan`` (or ``override``'s fields) replaces
    :func:`.sparse_gemm_tiles.sparse_gemm_plan`'s; ``wgmma`` plans with Hopper's ``wgmma.mma_async.sp`` (:func:`sparse_wgmma_available`
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


def check_map(perm: torch.Tensor | None, cols: int, tokens: int, wgmma: bool) -> None:
    """Refuse, in one line, a map the kernel cannot read (:func:`.sparse_gemm_tiles.check_map_reader`), or one not contiguous int32
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
