"""One launch for every expert of a fused MoE projection held compressed N:M (the export's experts).

A layer's ``E`` experts are stacked: values ``[E, R, K]``, position words ``[E, R, W]`` (the word
layout of :mod:`.nm_words`), index maps ``[E, C]`` (int32; an expert without one holds the identity).
The router's ``(token, slot)`` pairs (``P = tokens · top_k``, pair ``p`` = token ``p // top_k``) are
grouped by expert on the device (:func:`route_blocks`: no host synchronisation, so a decode step
captures into a CUDA graph; once per layer, the second projection reusing the first's :class:`Routes`) into blocks of at most ``BLOCK_T`` pairs of one expert. A program owns
``BLOCK_R`` rows of one block's expert and one split of its kept values and runs the decode loops of
:mod:`.decode_loops` on the block's input rows (``x`` row ``pair // X_DIV``: the hidden state for the
first projection, the pair's own row for the second), so each expert's weight tile is read once for
all the pairs routed to it. Up to :data:`.decode_tiles.SELECT_MAX_TOKENS` pairs per block it is the select
loop, above that the tensor-core loop with the weight as the MMA's A operand. Split-K writes float32
partial sums that one ``sum`` adds (in split order: deterministic). Output: ``[P, R]``, one row per
pair; pairs routed to no local expert (ids ``≥ E``: expert-parallel sentinels) are left at zero.
With maps, one launch first gathers every pair's input in its expert's order (:func:`gather_pairs`),
and the kernel reads that in order.

Checked on the CPU under ``TRITON_INTERPRET=1`` against float64; compiled for sm_90a by
``scripts/check_kernels_compile.py``; timed on an H200 (``scripts/bench_moe.py`` → ``bench_moe.json``,
2026-11-28, Mixtral-8x7B's experts, before the gather: the kernel read its input through the maps).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from shuffleprune.kernels import gpu
from shuffleprune.kernels.gpu import cdiv, next_pow2
from shuffleprune.kernels.launch import fast
from shuffleprune.kernels.decode_tiles import DECODE_MAX_TOKENS, DECODE_STAGES, decode_max_tokens, decode_plan
from shuffleprune.kernels.nm_decode import triton, word_gather
from shuffleprune.kernels.nm_words import check_pattern

if triton is not None:
    import triton.language as tl

    from shuffleprune.kernels.decode_loops import dot_loop, select_loop

    @triton.jit
    def _route_blocks_kernel(ids_ptr, slot_ptr, expert_ptr, P, E, SLOTS, BLOCKS,
                             BT: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr):
        """:func:`route_blocks` for at most ``BLOCK_P`` pairs in one program, by comparing every pair with
        every other (no sort): a pair's rank among its expert's pairs, its expert's pair count, and the
        blocks of the experts before it, summed over each expert's first pair (its leader)."""
        p = tl.arange(0, BLOCK_P)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1).to(tl.int64)
        live = (p < P) & (ids >= 0) & (ids < E)
        key = tl.where(live, ids, E)
        same = (key[:, None] == key[None, :]) & live[:, None] & live[None, :]           # [pair, other pair]
        rank = tl.sum((same & (p[None, :] < p[:, None])).to(tl.int32), axis=1)
        blocks = (tl.sum(same.to(tl.int32), axis=1) + BT - 1) // BT                  # of the pair's expert
        leader = live & (rank == 0)
        first = tl.sum(tl.where(leader[None, :] & (key[None, :] < key[:, None]), blocks[None, :], 0), axis=1)
        for s0 in range(0, SLOTS, CHUNK):   # every slot empty, then each local pair's filled
            s = s0 + tl.arange(0, CHUNK)
            tl.store(slot_ptr + s, tl.zeros([CHUNK], tl.int32) + P, mask=s < SLOTS)
        tl.debug_barrier()
        tl.store(slot_ptr + first * BT + rank, p.to(tl.int32), mask=live)
        for b0 in range(0, BLOCKS, CHUNK):   # a block's expert: the leader whose blocks cover it, else −1
            b = b0 + tl.arange(0, CHUNK)
            cover = leader[None, :] & (b[:, None] >= first[None, :]) & (b[:, None] < first[None, :] + blocks[None, :])
            expert = tl.max(tl.where(cover, key[None, :], -1), axis=1)
            tl.store(expert_ptr + b, expert.to(tl.int32), mask=b < BLOCKS)

    @triton.jit
    def _gather_pairs_kernel(x_ptr, perm_ptr, ids_ptr, out_ptr, C, E, stride_xt, X_DIV, BLOCK_C: tl.constexpr):
        """Columns block ``program_id(1)`` of pair ``program_id(0)``'s row: its input row (``pair // X_DIV``)
        read through its expert's map. A pair with no local expert reads the last expert's (its output
        stays zero whatever it reads)."""
        p = tl.program_id(0).to(tl.int64)
        e = tl.load(ids_ptr + p).to(tl.int64)
        e = tl.minimum(tl.maximum(e, 0), E - 1)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = c < C
        src = tl.load(perm_ptr + e * C + c, mask=ok, other=0)
        v = tl.load(x_ptr + (p // X_DIV) * stride_xt + src, mask=ok)
        tl.store(out_ptr + p * C + c, v, mask=ok)

    @triton.jit
    def _nm_experts_kernel(x_ptr, val_ptr, word_ptr, perm_ptr, y_ptr, part_ptr, slot_ptr, expert_ptr,
                           P, R, K, C, WORDS, stride_xt, X_DIV, K_PER_SPLIT,
                           N: tl.constexpr, M: tl.constexpr, BITS: tl.constexpr, HAS_PERM: tl.constexpr,
                           SPLIT: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                           STAGES: tl.constexpr, X_WORDS: tl.constexpr, NATIVE: tl.constexpr):
        """Rows ``program_id(0)`` of block ``program_id(1)``'s expert for its pairs, kept values of split
        ``program_id(2)``. A block no pair filled (expert −1) runs no step and stores nothing."""
        pid_b, pid_s = tl.program_id(1), tl.program_id(2)
        expert = tl.load(expert_ptr + pid_b)
        live = expert >= 0
        e = tl.maximum(expert, 0).to(tl.int64)   # 64-bit offsets: E·R·K passes 2³¹ on large MoE models
        pairs = tl.load(slot_ptr + pid_b * BLOCK_T + tl.arange(0, BLOCK_T))
        pair_ok = pairs < P
        xrows = tl.where(pair_ok, pairs // X_DIV, 0)
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < R
        k_start = pid_s * K_PER_SPLIT
        k_end = tl.where(live, tl.minimum(k_start + K_PER_SPLIT, K), k_start)
        vals, words = val_ptr + e * R * K, word_ptr + e * R * WORDS
        perm = perm_ptr + e * C if HAS_PERM else perm_ptr
        if USE_DOT:
            acc = dot_loop(x_ptr, vals, words, perm, rows, row_ok, xrows, pair_ok, k_start, k_end, K, C, WORDS,
                           stride_xt, N, M, BITS, HAS_PERM, PREC, UPCAST, BLOCK_R, BLOCK_K, BLOCK_T, STAGES, True,
                           False, X_WORDS, NATIVE)
        else:
            acc = select_loop(x_ptr, vals, words, perm, rows, row_ok, xrows, pair_ok, k_start, k_end, K, C, WORDS,
                              stride_xt, N, M, BITS, HAS_PERM, BLOCK_R, BLOCK_K, BLOCK_T, STAGES, False, X_WORDS)
        offs = pairs.to(tl.int64)[None, :] * R + rows[:, None]
        ok = row_ok[:, None] & pair_ok[None, :]
        if SPLIT == 1:
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(part_ptr + pid_s * P * R + offs, acc, mask=ok)


def experts_block_t(pairs: int, experts: int, limit: int = DECODE_MAX_TOKENS) -> int:
    """Pairs per block: the mean pairs per expert that some pair chose, as a power of two — 1 while
    most experts get at most one pair (each block then a matrix-vector product on the select
    loop), at most ``limit`` (the decode's widest token tile, :func:`decode_max_tokens`)."""
    mean = cdiv(pairs, max(1, min(experts, pairs)))
    return min(limit, 1 << max(0, (mean - 1).bit_length()))


ROUTE_KERNEL_PAIRS = 64   # the most pairs route_blocks groups in one launch (its pair-by-pair tiles: 64 × 64;
                          # 128 × 128 spilled on any warp count under Triton 3.6, the H100's)


def route_blocks(expert_ids: torch.Tensor, num_experts: int, block_t: int,
                 kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the router's choices ``expert_ids`` (any shape, flattened into pairs) by expert, in blocks of
    ``block_t`` slots: ``slots`` int32 ``[blocks·block_t]`` (the pair of each slot, ``P`` where empty)
    and ``block_expert`` int32 ``[blocks]`` (−1 for a block no pair filled), with ``blocks =
    ⌈P/block_t⌉ + min(E, P)``, a bound fixed by the shapes. Pairs of an expert keep their order; ids
    outside ``0 … E−1`` are dropped. Nothing waits on the host. Up to :data:`ROUTE_KERNEL_PAIRS` pairs
    on CUDA (a decode step's; ``kernel``: True anywhere Triton runs, False never) one Triton launch does
    it, where PyTorch's sort, scatter and search take about 35 (each a launch of some microseconds on
    the host and on the GPU, once per MoE layer and token)."""
    ids = expert_ids.reshape(-1)
    pairs, device = ids.numel(), ids.device
    blocks = cdiv(pairs, block_t) + min(num_experts, pairs)
    if kernel is None:
        kernel = ids.is_cuda and triton is not None
    if kernel and 0 < pairs <= ROUTE_KERNEL_PAIRS:
        slots = torch.empty(blocks * block_t, dtype=torch.int32, device=device)
        block_expert = torch.empty(blocks, dtype=torch.int32, device=device)
        width = max(16, next_pow2(pairs))
        fast(_route_blocks_kernel)[(1,)](ids.contiguous(), slots, block_expert, pairs, num_experts, slots.numel(),
                                         blocks, BT=block_t, BLOCK_P=width, CHUNK=width, num_warps=max(4, width // 8))
        return slots, block_expert
    ids = ids.long()
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)   # dropped pairs: one bucket past the last
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, key, torch.ones_like(key))
    per_expert = (counts[:num_experts] + block_t - 1) // block_t          # blocks each expert takes
    block_end = per_expert.cumsum(0)
    first_pair = counts.cumsum(0) - counts                                # in the sorted order
    order = key.argsort(stable=True)
    sorted_key = key[order]
    live = sorted_key < num_experts
    rank = torch.arange(pairs, device=device) - first_pair[sorted_key]
    start = (block_end - per_expert)[sorted_key.clamp(max=num_experts - 1)] * block_t
    dest = torch.where(live, start + rank, blocks * block_t)             # dropped pairs to a spill slot
    slots = torch.full((blocks * block_t + 1,), pairs, dtype=torch.int32, device=device)
    slots.scatter_(0, dest, order.to(torch.int32))
    expert = torch.searchsorted(block_end, torch.arange(blocks, device=device), right=True)
    block_expert = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return slots[:-1], block_expert


GATHER_BLOCK_C = 1024   # columns per program of the pairs' gather


def gather_pairs(x2: torch.Tensor, perm: torch.Tensor, expert_ids: torch.Tensor, x_div: int) -> torch.Tensor:
    """``out[p] = x2[p // x_div][perm[e_p]]`` ``[P, C]``: every (token, slot) pair's input in its expert's
    map order (``expert_ids`` ``[P]``, ``perm`` ``[E, C]`` int32), one launch, so the grouped kernel
    then reads its input in order."""
    pairs, cols = expert_ids.numel(), x2.shape[-1]
    out = torch.empty(pairs, cols, dtype=x2.dtype, device=x2.device)
    if pairs:
        fast(_gather_pairs_kernel)[(pairs, cdiv(cols, GATHER_BLOCK_C))](
            x2, perm, expert_ids.reshape(-1).contiguous(), out, cols, perm.shape[0], x2.stride(0), x_div,
            BLOCK_C=GATHER_BLOCK_C, num_warps=4)
    return out


class Routes(NamedTuple):
    """The router's pairs grouped by expert in blocks of ``block_t`` (:func:`route_blocks`)."""

    block_t: int
    slots: torch.Tensor
    block_expert: torch.Tensor


def nm_experts(x: torch.Tensor, values: torch.Tensor, words: torch.Tensor, n: int, m: int, bits: int,
               expert_ids: torch.Tensor, x_div: int = 1, perm: torch.Tensor | None = None,
               block_t: int | None = None, routes: Routes | None = None, gather_first: bool = True,
               **plan_overrides) -> tuple[torch.Tensor, Routes | None]:
    """``y[p] = x[p // x_div][perm_e] @ W_eᵀ`` for every pair ``p`` of ``expert_ids`` (``[P]`` or ``[T,
    top_k]``; ``e`` its expert) → ``[P, R]`` in ``x``'s dtype (zero for a pair with no local expert),
    and the routes it ran on. ``x`` ``[X, C]``; ``values`` ``[E, R, K]``, ``words`` ``[E, R, W]`` int32,
    ``perm`` ``[E, C]`` int32 or ``None``. ``block_t`` (pairs per block) defaults to
    :func:`experts_block_t`; ``routes``: those a call with the same ``expert_ids`` returned (the second
    projection of a layer reuses the first's grouping; made again if its blocks are another width);
    ``gather_first``: with maps, every pair's input is first gathered in its expert's order
    (:func:`gather_pairs`) and the kernel reads it in order; ``False``: the kernel reads ``x`` through
    the maps itself (an H200 ran it 1.2–1.4× the unmapped layer's time at 1–8 tokens of Mixtral-8x7B's
    experts and 3.6–6.7× from 16, ``bench_moe.json``, where a gather moves only ``2·P·C`` elements);
    ``plan_overrides`` (``block_r``, ``block_k``, ``split``, ``stages``, ``num_warps``, ``use_dot``) go
    to the decode plan."""
    check_pattern(n, m, bits)
    experts, rows, kept = values.shape
    cols = x.shape[-1]
    pairs = expert_ids.numel()
    x2 = x.reshape(-1, cols).contiguous()
    y = torch.zeros(pairs, rows, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return y, routes
    if perm is not None and gather_first:
        x2, x_div, perm = gather_pairs(x2, perm, expert_ids, x_div), 1, None
    busy = min(experts, pairs)          # blocks holding pairs when each expert's pairs fit in one block
    tokens = block_t or experts_block_t(pairs, experts, decode_max_tokens(x.element_size()))
    x_words = perm is not None and word_gather(x2)

    def launch(stages: int) -> Routes:   # one launch of the plan at this pipeline depth; the routes it ran on
        nonlocal routes
        plan = decode_plan(rows * busy, kept, tokens, n, m, bits, x.device, element_bytes=x.element_size(),
                           weight_a=True, **{**plan_overrides, "stages": stages})
        block = plan["block_t"]             # the tensor cores take at least 16 tokens: blocks that wide
        if routes is None or routes.block_t != block:
            routes = Routes(block, *route_blocks(expert_ids, experts, block))
        split = plan["split"]
        part = torch.zeros(split, pairs, rows, dtype=torch.float32, device=x.device) if split > 1 else y
        grid = (cdiv(rows, plan["block_r"]), routes.block_expert.numel(), split)
        fast(_nm_experts_kernel)[grid](
            x2, values, words, perm if perm is not None else words, y, part, routes.slots, routes.block_expert,
            pairs, rows, kept, cols, words.shape[-1], x2.stride(0), x_div, plan["per_split"],
            N=n, M=m, BITS=bits, HAS_PERM=perm is not None, SPLIT=split, USE_DOT=plan["use_dot"],
            PREC=gpu.precision(x), UPCAST=gpu.upcast(x), BLOCK_R=plan["block_r"], BLOCK_K=plan["block_k"],
            BLOCK_T=block, STAGES=plan["stages"], X_WORDS=x_words, NATIVE=gpu.native(x), num_warps=plan["num_warps"])
        if split > 1:
            y.copy_(part.sum(0))
        return routes

    # the plan's pipeline depth, or on a GPU with less shared memory than Hopper's the deepest that fits
    key = ("nm_experts", rows * busy, kept, tokens, n, m, bits, x.device, x.dtype, tuple(plan_overrides.items()))
    routes = gpu.with_fewer_stages(launch, plan_overrides.get("stages", DECODE_STAGES), key)[1]
    return y, routes
