"""An RMSNorm that writes its output in an index map's order, in one pass (the producer-side map).

``y[t, j] = x[t, perm[j]] · rstd(x[t]) · scale[j]`` with ``rstd = 1/sqrt(mean(x[t]²) + eps)`` and
``scale = (weight + offset)[perm]`` precomputed in float32 (``offset`` 1 for norms that multiply by
``1 + weight``). One program per token row: the row is read once for its mean square and once more,
through the map, from cache; the output is written in order. The layers reading it then need no map.
On Hopper it lets the next kernel start at once (:mod:`.overlap`): the decode reading its output
prefetches its weight while the norm runs.
Runs on the CPU under ``TRITON_INTERPRET=1`` (how CI checks it).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

from shuffleprune.kernels import overlap
from shuffleprune.kernels.gpu import next_pow2
from shuffleprune.kernels.launch import BoundLaunch, fast

if triton is not None:
    from shuffleprune.kernels.overlap import release_next

    @triton.jit
    def _rmsnorm_mapped_kernel(x_ptr, scale_ptr, perm_ptr, y_ptr, D, stride_x, stride_y, eps,
                               BLOCK_D: tl.constexpr, RELEASE: tl.constexpr = False):
        """Token row ``program_id(0)``. ``RELEASE``: the next kernel, if launched as a programmatic
        dependent (the decode of the layers reading this output), may start now and prefetch its
        weight; it waits for this kernel's end before reading ``y`` (:mod:`.overlap`)."""
        release_next(RELEASE)
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_D)
        ok = cols < D
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        src = tl.load(perm_ptr + cols, mask=ok, other=0)
        xp = tl.load(x_ptr + row * stride_x + src, mask=ok, other=0.0).to(tl.float32)
        s = tl.load(scale_ptr + cols, mask=ok, other=0.0)
        tl.store(y_ptr + row * stride_y + cols, (xp * rstd * s).to(y_ptr.dtype.element_ty), mask=ok)


def rmsnorm_mapped(x: torch.Tensor, scale: torch.Tensor, perm: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ``[..., D]`` over its last dimension, written in ``perm``'s order (``int32``
    ``[D]``), multiplied by ``scale`` (``float32`` ``[D]``, already in ``perm``'s order)."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    d = x.shape[-1]
    if scale.shape != (d,) or perm.shape != (d,):
        raise ValueError(f"scale {tuple(scale.shape)} and perm {tuple(perm.shape)} must both be ({d},)")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _launch(d, overlap.enabled(x))((x2.shape[0],), x2, scale, perm, y, d, x2.stride(0), y.stride(0), float(eps))
    return y.view(*x.shape)


_LAUNCHES: dict[tuple[int, bool], BoundLaunch] = {}   # the norm's launch by width and dependent release


def _launch(d: int, release: bool) -> BoundLaunch:
    """The norm's launch for rows of ``d`` (its block and warps) and whether it releases a dependent kernel
    early, bound once (:meth:`~.launch.FastKernel.bind`) and looked up: the norm runs twice per decoder
    layer and decode step, and binding its keywords at each call cost host time an eager step pays."""
    bound = _LAUNCHES.get((d, release))
    if bound is None or bound.fast_kernel.kernel is not _rmsnorm_mapped_kernel:   # (a kernel swapped in)
        block = next_pow2(d)
        bound = _LAUNCHES[(d, release)] = fast(_rmsnorm_mapped_kernel).bind(
            8, {"BLOCK_D": block, "num_warps": max(1, min(16, block // 256)), "RELEASE": release})
    return bound
