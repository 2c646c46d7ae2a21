"""Run ``kernels/nm_sparse_gemm.cu`` on the CPU: its text with ``sparse_mma_emulator.hpp`` as the prelude, built by
g++ (:func:`sparse_mma_cpu.build_text`) and called by ctypes."""
from __future__ import annotations

import ctypes

import torch

from shuffleprune.kernels.nm_sparse_gemm import kernel_defines, kernel_source
from shuffleprune.kernels.sparse_gemm_tiles import SparseGemmPlan

from sparse_mma_cpu import HERE, _bytes, _ptr, build_text, emulator


def build(defines: dict, hardware: tuple[str, ...] = ()) -> ctypes.CDLL:
    """The GEMM variant of ``defines`` as a shared library (built once per text; ``hardware``: as in
    :func:`sparse_mma_cpu.emulator`)."""
    lib = build_text(kernel_source(defines, emulator(hardware)) + (HERE / "sparse_gemm_launcher.cpp").read_text(),
                     "sparse_gemm")
    lib.spemu_gemm_launch.restype = ctypes.c_char_p
    return lib


def run_gemm_cpu(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, bias: torch.Tensor | None, tiled: bool,
                 plan: SparseGemmPlan, seed: int = 0, x_stride: int | None = None,
                 counters: torch.Tensor | None = None, hardware: tuple[str, ...] = (),
                 perm: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel's output ``[T, R]`` for ``x`` ``[T, C]`` (rows ``x_stride`` apart if given; a ``mapped`` plan reads
    ``x[:, perm]`` through ``perm``); ``counters`` (the split-K tiles' arrival counts, zeros) is the launch's if given,
    so a test can read it after."""
    rows, cols = values.shape[0], 2 * values.shape[1]
    tokens = x.shape[0]
    lib = build(kernel_defines(plan, x.dtype, tiled, bias is not None, True), hardware)
    y = torch.full((tokens, rows), float("nan"), dtype=x.dtype)
    b = bias if bias is not None else values
    gx, gy, gz = plan.grid(tokens, rows)
    partial = torch.full((max(gz * tokens * rows, 1) if gz > 1 else 1,), float("nan"), dtype=torch.float32)
    counters = torch.zeros(gx * gy, dtype=torch.int32) if counters is None else counters
    m = perm if perm is not None else words   # the kernel's map argument (read only by a mapped plan)
    err = lib.spemu_gemm_launch(ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(gz), ctypes.c_uint(seed), _ptr(x),
                                _bytes(x), _ptr(values), _bytes(values), _ptr(words), _bytes(words), _ptr(b), _bytes(b),
                                _ptr(y), _bytes(y), _ptr(partial), _bytes(partial), _ptr(counters), _bytes(counters),
                                _ptr(m), _bytes(m), ctypes.c_int(tokens), ctypes.c_int(rows), ctypes.c_int(cols),
                                ctypes.c_int(x_stride or x.stride(0)), ctypes.c_int(plan.k_split(cols)),
                                ctypes.c_uint(plan.dynamic_shared(cols)))
    if err is not None:
        raise RuntimeError(err.decode())
    return y
