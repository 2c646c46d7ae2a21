"""Split-K for the N:M kernels: float32 partial sums of column splits, added in split order (the
same sum, bit for bit, whichever split finishes last).

The last split program of each output tile adds them in the same launch (:func:`write_output` with
``SUM_HERE``, counting arrivals in :func:`split_counters`); where no counters can be had, a second,
small kernel does (:func:`sum_partials`).
"""
from __future__ import annotations

import torch

from shuffleprune.kernels.gpu import cdiv
from shuffleprune.kernels.launch import fast
from shuffleprune.runtime.graph_pools import outside_graph_pools

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

if triton is not None:
    @triton.jit
    def write_output(acc, y_offs, p_offs, ok, brows, brow_ok, bias_ptr, y_ptr, part_ptr, count_ptr, pid_s, row0,
                     tok0, T, R, stride_yt, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, SUM_HERE: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
        """Float32 ``acc`` to ``y`` at ``y_offs`` (+ the bias of rows ``brows``), or split ``pid_s``'s partial
        sums (``[SPLIT, T, R]``, ``p_offs`` within one split); ``SUM_HERE``: then :func:`_sum_in_last_split`
        for the output tile from row ``row0`` and token ``tok0``."""
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(bias_ptr + brows, mask=brow_ok, other=0.0).to(tl.float32)
            tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(part_ptr + pid_s * T * R + p_offs, acc, mask=ok)
            if SUM_HERE:
                _sum_in_last_split(bias_ptr, y_ptr, part_ptr, count_ptr, row0, tok0, T, R, stride_yt, HAS_BIAS,
                                   SPLIT, BLOCK_R, BLOCK_T)

    @triton.jit
    def _sum_in_last_split(bias_ptr, y_ptr, part_ptr, count_ptr, row0, tok0, T, R, stride_yt,
                           HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_T: tl.constexpr):
        """Split-K without a second launch: the split programs of an output tile (``program_id(0)``) count
        their arrivals in ``count_ptr``, and the last to arrive adds the ``SPLIT`` partial sums in split
        order (the same sum, bit for bit, as :func:`sum_partials`, whatever the arrival order), adds the
        bias, writes ``y`` and sets its counter back to 0 (:func:`last_to_arrive`, :func:`reset_counter`). It
        reads them 16 tokens at a time, in a layout of its own (a GEMM's 256-token tile summed at once
        raised its registers from 117 to 134, one program fewer per SM)."""
        if last_to_arrive(count_ptr, tl.program_id(0), SPLIT):
            CHUNK_T: tl.constexpr = BLOCK_T if BLOCK_T < 16 else 16
            rows = row0 + tl.arange(0, BLOCK_R)
            if HAS_BIAS:
                bias = tl.load(bias_ptr + rows, mask=rows < R, other=0.0).to(tl.float32)[None, :]
            for t in range(tok0, tok0 + BLOCK_T, CHUNK_T):
                toks = t + tl.arange(0, CHUNK_T)
                ok = (toks < T)[:, None] & (rows < R)[None, :]
                offs = toks[:, None] * R + rows[None, :]
                total = tl.zeros((CHUNK_T, BLOCK_R), dtype=tl.float32)
                for s in range(SPLIT):
                    total += tl.load(part_ptr + s * T * R + offs, mask=ok, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += bias
                tl.store(y_ptr + toks[:, None] * stride_yt + rows[None, :], total.to(y_ptr.dtype.element_ty), mask=ok)
            reset_counter(count_ptr, tl.program_id(0))

    @triton.jit
    def last_to_arrive(count_ptr, tile, SPLIT: tl.constexpr):
        """Whether this program is the last of the ``SPLIT`` that share counter ``tile`` to arrive: every
        thread's partial sums are stored before the barrier, then one thread's release-acquire atomic
        publishes them and reads the count (CUTLASS's split-K semaphore pattern; sm_90a: ``MEMBAR.GPU``,
        the atomic, ``CCTL.IVALL``). The last reads the others' sums from L2 (``.cg``) and then calls
        :func:`reset_counter`."""
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        return arrived == SPLIT - 1

    @triton.jit
    def reset_counter(count_ptr, tile):
        """Counter ``tile`` back to 0 for the next launch that takes it (:func:`split_counters`)."""
        tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed", scope="gpu")


    @triton.jit
    def _sum_partials_kernel(part_ptr, bias_ptr, y_ptr, numel, R, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr,
                             BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(part_ptr + s * numel + offs, mask=ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs % R, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def partials(split: int, y: torch.Tensor) -> torch.Tensor:
    """Split-K's float32 partial sums ``[split, T, R]`` of output ``y`` (``y`` itself when unsplit)."""
    return torch.empty(split, *y.shape, dtype=torch.float32, device=y.device) if split > 1 else y


SPLIT_COUNTERS = 1 << 16   # arrival counters per device (256 KB of int32), handed out as a ring
_COUNTERS: dict[torch.device, list] = {}   # device → [the zeroed counters, where the next launch's start]


def split_counters(device: torch.device, tiles: int) -> torch.Tensor | None:
    """Zeroed int32 arrival counters, one per output tile, for a split-K launch that sums its partial
    sums in-kernel (:func:`_sum_in_last_split`; each launch leaves its counters at 0 again). One
    buffer per device, made outside any CUDA graph capture and kept for the process (a captured
    graph holds its address), handed out as a ring: launches in flight together on different
    streams take different counters unless :data:`SPLIT_COUNTERS` tiles' worth of launches came
    between them. ``None`` — the separate sum kernel then — for more tiles than that, or during a
    capture before any launch outside one made the buffer (one made inside a capture would be
    zeroed only when the graph first runs)."""
    if tiles > SPLIT_COUNTERS:
        return None
    entry = _COUNTERS.get(device)   # keyed by the device itself: its str() cost microseconds at every split launch
    if entry is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = outside_graph_pools(lambda: torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device), device)
        entry = _COUNTERS[device] = [counters, 0]
    counters, start = entry
    if start + tiles > SPLIT_COUNTERS:
        start = 0
    entry[1] = start + tiles
    return counters[start:start + tiles]


def summing(split: int, tiles: int, device: torch.device, sum_in_kernel: bool | None) -> torch.Tensor | None:
    """The counters for an in-kernel split-K sum (``sum_in_kernel`` ``None``: wherever
    :func:`split_counters` has them; ``False``: never), else ``None``."""
    if split == 1 or sum_in_kernel is False:
        return None
    return split_counters(device, tiles)


def sum_partials(part: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    """The splits' partial sums added, plus the bias, written into ``y`` in its dtype: one launch
    (PyTorch's sum, add and cast took three, each a few microseconds on a graph's critical path)."""
    numel, block = y.numel(), 1024
    fast(_sum_partials_kernel)[(cdiv(numel, block),)](part, bias if bias is not None else part, y, numel,
                                                       y.shape[-1], SPLIT=part.shape[0], HAS_BIAS=bias is not None,
                                                       BLOCK=block, num_warps=4)
    return y
