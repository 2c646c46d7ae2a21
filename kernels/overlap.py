"""Programmatic dependent launch (Hopper and later): a kernel starts while the one before it finishes.

Launched with ``launch_pdl=True``, a kernel's programs may become resident once every program of the
kernel before it has called :func:`release_next` (``griddepcontrol.launch_dependents``), instead of
after that kernel has ended. Until :func:`wait_for_inputs` (``griddepcontrol.wait``: the kernel before
has ended and its writes are visible) such a kernel may only read what no kernel writes — its own
weight and index map — and write nothing. The decode kernels use that window to pull the first part of their
weight — values and their position words — into L2 (:func:`prefetch_rows`,
:func:`shuffleprune.kernels.nm_words.prefetch_positions`) while the previous layer's kernel still streams its own, so a
layer's first loads neither wait for its launch nor for DRAM. A kernel the one before never releases
(cuBLAS, PyTorch's elementwise kernels) starts as usual when that one ends: nothing is lost, nothing
overlaps. Order stays transitive: a kernel's programs release the next only after their own wait.

Under ``TRITON_INTERPRET=1`` none of this runs: :func:`enabled` is false off a CUDA GPU of compute
capability 9 or more, and the kernels then compile without it (the CPU tests check they compute the
same; ``kernels/compile_check.py`` checks the sm_90a binary holds the wait, the release and the
prefetches, in that order before the first load of the input).
"""
from __future__ import annotations

import inspect
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None


def _grid_dependency_control() -> tuple | None:
    """Triton's ``(gdc_wait, gdc_launch_dependents)`` where they compile: not before 3.4, and not in 3.4.0
    (PyTorch 2.8's), whose functions take the ``_builder`` its own compiler no longer passes (it passes
    ``_semantic``)."""
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    except ImportError:
        return None
    return (gdc_wait, gdc_launch_dependents) if "_semantic" in inspect.signature(gdc_wait).parameters else None


_GDC = _grid_dependency_control()
HAS_GDC = _GDC is not None
if HAS_GDC:
    gdc_wait, gdc_launch_dependents = _GDC
elif triton is not None:   # every launch is an ordinary one, never called with PDL set: stand-ins the JIT can resolve
    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

from shuffleprune.kernels import gpu

LINE_BYTES = 128                 # one L2 prefetch request per cache line
LINE_WORDS = LINE_BYTES // 4     # 32-bit position words per line
PREFETCH_BYTES = 8 << 20         # weight bytes a GEMM launch pulls into L2 before its input is ready, over all
                                 # programs: about 2.5 µs of an H100's HBM3, a sixth of its 50 MB L2 (not swept)
DECODE_PREFETCH_BYTES = 4 << 20  # the decodes' budget from 2 tokens; at one token none. On an H100
                                 # (tune_pdl.json, 2026-11-27: 1024/4096/11008×4096, 1/2/16 tokens, 0/4/8/16 MiB)
                                 # no prefetch was fastest at one token on every shape and kernel (4096×4096:
                                 # 9.9 µs against 11.1 at 8 MiB), and 4 MiB at 2–16 tokens as fast as 8 or faster
                                 # on all but one row (1 % slower)


def enabled(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device may launch as programmatic dependents (``SHUFFLEPRUNE_PDL=0``
    in the environment turns it off: every kernel then launches plainly)."""
    return HAS_GDC and os.environ.get("SHUFFLEPRUNE_PDL", "1") != "0" and gpu.pdl(x)


def launch_options(pdl: bool) -> dict:
    """The launch keyword a dependent kernel takes (none for an ordinary launch)."""
    return {"launch_pdl": True} if pdl else {}


def position_words_per_row(kept: int, bits: int, tiled: bool) -> int:
    """Position words to prefetch per row beside ``kept`` prefetched kept values (:func:`prefetch_per_row`):
    the words holding them (at least one line's 32 in the export's row-major layout, which is
    prefetched by lines; cuSPARSELt's order by 64-byte slices); 0 where none are prefetched or a
    word does not hold a power of two of positions."""
    per_word = 32 // bits
    if not kept or 32 % bits or per_word & (per_word - 1):
        return 0
    return max(1, kept // per_word) if tiled else max(LINE_WORDS, kept // per_word)


def decode_prefetch_bytes(tokens: int) -> int:
    """The weight bytes a decode launch of ``tokens`` tokens prefetches (:data:`DECODE_PREFETCH_BYTES`)."""
    return DECODE_PREFETCH_BYTES if tokens > 1 else 0


def prefetch_per_row(programs: int, block_rows: int, row_elements: int, element_bytes: int,
                     budget: int | None = None) -> int:
    """Elements of each of a program's rows to prefetch: ``budget`` bytes (default
    :data:`PREFETCH_BYTES`) shared by ``programs`` programs of ``block_rows`` rows, at most the row's
    own ``row_elements``, a power of two of whole lines (0: less than one line each, or nothing to
    prefetch)."""
    budget = PREFETCH_BYTES if budget is None else budget
    line = LINE_BYTES // element_bytes
    share = min(budget // max(1, programs * block_rows * element_bytes), row_elements)
    if share < line:
        return 0
    return 1 << (share.bit_length() - 1)


if triton is not None:
    @triton.jit
    def prefetch_l2(ptrs):
        """One non-blocking L2 prefetch request per address of ``ptrs`` (nothing is read into registers)."""
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                                  dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def prefetch_rows(ptr, rows, row_ok, stride, k_lo, k_hi, COUNT: tl.constexpr, LINE: tl.constexpr):
        """Pull elements ``k_lo … k_lo + COUNT`` (not past ``k_hi``) of rows ``rows`` of a row-major
        matrix into L2, one request per ``LINE`` elements."""
        ks = k_lo + tl.arange(0, COUNT // LINE) * LINE
        ok = row_ok[:, None] & (ks < k_hi)[None, :]
        prefetch_l2(ptr + tl.where(ok, rows[:, None].to(tl.int64) * stride + ks[None, :], 0))   # off: the first line

    @triton.jit
    def wait_for_inputs(PDL: tl.constexpr):
        """Block until the kernel before has ended and its writes are visible (nothing without ``PDL``)."""
        if PDL:
            gdc_wait()

    @triton.jit
    def release_next(PDL: tl.constexpr):
        """Let the next kernel's programs start (they wait for this kernel's end before reading its output)."""
        if PDL:
            gdc_launch_dependents()
