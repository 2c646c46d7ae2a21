"""An index map's gather, ``y[t, j] = x[t, perm[j]]``, as a Triton kernel that can launch as a programmatic
dependent (:mod:`.overlap`): it lets the next kernel (the decode that reads its output) start at once,
so that kernel prefetches its weight while this one waits for its input and gathers. PyTorch's
``index_select`` does the same work but never lets a kernel start early. Checked on the CPU under
``TRITON_INTERPRET=1`` against ``index_select``.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

from shuffleprune.kernels import overlap

BLOCK_COLS = 1024


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


def gather_columns(x: torch.Tensor, perm: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``x[..., perm]`` (``perm``: int32 ``[C]`` on ``x``'s device) as a new contiguous tensor. ``pdl``:
    launched as a programmatic dependent that lets the next kernel start early, where
    :func:`.overlap.enabled` (else an ordinary launch)."""
    if triton is None:
        return x.index_select(-1, perm)
    cols = x.shape[-1]
    if perm.shape != (cols,):
        raise ValueError(f"perm {tuple(perm.shape)} must be ({cols},)")
    x2 = x.reshape(-1, cols)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.numel():
        pdl = pdl and overlap.enabled(x)
        block = min(BLOCK_COLS, triton.next_power_of_2(cols))
        _gather_columns_kernel[(x2.shape[0], triton.cdiv(cols, block))](
            x2, perm, y, cols, x2.stride(0), y.stride(0), PDL=pdl, BLOCK=block, num_warps=4,
            **overlap.launch_options(pdl))
    return y.view(*x.shape[:-1], cols)
