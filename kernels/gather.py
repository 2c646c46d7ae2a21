"""An index map's gather, ``y[t, j] = x[t, perm[j]]``, as Triton kernels that can launch as programmatic
dependents (:mod:`.overlap`): they let the next kernel (the decode that reads their output) start at
once, so that kernel prefetches its weight while this one waits for its input and gathers. PyTorch's
``index_select`` does the same work but never lets a kernel start early.

Two forms:

- :func:`gather_columns`: one program per token row and block of output columns, each element a
  load from wherever the map points in the row. Many small programs: what a few tokens want.
- :func:`gather_rows`: a program reads whole token rows with coalesced loads into shared memory
  (``tl.gather``) and picks the map's elements there. Each element load of the column form (and of
  ``index_select``) fetches a 32-byte sector of which it uses one element; on an H100 both moved 0.4–0.6
  TB/s on 2048 × 11008–14336 (``scripts/results/bench_kernel.json``, ``norm_rows``), while the mapped
  RMSNorm, which reads its row whole before it gathers from cache, took a third of their time. The
  row form's traffic is one coalesced read and one write of the activation. Rows up to
  :data:`ROWS_MAX_BYTES` wide.

Which one a layer uses is measured (``shuffleprune/deploy/input_gather.py``). Both are checked on the
CPU under ``TRITON_INTERPRET=1`` against ``index_select``.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

from shuffleprune.kernels import gpu, overlap
from shuffleprune.kernels.gpu import cdiv, next_pow2
from shuffleprune.kernels.launch import fast

BLOCK_COLS = 1024
ROWS_MAX_BYTES = 64 * 1024   # gather_rows stages a row of at most this many bytes (padded to a power of two)
                             # in shared memory: 32768 columns in 16 bits, 16384 in float32 (Volta, Ampere,
                             # Ada and Hopper give a block 96–227 KB; where a GPU gives less, the launch
                             # fails and the measured choice drops this gather)
ROWS_PER_PROGRAM_MAX = 8     # gather_rows reuses a program's map over at most this many token rows


if triton is not None:
    from shuffleprune.kernels.overlap import release_next, wait_for_inputs

    @triton.jit
    def _gather_columns_kernel(x_ptr, perm_ptr, y_ptr, C, stride_x, stride_y, PDL: tl.constexpr,
                               BLOCK: tl.constexpr):
        """Token row ``program_id(0)``, columns ``program_id(1)·BLOCK …``. With ``PDL`` the next kernel may
        start first (it waits for this one's end before reading ``y``); the map is read before the
        wait (nothing writes it), ``x`` after."""
        release_next(PDL)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < C
        src = tl.load(perm_ptr + cols, mask=ok, other=0)
        wait_for_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        tl.store(y_ptr + row * stride_y + cols, tl.load(x_ptr + row * stride_x + src, mask=ok), mask=ok)


    @triton.jit
    def _gather_rows_kernel(x_ptr, perm_ptr, y_ptr, T, C, stride_x, stride_y, rows,
                            BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Token rows ``program_id(0)·rows …`` (fewer at the end): the map is read once (before the wait,
        nothing writes it), then each row is loaded whole, gathered through the map in shared memory
        and stored in order (a loop, not unrolled: one row's registers at a time)."""
        release_next(PDL)
        cols = tl.arange(0, BLOCK)
        src = tl.load(perm_ptr + cols, mask=cols < C, other=0)
        wait_for_inputs(PDL)
        first = tl.program_id(0).to(tl.int64) * rows
        for i in range(rows):
            row = first + i
            live = cols < tl.where(row < T, C, 0)   # a row past the end loads and stores nothing
            xs = tl.load(x_ptr + row * stride_x + cols, mask=live, other=0.0)
            tl.store(y_ptr + row * stride_y + cols, tl.gather(xs, src, 0), mask=live)


def _rows_2d(x: torch.Tensor, perm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as ``[tokens, C]`` with unit column stride, and an empty output like it (``perm`` checked)."""
    cols = x.shape[-1]
    if perm.shape != (cols,):
        raise ValueError(f"perm {tuple(perm.shape)} must be ({cols},)")
    x2 = x.reshape(-1, cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, torch.empty(x2.shape, dtype=x.dtype, device=x.device)


def rows_fit(cols: int, dtype: torch.dtype) -> bool:
    """Whether :func:`gather_rows` takes rows of ``cols`` elements of ``dtype`` (its staged row, padded to
    a power of two, within :data:`ROWS_MAX_BYTES`)."""
    return triton is not None and next_pow2(cols) * dtype.itemsize <= ROWS_MAX_BYTES


def rows_per_program(tokens: int, sms: int) -> int:
    """Token rows one :func:`gather_rows` program handles: enough to read its map once for several
    rows, few enough to leave about four programs per SM (1 to :data:`ROWS_PER_PROGRAM_MAX`)."""
    return max(1, min(ROWS_PER_PROGRAM_MAX, tokens // (4 * sms)))


def gather_rows(x: torch.Tensor, perm: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``x[..., perm]`` (``perm``: int32 ``[C]`` on ``x``'s device) as a new contiguous tensor, each token
    row read whole into shared memory and gathered there; rows must fit (:func:`rows_fit`). ``pdl``:
    launched as a programmatic dependent, where :func:`.overlap.enabled`."""
    if triton is None:
        return x.index_select(-1, perm)
    if not rows_fit(x.shape[-1], x.dtype):
        raise ValueError(f"gather_rows stages at most {ROWS_MAX_BYTES} bytes per row; {x.shape[-1]} columns of "
                         f"{x.dtype} do not fit: use gather_columns")
    x2, y = _rows_2d(x, perm)
    tokens, cols = x2.shape
    if tokens:
        block = next_pow2(cols)
        rows = rows_per_program(tokens, gpu.sm_count(x.device))
        pdl = pdl and overlap.enabled(x)
        fast(_gather_rows_kernel)[(cdiv(tokens, rows),)](
            x2, perm, y, tokens, cols, x2.stride(0), y.stride(0), rows, BLOCK=block, PDL=pdl,
            num_warps=max(4, min(16, block // 512)), **overlap.launch_options(pdl))
    return y.view(*x.shape[:-1], cols)


def gather_columns(x: torch.Tensor, perm: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``x[..., perm]`` (``perm``: int32 ``[C]`` on ``x``'s device) as a new contiguous tensor. ``pdl``:
    launched as a programmatic dependent that lets the next kernel start early, where
    :func:`.overlap.enabled` (else an ordinary launch)."""
    if triton is None:
        return x.index_select(-1, perm)
    x2, y = _rows_2d(x, perm)
    cols = x2.shape[1]
    if x2.numel():
        pdl = pdl and overlap.enabled(x)
        block = min(BLOCK_COLS, next_pow2(cols))
        fast(_gather_columns_kernel)[(x2.shape[0], cdiv(cols, block))](
            x2, perm, y, cols, x2.stride(0), y.stride(0), PDL=pdl, BLOCK=block, num_warps=4,
            **overlap.launch_options(pdl))
    return y.view(*x.shape[:-1], cols)
